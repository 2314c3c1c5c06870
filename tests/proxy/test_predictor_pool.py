"""Balancing, failover, cooldown and DNS expansion of the predictor pool, on its own.

The replicas here are httpx.MockTransport handlers: this checks the pool's choices; the tests
in test_domain/test_faults run real predictor processes.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from moe_l2_contracts.schemas.predict import PredictRequest
from moe_l2_proxy.discovery import Endpoint, expand, resolve_all
from moe_l2_proxy.metrics import GatewayMetrics
from moe_l2_proxy.predictor_pool import PredictorPool

ANSWER = {"domain": "math", "confidence": 0.9, "lang": "en", "tier": "keyword", "scores": {"math": 0.9}}


def pool_with(handler, urls, **kwargs) -> tuple[PredictorPool, GatewayMetrics]:
    metrics = GatewayMetrics()
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return PredictorPool(urls, client, metrics, **kwargs), metrics


def run(coro):
    return asyncio.run(coro)


def test_round_robin_over_replicas():
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        return httpx.Response(200, json=ANSWER)

    pool, _ = pool_with(handler, ["http://10.0.0.1:1", "http://10.0.0.2:1"])

    async def go():
        return [await pool.predict(PredictRequest(text="x"), 1.0) for _ in range(4)]

    answers = run(go())
    assert [a.domain for a in answers] == ["math"] * 4
    assert seen == ["10.0.0.1", "10.0.0.2", "10.0.0.1", "10.0.0.2"]


def test_failover_and_cooldown():
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        if request.url.host == "10.0.0.1":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json=ANSWER)

    pool, metrics = pool_with(handler, ["http://10.0.0.1:1", "http://10.0.0.2:1"], cooldown_s=60)

    async def go():
        return [await pool.predict(PredictRequest(text="x"), 1.0) for _ in range(3)]

    assert all(a is not None for a in run(go()))
    assert seen == ["10.0.0.1", "10.0.0.2", "10.0.0.2", "10.0.0.2"]  # tried once, then skipped
    assert metrics.predictor_failures.labels("http://10.0.0.1:1", "unreachable")._value.get() == 1


def test_budget_bounds_a_hung_replica():
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(10)
        return httpx.Response(200, json=ANSWER)

    pool, _ = pool_with(handler, ["http://10.0.0.1:1"], cooldown_s=60)

    async def go():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        answer = await pool.predict(PredictRequest(text="x"), 0.05)
        return answer, loop.time() - t0, await pool.predict(PredictRequest(text="x"), 0.05)

    answer, elapsed, second = run(go())
    assert answer is None and elapsed < 1.0
    assert second is None and pool.candidates() == []  # cooling down


@pytest.mark.parametrize("status", [500, 422])
def test_bad_answers_are_failures(status):
    pool, _ = pool_with(lambda request: httpx.Response(status, json={"detail": "no"}), ["http://10.0.0.1:1"])
    assert run(pool.predict(PredictRequest(text="x"), 1.0)) is None


def test_invalid_answer_is_a_failure():
    pool, _ = pool_with(lambda request: httpx.Response(200, json={"domain": 3}), ["http://10.0.0.1:1"])
    assert run(pool.predict(PredictRequest(text="x"), 1.0)) is None


def test_expand_one_name_to_every_address():
    async def resolver(host: str, port: int) -> list[str]:
        assert (host, port) == ("predictor", 11437)
        return ["172.18.0.5", "172.18.0.6", "fd00::7"]

    endpoints = run(expand("http://predictor:11437", resolver))
    assert endpoints == [
        Endpoint("http://172.18.0.5:11437", "predictor:11437"),
        Endpoint("http://172.18.0.6:11437", "predictor:11437"),
        Endpoint("http://[fd00::7]:11437", "predictor:11437"),
    ]
    assert run(expand("http://10.1.2.3:9", resolver)) == [Endpoint("http://10.1.2.3:9")]


def test_expand_keeps_an_unresolvable_name():
    async def resolver(host: str, port: int) -> list[str]:
        raise OSError("no such host")

    assert run(expand("http://nowhere:1", resolver)) == [Endpoint("http://nowhere:1")]


def test_real_resolution_of_localhost():
    assert "127.0.0.1" in run(resolve_all("localhost", 80))


def test_refresh_follows_the_replica_set():
    addresses = [["10.0.0.1"], ["10.0.0.1", "10.0.0.2"]]

    async def resolver(host: str, port: int) -> list[str]:
        return addresses.pop(0)

    pool, _ = pool_with(lambda request: httpx.Response(200, json=ANSWER), ["http://predictor:1"], resolver=resolver)

    async def go():
        await pool.refresh()
        one = [e.url for e in pool.endpoints]
        await pool.refresh()
        return one, [e.url for e in pool.endpoints]

    assert run(go()) == (["http://10.0.0.1:1"], ["http://10.0.0.1:1", "http://10.0.0.2:1"])
