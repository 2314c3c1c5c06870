"""Where a request's domain comes from, and that llama receives it."""

from __future__ import annotations

import re
import sys

import httpx
import pytest
import yaml

from moe_l2_contracts.domains import DEFAULT_DOMAINS
from moe_l2_domains.keywords import KeywordClassifier
from moe_l2_ops.supervisor import ServiceSpec, http_ok
from tests.conftest import LlamaServer
from tests.proxy.support import chat_body, llama_spec

pytestmark = pytest.mark.llama


def llama_tags(llama: LlamaServer) -> set[str]:
    """Every domain tag llama's telemetry holds: routing tables, token counts and /metrics label sets.
    (A plain GET of /moe/routing is not an admin call: no token is sent.)"""
    routing = httpx.get(f"{llama.url}/moe/routing", timeout=30).raise_for_status().json()
    labels = set(re.findall(r'domain="([^"]*)"', llama.metrics()))
    return set(routing.get("domains", {})) | set(routing.get("tokens_by_domain", {})) | labels


def test_header_domain_is_used_and_reaches_llama(gateway, llama32):
    tag = "logic"
    before = llama32.routing()["tokens_by_domain"].get(tag, 0)
    resp = gateway.client.post("/v1/chat/completions", json=chat_body(), headers={"X-MoE-Domain": tag})
    assert resp.status_code == 200
    assert resp.headers["x-moe-domain"] == tag and resp.headers["x-moe-domain-source"] == "header"
    # llama's telemetry counted the tokens of this request under the tag the gateway forwarded
    assert llama32.routing()["tokens_by_domain"].get(tag, 0) > before


def test_unknown_header_domains_are_refused_and_never_reach_llama(gateway, llama32):
    # the 30 header values of the report, which grew llama's label sets and Redis from 13 to 43
    bogus = [f"client_tag_{i:02d}" for i in range(30)]
    before = llama_tags(llama32)
    answers = []
    for i, tag in enumerate(bogus):
        headers = {"X-MoE-Domain": tag}
        match i % 4:
            case 0:
                answers.append(("v1", gateway.client.post("/v1/chat/completions", json=chat_body(), headers=headers)))
            case 1:
                body = {"prompt": "hello", "max_tokens": 2, "stream": True}
                answers.append(("v1", gateway.client.post("/v1/completions", json=body, headers=headers)))
            case 2:
                body = {"model": "d", "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 2}}
                answers.append(("api", gateway.client.post("/api/chat", json=body, headers=headers)))
            case 3:
                body = {"model": "d", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
                answers.append(("api", gateway.client.post("/api/generate", json=body, headers=headers)))
    for (api, resp), tag in zip(answers, bogus, strict=True):
        assert resp.status_code == 400, (tag, resp.status_code, resp.text[:200])
        if api == "v1":
            error = resp.json()["error"]
            assert error["code"] == "unknown_domain" and error["type"] == "invalid_request_error"
            message = error["message"]
        else:
            message = resp.json()["error"]
            assert isinstance(message, str)
        # the answer lists what is valid
        assert all(name in message for name in DEFAULT_DOMAINS), message
    after = llama_tags(llama32)
    assert not (after - before) & set(bogus), after - before
    assert not any(tag.startswith("client_tag_") for tag in after)


@pytest.mark.parametrize("tag", ["_global", "_x", "_"])
def test_reserved_header_domain_is_400(gateway, tag):
    resp = gateway.client.post("/v1/chat/completions", json=chat_body(), headers={"X-MoE-Domain": tag})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "reserved_domain"
    ollama = gateway.client.post(
        "/api/generate", json={"model": "d", "prompt": "hi", "stream": False}, headers={"X-MoE-Domain": tag}
    )
    assert ollama.status_code == 400 and "reserved" in ollama.json()["error"]


def test_passthrough_refuses_an_unknown_domain(gateway):
    resp = gateway.client.get("/v1/models", headers={"X-MoE-Domain": "client_tag_models"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "unknown_domain"
    assert gateway.client.get("/v1/models", headers={"X-MoE-Domain": "math"}).status_code == 200


def test_extra_domains_are_accepted(start_gateway, managed, llama_binary, demo_model, monkeypatch):
    # the operator's own domains (MOE_L2_EXTRA_DOMAINS), configured for llama and the gateway alike
    monkeypatch.setenv("MOE_L2_EXTRA_DOMAINS", "acme_legal,acme_hr")
    llama = managed("extra-domains-llama", llama_spec(llama_binary, demo_model, "extra-domains-llama"))
    llama.start()
    gw = start_gateway(llama.url, MOE_L2_EXTRA_DOMAINS="acme_legal,acme_hr")
    resp = gw.client.post("/v1/chat/completions", json=chat_body(), headers={"X-MoE-Domain": "acme_legal"})
    assert resp.status_code == 200
    assert resp.headers["x-moe-domain"] == "acme_legal" and resp.headers["x-moe-domain-source"] == "header"
    refused = gw.client.post("/v1/chat/completions", json=chat_body(), headers={"X-MoE-Domain": "acme_ops"})
    assert refused.status_code == 400 and "acme_hr" in refused.json()["error"]["message"]


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
    gw = start_gateway(llama32.url, MOE_L2_PREDICTOR_URLS=predictor.url, MOE_L2_PROXY_PREDICT_BUDGET_MS="2000")
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
    gw = start_gateway(
        llama32.url, MOE_L2_PREDICTOR_URLS=f"{first.url},{second.url}", MOE_L2_PROXY_PREDICT_BUDGET_MS="2000"
    )
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
        llama32.url, MOE_L2_PREDICTOR_URLS=f"http://localhost:{predictor.port}", MOE_L2_PROXY_PREDICT_BUDGET_MS="2000"
    )
    endpoints = gw.client.get("/moe/stats").json()["predictor"]["endpoints"]
    assert f"http://127.0.0.1:{predictor.port}" in [e["url"] for e in endpoints]
    assert all(e["host"] == f"localhost:{predictor.port}" for e in endpoints)
    # whatever localhost resolves to (::1 too), one address answers
    sources = {
        gw.client.post("/v1/chat/completions", json=chat_body()).headers["x-moe-domain-source"] for _ in range(3)
    }
    assert "predictor" in sources


def other_taxonomy_predictor(name: str, taxonomy_path: str):
    """A real predictor whose taxonomy is not the gateway's: it answers domains the gateway does not know."""

    def spec(port: int) -> ServiceSpec:
        base = f"http://127.0.0.1:{port}"
        return ServiceSpec(
            name=name,
            argv=[sys.executable, "-m", "moe_l2_predictor"],
            env={
                "MOE_L2_PREDICTOR_PORT": str(port),
                "MOE_L2_PREDICTOR_HOST": "127.0.0.1",
                "MOE_L2_PREDICTOR_TIERS": "keyword",
                "MOE_L2_TAXONOMY_PATH": taxonomy_path,
            },
            health=http_ok(f"{base}/healthz"),
            url=base,
            start_timeout_s=120,
        )

    return spec


def test_a_predicted_domain_outside_the_set_falls_back_to_the_keyword_tier(start_gateway, llama32, managed, tmp_path):
    doc = {
        "fallback": "chitchat",
        "domains": [
            {"name": "chitchat", "description": "small talk", "keywords": ["hello"], "examples": ["hi", "hello"]},
            {"name": "cooking", "description": "recipes", "keywords": {"recipe": 3}, "examples": ["a recipe"]},
        ],
    }
    path = tmp_path / "taxonomy.yaml"
    path.write_text(yaml.safe_dump(doc))
    predictor = managed("other-taxonomy-predictor", other_taxonomy_predictor("other-taxonomy-predictor", str(path)))
    predictor.start()
    gw = start_gateway(llama32.url, MOE_L2_PREDICTOR_URLS=predictor.url, MOE_L2_PROXY_PREDICT_BUDGET_MS="2000")
    text = "a recipe for bread, then write a python function that parses a csv file"
    assert httpx.post(f"{predictor.url}/v1/predict", json={"text": text}, timeout=30).json()["domain"] == "cooking"
    resp = gw.client.post("/v1/chat/completions", json=chat_body(text))
    assert resp.status_code == 200
    assert gw.metric("moe_l2_predictor_request_seconds_count", endpoint=predictor.url) >= 1  # it was asked
    assert resp.headers["x-moe-domain-source"] == "fallback"
    assert resp.headers["x-moe-domain"] == KeywordClassifier().predict(text).domain
    assert "cooking" not in llama_tags(llama32)
