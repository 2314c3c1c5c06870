"""Where a request's domain comes from, and that llama receives it."""

from __future__ import annotations

import pytest

from moe_l2_common.keywords import KeywordClassifier
from tests.proxy.support import chat_body

pytestmark = pytest.mark.llama


def test_header_domain_is_used_and_reaches_llama(gateway, llama32):
    tag = "gwtest_header_tag"
    resp = gateway.client.post("/v1/chat/completions", json=chat_body(), headers={"X-MoE-Domain": tag})
    assert resp.status_code == 200
    assert resp.headers["x-moe-domain"] == tag and resp.headers["x-moe-domain-source"] == "header"
    # llama's telemetry counted the tokens of this request under the tag the gateway forwarded
    assert llama32.routing()["tokens_by_domain"].get(tag, 0) > 0


def test_header_domain_on_ollama_and_completions(gateway):
    headers = {"X-MoE-Domain": "math"}
    chat = gateway.client.post(
        "/api/chat",
        json={
            "model": "d",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": False,
            "options": {"num_predict": 2},
        },
        headers=headers,
    )
    assert chat.headers["x-moe-domain"] == "math" and chat.headers["x-moe-domain-source"] == "header"
    completion = gateway.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers)
    assert completion.headers["x-moe-domain-source"] == "header"


def test_invalid_header_domain_is_400(gateway):
    resp = gateway.client.post("/v1/chat/completions", json=chat_body(), headers={"X-MoE-Domain": "not a tag!"})
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "invalid_domain"


@pytest.mark.parametrize(
    "text",
    [
        "write a python function that parses a csv file",
        "solve the equation 3x + 5 = 20 and compute the derivative",
        "translate this sentence into French",
        "帮我写一个 Python 函数来解析 JSON",
    ],
)
def test_fallback_is_the_keyword_tier(gateway, text):
    resp = gateway.client.post("/v1/chat/completions", json=chat_body(text))
    assert resp.headers["x-moe-domain-source"] == "fallback"
    assert resp.headers["x-moe-domain"] == KeywordClassifier().predict(text).domain


def test_fallback_reads_the_last_user_turn(gateway):
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "translate this sentence into French"},
        {"role": "assistant", "content": "Bien sûr."},
        {"role": "user", "content": "now write a python function that parses a csv file"},
    ]
    resp = gateway.client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert resp.headers["x-moe-domain"] == KeywordClassifier().predict(messages[-1]["content"]).domain


def test_predictor_answer_is_used(start_gateway, llama32, start_predictor):
    predictor = start_predictor()
    gw = start_gateway(llama32.url, MOE_L2_PREDICTOR_URLS=predictor.url, MOE_L2_PREDICT_BUDGET_MS="2000")
    text = "my program crashes with a segmentation fault, here is the stack trace"
    expected = gw.client.post(f"{predictor.url}/v1/predict", json={"messages": [{"role": "user", "content": text}]})
    resp = gw.client.post("/v1/chat/completions", json=chat_body(text))
    assert resp.headers["x-moe-domain-source"] == "predictor"
    assert resp.headers["x-moe-domain"] == expected.json()["domain"]
    generated = gw.client.post(
        "/api/generate", json={"model": "d", "prompt": text, "stream": False, "options": {"num_predict": 2}}
    )
    assert generated.headers["x-moe-domain-source"] == "predictor"


def test_predictor_replicas_are_balanced_with_failover(start_gateway, llama32, start_predictor):
    first, second = start_predictor("predictor-a"), start_predictor("predictor-b")
    gw = start_gateway(llama32.url, MOE_L2_PREDICTOR_URLS=f"{first.url},{second.url}", MOE_L2_PREDICT_BUDGET_MS="2000")
    for _ in range(6):
        assert gw.client.post("/v1/chat/completions", json=chat_body()).headers["x-moe-domain-source"] == "predictor"
    calls = {p.url: gw.metric("moe_l2_predictor_request_seconds_count", endpoint=p.url) for p in (first, second)}
    assert calls == {first.url: 3, second.url: 3}

    first.kill()
    for _ in range(4):
        resp = gw.client.post("/v1/chat/completions", json=chat_body())
        assert resp.headers["x-moe-domain-source"] == "predictor"  # the other replica answers
    assert gw.metric("moe_l2_predictor_failures_total", endpoint=first.url) == 1  # then it cools down
    assert gw.metric("moe_l2_predictor_request_seconds_count", endpoint=second.url) == 3 + 4


def test_host_name_is_expanded_to_its_addresses(start_gateway, llama32, start_predictor):
    predictor = start_predictor()
    gw = start_gateway(
        llama32.url, MOE_L2_PREDICTOR_URLS=f"http://localhost:{predictor.port}", MOE_L2_PREDICT_BUDGET_MS="2000"
    )
    endpoints = gw.client.get("/moe/stats").json()["predictor"]["endpoints"]
    assert f"http://127.0.0.1:{predictor.port}" in [e["url"] for e in endpoints]
    assert all(e["host"] == f"localhost:{predictor.port}" for e in endpoints)
    # whatever localhost resolves to (::1 too), one address answers
    sources = {
        gw.client.post("/v1/chat/completions", json=chat_body()).headers["x-moe-domain-source"] for _ in range(3)
    }
    assert "predictor" in sources
