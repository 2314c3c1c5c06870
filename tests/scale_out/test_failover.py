"""A llama replica killed mid-run: every request still succeeds (retried on the other replica before
the client saw a byte), the dead replica's domains move to the other, and come back when it returns."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from moe_l2_domains.known import known_domains
from moe_l2_proxy.routing import AffinityRouting
from tests.cache.test_e2e import wait_for
from tests.cache.traffic import domain_prompt
from tests.metrics import sample_sum
from tests.proxy.support import GatewayProc

from .conftest import Replica, gateway_metrics

DOMAINS = sorted(known_domains())


def ask(client: httpx.Client, planted: dict, domain: str, seed: int, stream: bool = False) -> int:
    body = {
        "messages": [{"role": "user", "content": domain_prompt(planted, domain, seed=seed)}],
        "max_tokens": 16,
        "temperature": 0,
        "stream": stream,
    }
    resp = client.post("/v1/chat/completions", json=body, headers={"X-MoE-Domain": domain})
    return resp.status_code


def served(client: httpx.Client, replica: str, domains: list[str]) -> float:
    text = gateway_metrics(client)
    return sum(sample_sum(text, "moe_l2_replica_requests_total", replica=replica, domain=d) for d in domains)


def test_a_killed_replica_loses_no_request_and_gets_its_domains_back(
    start_replica: Callable[..., Replica], start_gateway: Callable[..., GatewayProc], planted: dict
) -> None:
    a, b = start_replica("failover-a"), start_replica("failover-b")
    key_a, key_b = a.llama.url.removeprefix("http://"), b.llama.url.removeprefix("http://")
    gw = start_gateway(
        "",
        MOE_L2_LLAMA_URLS=f"{a.llama.url},{b.llama.url}",
        MOE_L2_PROXY_LLAMA_COOLDOWN_S="1",
        MOE_L2_PROXY_LLAMA_PROBE_INTERVAL_S="0.2",
    )
    # which domains live on a: the gateway's own rule, on the same two keys
    routing = AffinityRouting(DOMAINS, 0.25)
    pool = [type("R", (), {"key": k, "in_flight": 0})() for k in (key_a, key_b)]
    homes_a = [d for d in DOMAINS if routing.home(d, pool) == key_a]
    assert homes_a and len(homes_a) < len(DOMAINS)

    statuses: list[int] = []
    done = threading.Event()
    with httpx.Client(base_url=gw.url, timeout=120) as client:

        def traffic() -> None:
            with ThreadPoolExecutor(8) as workers:
                jobs = [(DOMAINS[i % len(DOMAINS)], i) for i in range(240)]
                for status in workers.map(lambda job: ask(client, planted, *job), jobs):
                    statuses.append(status)
            done.set()

        runner = threading.Thread(target=traffic)
        runner.start()
        wait_for(lambda: len(statuses) >= 40, "40 answers")
        a.llama.kill()  # SIGKILL, with requests in flight on it
        killed_at = len(statuses)
        during_before = served(client, key_b, homes_a)
        wait_for(lambda: len(statuses) >= killed_at + 60, "60 answers with a dead")
        # a's domains went to b meanwhile
        assert served(client, key_b, homes_a) > during_before
        a.llama.start()  # the same port: the replica comes back
        runner.join(timeout=300)
        assert done.is_set()
        assert statuses == [200] * 240, {s: statuses.count(s) for s in set(statuses)}

        wait_for(
            lambda: sample_sum(gateway_metrics(client), "moe_l2_replica_healthy", replica=key_a) == 1,
            "a back in rotation",
        )
        back_before = served(client, key_a, homes_a)
        for i, domain in enumerate(homes_a * 2):
            assert ask(client, planted, domain, 1000 + i) == 200
        # home again: every one of a's domains went to a (nothing else is in flight)
        assert served(client, key_a, homes_a) - back_before == 2 * len(homes_a)
        failures = sample_sum(gateway_metrics(client), "moe_l2_replica_failures_total", replica=key_a)
        assert failures >= 1
