"""The replica pool on its own (moe_l2_proxy.replicas): failover, rest, in-flight accounting, hints,
DNS expansion. llama's answers are scripted per replica; the real replicas are in tests/scale_out."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from moe_l2_proxy.errors import GatewayError
from moe_l2_proxy.metrics import GatewayMetrics
from moe_l2_proxy.replicas import LlamaPool
from moe_l2_proxy.settings import ProxySettings
from moe_l2_proxy.upstream import LlamaUpstream
from tests.metrics import sample_sum

DOMAINS = ["codegen", "math", "legal", "medical"]
URLS = ["http://10.0.0.1:11436", "http://10.0.0.2:11436", "http://10.0.0.3:11436"]


def pool(
    *urls: str, resolver: Callable[[str, int], Awaitable[list[str]]] | None = None, **settings: object
) -> LlamaPool:
    config = ProxySettings(llama_urls=",".join(urls or URLS), llama_cooldown_s=60, **settings)
    extra = {"resolver": resolver} if resolver else {}
    llamas = LlamaPool(
        config, GatewayMetrics(), httpx.AsyncClient(), httpx.AsyncHTTPTransport(), None, DOMAINS, **extra
    )
    asyncio.run(llamas.refresh())
    return llamas


def answering(script: dict[str, object], tried: list[str]) -> Callable[[LlamaUpstream], Awaitable[httpx.Response]]:
    """Each replica's answer: a status code, or a GatewayError to raise; unscripted replicas answer 200."""

    async def send(llama: LlamaUpstream) -> httpx.Response:
        tried.append(llama.url)
        outcome = script.get(llama.url, 200)
        if isinstance(outcome, GatewayError):
            raise outcome
        assert isinstance(outcome, int)
        return httpx.Response(outcome, content=b"{}")

    return send


def refused() -> GatewayError:
    return GatewayError(
        503, "llama-server is unavailable (connection failed); retry later", code="upstream_unavailable"
    )


def test_a_refused_connection_is_retried_on_the_next_replica_and_that_one_rests() -> None:
    llamas = pool(routing="round_robin")
    tried: list[str] = []
    lease, response = asyncio.run(llamas.send("codegen", answering({URLS[0]: refused()}, tried)))
    assert response.status_code == 200 and tried == URLS[:2] and lease.replica.url == URLS[1]
    assert [r.resting for r in llamas.replicas] == [True, False, False]
    assert [r.in_flight for r in llamas.replicas] == [0, 1, 0]
    lease.release()
    lease.release()  # once only
    assert [r.in_flight for r in llamas.replicas] == [0, 0, 0]
    text = llamas.metrics.render().decode()
    assert sample_sum(text, "moe_l2_replica_failures_total", replica="10.0.0.1:11436", reason="unavailable") == 1
    assert sample_sum(text, "moe_l2_replica_healthy", replica="10.0.0.1:11436") == 0
    assert sample_sum(text, "moe_l2_routing_decisions_total", outcome="retry") == 1


def test_a_resting_replica_takes_no_requests_while_others_can() -> None:
    llamas = pool(routing="round_robin")
    llamas.rest(llamas.replicas[0], "unavailable")
    tried: list[str] = []
    for _ in range(4):
        lease, _ = asyncio.run(llamas.send(None, answering({}, tried)))
        lease.release()
    assert URLS[0] not in tried


def test_a_broken_connection_is_retried_but_a_timeout_is_not() -> None:
    llamas = pool(routing="round_robin")
    broken = GatewayError(502, "llama-server connection failed: ReadError", code="upstream_protocol")
    tried: list[str] = []
    asyncio.run(llamas.send(None, answering({URLS[0]: broken}, tried)))
    assert tried == URLS[:2]
    slow = GatewayError(504, "llama-server did not answer in time", code="upstream_timeout")
    tried.clear()
    llamas = pool(routing="round_robin")
    with pytest.raises(GatewayError) as raised:
        asyncio.run(llamas.send(None, answering({URLS[0]: slow}, tried)))
    assert raised.value.status == 504 and tried == URLS[:1]
    assert all(r.in_flight == 0 for r in llamas.replicas)


def test_a_503_goes_to_the_next_replica_but_the_last_replicas_answer_is_the_clients() -> None:
    llamas = pool(routing="round_robin")
    tried: list[str] = []
    _, response = asyncio.run(llamas.send(None, answering({URLS[0]: 503}, tried)))
    assert response.status_code == 200 and tried == URLS[:2]
    single = pool(URLS[0])
    _, response = asyncio.run(single.send(None, answering({URLS[0]: 503}, [])))
    assert response.status_code == 503  # one llama: its own answer, as before there were replicas


def test_when_every_replica_fails_the_error_says_so_and_nothing_stays_in_flight() -> None:
    llamas = pool()
    with pytest.raises(GatewayError) as raised:
        asyncio.run(llamas.send("codegen", answering(dict.fromkeys(URLS, refused()), [])))
    assert raised.value.status == 503 and raised.value.message.startswith("all 3 llama replicas failed")
    assert all(r.in_flight == 0 and r.resting for r in llamas.replicas)
    tried: list[str] = []
    _, response = asyncio.run(llamas.send("codegen", answering({}, tried)))  # all rest: still tried
    assert response.status_code == 200 and not llamas.replicas[URLS.index(tried[0])].resting


def test_a_cancelled_request_leaves_nothing_in_flight() -> None:
    llamas = pool()

    async def hang(llama: LlamaUpstream) -> httpx.Response:
        await asyncio.sleep(60)
        raise AssertionError

    async def go() -> None:
        task = asyncio.ensure_future(llamas.send("codegen", hang))
        await asyncio.sleep(0.01)
        assert sum(r.in_flight for r in llamas.replicas) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert all(r.in_flight == 0 for r in llamas.replicas)


def test_each_replica_is_every_address_of_its_name_with_its_own_cache_manager() -> None:
    async def resolver(host: str, port: int) -> list[str]:
        assert (host, port) == ("llama", 11436)
        return ["172.18.0.5", "172.18.0.6"]

    llamas = pool(
        "http://llama:11436",
        "http://10.0.0.9:11436",
        resolver=resolver,
        cache_urls="http://{host}:11438,http://cm:11438",
    )
    assert [r.key for r in llamas.replicas] == ["172.18.0.5:11436", "172.18.0.6:11436", "10.0.0.9:11436"]
    config = llamas.settings
    llamas = LlamaPool(
        config,
        GatewayMetrics(),
        httpx.AsyncClient(),
        httpx.AsyncHTTPTransport(),
        httpx.AsyncClient(),
        DOMAINS,
        resolver=resolver,
    )

    async def go() -> list[str | None]:
        await llamas.refresh()
        urls = [r.hints.url if r.hints else None for r in llamas.replicas]
        await llamas.stop()
        return urls

    assert asyncio.run(go()) == [
        "http://172.18.0.5:11438/v1/hint",
        "http://172.18.0.6:11438/v1/hint",
        "http://cm:11438/v1/hint",
    ]


def test_the_chosen_replicas_cache_manager_hears_the_domain() -> None:
    config = ProxySettings(llama_urls=",".join(URLS[:2]), cache_urls="http://cm-a:1,http://cm-b:2")
    llamas = LlamaPool(
        config, GatewayMetrics(), httpx.AsyncClient(), httpx.AsyncHTTPTransport(), httpx.AsyncClient(), DOMAINS
    )

    async def go() -> tuple[str, list[str], list[str]]:
        await llamas.refresh()
        for sender in llamas._senders.values():
            await sender.stop()  # keep the hints queued, to look at them
        lease, _ = await llamas.send("legal", answering({}, []))
        queued = [
            [r.hints.queue.get_nowait() for _ in range(r.hints.queue.qsize())] for r in llamas.replicas if r.hints
        ]
        return lease.replica.url, queued[0], queued[1]

    chosen, a, b = asyncio.run(go())
    assert (a, b) == ((["legal"], []) if chosen == URLS[0] else ([], ["legal"]))


def test_discovered_pairing_asks_each_cache_manager_which_llama_it_serves() -> None:
    async def resolver(host: str, port: int) -> list[str]:
        return {"llama": ["172.18.0.5", "172.18.0.6"], "cache-manager": ["172.18.0.7", "172.18.0.8", "172.18.0.9"]}[
            host
        ]

    serves = {  # what each cache-manager's GET /v1/stats says; .9 claimed nothing (or is not up)
        "172.18.0.7": "http://172.18.0.6:11436",
        "172.18.0.8": "http://172.18.0.5:11436",
    }

    def stats(request: httpx.Request) -> httpx.Response:
        llama = serves.get(request.url.host)
        return httpx.Response(200, json={"llama_url": llama}) if llama else httpx.Response(503)

    config = ProxySettings(
        llama_urls="http://llama:11436", cache_urls="http://cache-manager:11438", cache_pairing="discover"
    )
    hint_client = httpx.AsyncClient(transport=httpx.MockTransport(stats))
    llamas = LlamaPool(
        config, GatewayMetrics(), httpx.AsyncClient(), httpx.AsyncHTTPTransport(), hint_client, DOMAINS, resolver
    )

    async def go() -> dict[str, str | None]:
        await llamas.refresh()
        paired = {r.key: r.hints.url if r.hints else None for r in llamas.replicas}
        serves.pop("172.18.0.8")  # that cache-manager went away: its replica gets no hints
        await llamas.refresh()
        paired["after"] = llamas.replicas[0].hints.url if llamas.replicas[0].hints else None
        await llamas.stop()
        return paired

    assert asyncio.run(go()) == {
        "172.18.0.5:11436": "http://172.18.0.8:11438/v1/hint",
        "172.18.0.6:11436": "http://172.18.0.7:11438/v1/hint",
        "after": None,
    }


def test_discovered_pairing_takes_any_number_of_cache_manager_entries() -> None:
    # position pairing would refuse 2 cache-managers for 3 llama entries; discovery does not pair by count
    ProxySettings(
        llama_urls="http://a:1,http://b:1,http://c:1", cache_urls="http://x:2,http://y:2", cache_pairing="discover"
    )
    with pytest.raises(ValueError, match="one per entry"):
        ProxySettings(llama_urls="http://a:1,http://b:1,http://c:1", cache_urls="http://x:2,http://y:2")


def test_a_cache_manager_that_names_llama_by_host_serves_its_address() -> None:
    async def resolver(host: str, port: int) -> list[str]:
        return {"llama": ["172.18.0.5"], "cache-manager": ["172.18.0.7"]}[host]

    def stats(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"llama_url": "http://llama:11436"})  # no claim: as configured

    config = ProxySettings(
        llama_urls="http://llama:11436", cache_urls="http://cache-manager:11438", cache_pairing="discover"
    )
    hint_client = httpx.AsyncClient(transport=httpx.MockTransport(stats))
    llamas = LlamaPool(
        config, GatewayMetrics(), httpx.AsyncClient(), httpx.AsyncHTTPTransport(), hint_client, DOMAINS, resolver
    )

    async def go() -> str | None:
        await llamas.refresh()
        url = llamas.replicas[0].hints.url if llamas.replicas[0].hints else None
        await llamas.stop()
        return url

    assert asyncio.run(go()) == "http://172.18.0.7:11438/v1/hint"
