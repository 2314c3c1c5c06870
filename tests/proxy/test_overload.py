"""Overload, in short (bench/overload.py at scale): idle connections, slow writers, slow readers,
oversized bodies and a burst of generations well past the gateway's limits, all at once against a real
gateway process in front of a real llama-server. What is asserted is behaviour, not timing: every
refusal is a 429/503 carrying Retry-After, the excess burst is refused rather than queued, /healthz
answers throughout, the gateway's memory stays under a generous bound, and it still serves after."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from bench.overload import Mix, overload
from tests.conftest import LlamaServer
from tests.proxy.support import GatewayProc, chat_body

LIMITS = {
    "MOE_L2_PROXY_MAX_CONNECTIONS": "150",
    "MOE_L2_PROXY_LLAMA_MAX_CONNECTIONS": "4",
    "MOE_L2_PROXY_MAX_WAITING": "4",
    "MOE_L2_PROXY_WAIT_TIMEOUT_S": "5",
    "MOE_L2_PROXY_HEADER_TIMEOUT_S": "2",
    "MOE_L2_PROXY_BODY_TIMEOUT_S": "2",
    "MOE_L2_PROXY_MAX_BODY_BYTES": str(1 << 20),
}


def test_overload_is_refused_with_retry_after_while_health_answers(
    start_gateway: Callable[..., GatewayProc], llama32: LlamaServer
) -> None:
    gw = start_gateway(llama32.url, **LIMITS)
    mix = Mix(idle=40, slow_writers=20, slow_readers=20, oversized=20, burst=80)
    report = asyncio.run(overload(gw.url, gw.proc.pid, mix, duration_s=6))
    summary = report.summary()

    refused = [o for o in report.outcomes if o.status in (429, 503)]
    assert refused, summary
    assert all(o.retry_after for o in refused), summary
    # the burst went past what may be in flight and wait: the rest was told to come back, at once
    burst = [o for o in report.outcomes if o.kind == "burst"]
    assert any(o.code == "overloaded" for o in burst), summary
    assert all(o.status in (200, 503) for o in burst), summary
    assert all(o.status in (413, 503) for o in report.outcomes if o.kind == "oversized"), summary
    assert all(o.status in (408, 503) for o in report.outcomes if o.kind == "idle"), summary

    # liveness answered every probe, over the connection limit included
    assert len(report.probe_statuses) >= 10 and set(report.probe_statuses) == {200}, summary
    assert report.rss_peak_bytes < 512 * 2**20, summary
    assert gw.proc.poll() is None
    resp = gw.client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    assert resp.status_code == 200
