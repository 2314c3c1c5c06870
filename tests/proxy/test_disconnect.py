"""A client that leaves stops its generation, blocking requests included, and is counted as 499
(client closed request), never as a 500 with a stack trace."""

from __future__ import annotations

import json
import time

import pytest

from tests.proxy.support import chat_body, connect, metric_value, raw_request, wait_until

pytestmark = pytest.mark.llama

TOKENS = 4000  # per request: the demo model's whole context (4096), several seconds of generation
CLIENTS = 2  # long_llama's slots

BLOCKING = {
    "/v1/chat/completions": {**chat_body("tell me everything", max_tokens=TOKENS), "ignore_eos": True},
    "/v1/completions": {"prompt": "tell me everything", "max_tokens": TOKENS, "ignore_eos": True},
    "/api/chat": {
        "model": "demo",
        "messages": [{"role": "user", "content": "tell me everything"}],
        "stream": False,
        "options": {"num_predict": TOKENS},
    },
    "/api/generate": {
        "model": "demo",
        "prompt": "tell me everything",
        "stream": False,
        "options": {"num_predict": TOKENS},
    },
}


def llama_counters(llama) -> tuple[float, float]:
    text = llama.metrics()
    return metric_value(text, "llamacpp:tokens_predicted_total"), metric_value(text, "llamacpp:requests_processing")


def leave_after(url: str, path: str, body: dict, clients: int, seconds: float) -> None:
    """`clients` raw connections send the request, and all close `seconds` later without reading."""
    data = json.dumps(body).encode()
    socks = [connect(url) for _ in range(clients)]
    for sock in socks:
        sock.sendall(raw_request("POST", path, data))
    time.sleep(seconds)
    for sock in socks:
        sock.close()


@pytest.mark.slow
@pytest.mark.parametrize("path", list(BLOCKING))
def test_blocking_request_stops_generating_when_its_client_leaves(start_gateway, long_llama, path):
    """The issue's case: blocking clients gone after 0.3 s, yet llama generated everything they asked
    for. The gateway relays a blocking request as it is and closes llama's connection when its client
    leaves; stock llama-server noticed that only when a full second passed with no result of any
    request in the server, and this test scrapes llama's /metrics every 0.25 s, as a Prometheus under
    load would, so it stops only with patch 0001 (its one deadline per wait)."""
    gw = start_gateway(long_llama.url)
    assert wait_until(lambda: llama_counters(long_llama)[1] == 0, timeout_s=60)
    before, _ = llama_counters(long_llama)

    leave_after(gw.url, path, BLOCKING[path], CLIENTS, 0.3)
    # llama's slots are released and its token counter stops growing
    stopped = wait_until(lambda: llama_counters(long_llama)[1] == 0, timeout_s=30, interval_s=0.25)
    assert stopped, f"llama was still generating 30 s after the clients left ({llama_counters(long_llama)})"
    settled, _ = llama_counters(long_llama)
    time.sleep(1.0)
    after, busy = llama_counters(long_llama)
    generated = after - before
    print(f"{path}: {generated:.0f} tokens generated for {CLIENTS} clients gone after 0.3 s")
    assert after == settled and busy == 0
    # uncancelled, each would have generated its TOKENS (4,000)
    assert generated < CLIENTS * TOKENS / 4, generated
    assert wait_until(lambda: gw.metric("moe_l2_requests_total", route=path, status="499") == CLIENTS, 5)


def test_disconnects_are_499_without_a_stack_trace(start_gateway, long_llama):
    """Clients leaving at every stage: while their body is read (generation routes, a FastAPI route,
    Ollama), while a blocking answer is generated, in the middle of a stream."""
    gw = start_gateway(long_llama.url)
    body = json.dumps(chat_body()).encode()
    half_body = ["/v1/chat/completions", "/v1/embeddings", "/api/chat", "/api/generate"]
    for path in half_body:
        with connect(gw.url) as sock:
            sock.sendall(raw_request("POST", path, body[:10], content_length=len(body)))
            time.sleep(0.3)
    leave_after(gw.url, "/v1/chat/completions", {**chat_body(max_tokens=TOKENS), "ignore_eos": True}, 1, 0.3)
    stream = {"prompt": "tell me everything", "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    with connect(gw.url) as sock:
        sock.sendall(raw_request("POST", "/v1/completions", json.dumps(stream).encode()))
        sock.settimeout(30)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    expected = {path: 1 for path in half_body}
    expected["/v1/chat/completions"] += 1
    expected["/v1/completions"] = 1

    def counted() -> bool:
        text = gw.metrics_text()
        return all(
            metric_value(text, "moe_l2_requests_total", route=route, status="499") == n for route, n in expected.items()
        )

    assert wait_until(counted, timeout_s=10), gw.metrics_text()
    assert gw.metric("moe_l2_requests_total", status="500") == 0
    log = gw.log_text()
    assert "Traceback" not in log and "ERROR" not in log, log
