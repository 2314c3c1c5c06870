"""Real faults: llama stopped and restarted, the predictor killed or frozen, the cache-manager absent or hung."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.proxy.support import chat_body, until_predicted, wait_until

pytestmark = pytest.mark.llama

BUDGET_MS = 50
COOLDOWN_S = 3.0


def predicting(predictor_url: str) -> dict[str, str]:
    return {
        "MOE_L2_PREDICTOR_URLS": predictor_url,
        "MOE_L2_PROXY_PREDICT_BUDGET_MS": str(BUDGET_MS),
        "MOE_L2_PROXY_PREDICTOR_COOLDOWN_S": str(COOLDOWN_S),
    }


def test_llama_down_is_503_then_recovers(start_gateway, killable_llama):
    gw = start_gateway(killable_llama.url)
    assert gw.client.post("/v1/chat/completions", json=chat_body()).status_code == 200
    assert gw.client.get("/readyz").status_code == 200

    killable_llama.stop()
    resp = gw.client.post("/v1/chat/completions", json=chat_body())
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "upstream_unavailable" and error["message"]
    streamed = gw.client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert streamed.status_code == 503 and streamed.json()["error"]["code"] == "upstream_unavailable"
    ollama = gw.client.post("/api/chat", json={"model": "demo", "messages": [{"role": "user", "content": "hi"}]})
    assert ollama.status_code == 503 and isinstance(ollama.json()["error"], str)
    assert gw.client.get("/readyz").status_code == 503
    assert gw.client.get("/healthz").status_code == 200  # the gateway itself is alive

    killable_llama.start()  # same port
    resp = gw.client.post("/v1/chat/completions", json=chat_body())
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"]
    assert gw.client.get("/readyz").status_code == 200
    assert gw.metric("moe_l2_upstream_errors_total", upstream="llama", kind="unavailable") >= 3


def domain_timing_ms(resp: httpx.Response) -> float:
    # Server-Timing: domain;dur=12.34
    return float(resp.headers["server-timing"].split("dur=")[1])


def test_predictor_down_falls_back(start_gateway, llama32, start_predictor):
    predictor = start_predictor()
    gw = start_gateway(llama32.url, **predicting(predictor.url))
    until_predicted(gw, predictor.url, COOLDOWN_S)
    text = "fix this segfault in my C++ code"

    predictor.kill()
    t0 = time.perf_counter()
    down = gw.client.post("/v1/chat/completions", json=chat_body(text))
    elapsed = time.perf_counter() - t0
    assert down.status_code == 200
    assert down.headers["x-moe-domain-source"] == "fallback"
    assert down.headers["x-moe-domain"]
    assert domain_timing_ms(down) <= BUDGET_MS + 100
    assert elapsed < BUDGET_MS / 1000 + 2.0
    assert gw.metric("moe_l2_predictor_failures_total", reason="unreachable") == 1


def test_predictor_slower_than_budget_falls_back_within_budget(start_gateway, llama32, start_predictor):
    predictor = start_predictor()
    gw = start_gateway(llama32.url, **predicting(predictor.url))
    until_predicted(gw, predictor.url, COOLDOWN_S)

    timeouts = gw.metric("moe_l2_predictor_failures_total", reason="timeout")
    predictor.freeze()  # SIGSTOP: it still accepts connections (kernel backlog) but never answers
    t0 = time.perf_counter()
    resp = gw.client.post("/v1/chat/completions", json=chat_body("solve the integral of x squared"))
    elapsed = time.perf_counter() - t0
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"]
    assert resp.headers["x-moe-domain-source"] == "fallback"
    assert BUDGET_MS - 5 <= domain_timing_ms(resp) <= BUDGET_MS + 100
    assert elapsed < BUDGET_MS / 1000 + 2.0
    # the frozen replica cools down: the next request does not wait for it again
    again = gw.client.post("/v1/chat/completions", json=chat_body())
    assert again.headers["x-moe-domain-source"] == "fallback" and domain_timing_ms(again) < BUDGET_MS
    assert gw.metric("moe_l2_predictor_failures_total", reason="timeout") == timeouts + 1

    predictor.thaw()


def test_cache_manager_down_does_not_affect_chat(start_gateway, llama32):
    nothing = f"http://127.0.0.1:{_closed_port()}"
    gw = start_gateway(llama32.url, MOE_L2_CACHE_URL=nothing)
    for _ in range(5):
        resp = gw.client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"]
    assert wait_until(lambda: gw.metric("moe_l2_hints_total", outcome="failed") == 5, timeout_s=10)


def test_hung_cache_manager_drops_hints_without_blocking(start_gateway, llama32, black_hole):
    gw = start_gateway(
        llama32.url, MOE_L2_CACHE_URL=black_hole.url, MOE_L2_PROXY_HINT_QUEUE_SIZE="2", MOE_L2_PROXY_HINT_TIMEOUT_S="30"
    )
    t0 = time.perf_counter()
    for _ in range(8):
        assert gw.client.post("/v1/chat/completions", json=chat_body(max_tokens=1)).status_code == 200
    elapsed = time.perf_counter() - t0
    # one hint hangs in flight, two wait in the queue, the rest are dropped; requests never waited
    assert gw.metric("moe_l2_hints_dropped_total") == 5
    assert elapsed < 20


def _closed_port() -> int:
    from moe_l2_ops.supervisor import free_port

    return free_port()
