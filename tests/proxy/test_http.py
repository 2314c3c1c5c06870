"""HTTP behaviour: error formats, limits, API keys, passthrough, metrics, stats, what is logged."""

from __future__ import annotations

import json
import socket
import time

import ollama
import openai
import pytest

from moe_l2_domains.known import known_domains
from moe_l2_proxy.errors import client_mistake
from tests.fuzz.schema_refs import request_validator, unresolved
from tests.proxy.support import chat_body, metric_value

pytestmark = pytest.mark.llama


@pytest.mark.parametrize("body", [b"{bad json", b"", b"[1, 2]", b'{"messages": "not a list"}'])
def test_malformed_body_is_400_openai_error(gateway, body):
    resp = gateway.client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


def test_malformed_body_is_400_ollama_error(gateway):
    resp = gateway.client.post("/api/chat", content=b"{bad json")
    assert resp.status_code == 400
    assert isinstance(resp.json()["error"], str)


def test_unknown_routes_answer_in_the_api_format(gateway):
    assert isinstance(gateway.client.get("/api/nothing").json()["error"], str)
    v1 = gateway.client.get("/v1/nothing")  # passed through: llama's own OpenAI 404
    assert v1.status_code == 404 and v1.json()["error"]["message"]


def test_body_over_the_limit_is_413(start_gateway, llama32):
    gw = start_gateway(llama32.url, MOE_L2_PROXY_MAX_BODY_BYTES="2000")
    small = gw.client.post("/v1/chat/completions", json=chat_body("x" * 100))
    assert small.status_code == 200
    big = gw.client.post("/v1/chat/completions", json=chat_body("x" * 5000))
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit applies while the body streams in
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 500
        yield b'"}]}'

    chunked = gw.client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413
    assert gw.client.post("/api/generate", json={"model": "d", "prompt": "z" * 5000}).json()["error"]


def test_api_keys(start_gateway, llama32):
    gw = start_gateway(llama32.url, MOE_L2_PROXY_API_KEYS="key-one,key-two")
    missing = gw.client.post("/v1/chat/completions", json=chat_body())
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    wrong = gw.client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert gw.client.get("/api/tags", headers={"Authorization": "Bearer nope"}).json()["error"] == "invalid API key"
    for key in ("key-one", "key-two"):
        ok = gw.client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200
    assert gw.client.get("/healthz").status_code == 200  # probes stay open
    assert gw.client.get("/metrics").status_code == 200

    sdk = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-two", max_retries=0)
    assert sdk.chat.completions.create(model="d", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gw.url}/v1", api_key="bad", max_retries=0).models.list()
    client = ollama.Client(host=gw.url, headers={"Authorization": "Bearer key-one"})
    assert client.list().models


def test_llama_api_key_is_sent_only_towards_llama(start_gateway, managed, llama_binary, demo_model):
    from tests.proxy.support import llama_spec

    keyed = managed("keyed-llama", llama_spec(llama_binary, demo_model, "keyed-llama", "--api-key llama-secret"))
    keyed.start()
    without = start_gateway(keyed.url, MOE_L2_PROXY_API_KEYS="client-key")
    auth = {"Authorization": "Bearer client-key"}
    # the client's own key is never forwarded: llama refuses
    assert without.client.post("/v1/chat/completions", json=chat_body(), headers=auth).status_code == 401
    with_key = start_gateway(keyed.url, MOE_L2_PROXY_API_KEYS="client-key", MOE_L2_PROXY_LLAMA_API_KEY="llama-secret")
    assert with_key.client.post("/v1/chat/completions", json=chat_body(), headers=auth).status_code == 200
    assert with_key.client.get("/v1/models", headers=auth).status_code == 200
    ollama_chat = {
        "model": "d",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
        "options": {"num_predict": 2},
    }
    assert with_key.client.post("/api/chat", json=ollama_chat, headers=auth).status_code == 200


def test_passthrough_keeps_method_query_and_body(gateway, llama32):
    # llama's own /v1 routes the gateway does not know about
    emb = gateway.client.post("/v1/embeddings", json={"input": "hello"})
    direct = llama32.client.post("/v1/embeddings", json={"input": "hello"})
    assert emb.status_code == direct.status_code  # 501 here: the demo llama runs without --embeddings
    assert emb.json() == direct.json()
    models = gateway.client.get("/v1/models", params={"x": "1"})
    assert models.status_code == 200 and models.json()["data"]


def test_metrics_and_stats(gateway):
    gateway.client.post("/v1/chat/completions", json=chat_body(stream=True), headers={"X-MoE-Domain": "codegen"})
    ollama_body = {"model": "d", "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 4}}
    gateway.client.post("/api/chat", json=ollama_body)
    text = gateway.metrics_text()
    assert metric_value(text, "moe_l2_requests_total", route="/v1/chat/completions", status="200") >= 1
    assert metric_value(text, "moe_l2_request_duration_seconds_count", route="/v1/chat/completions") >= 1
    assert metric_value(text, "moe_l2_ttft_seconds_count", route="/v1/chat/completions") >= 1
    assert metric_value(text, "moe_l2_ttft_seconds_count", route="/api/chat") >= 1
    assert metric_value(text, "moe_l2_tokens_total", kind="completion") >= 4
    assert metric_value(text, "moe_l2_domain_total", domain="codegen", source="header") >= 1
    for name in ("moe_l2_predictor_request_seconds", "moe_l2_upstream_errors_total", "moe_l2_hints_dropped_total"):
        assert f"# HELP {name.removesuffix('_total')}" in text

    stats = gateway.client.get("/moe/stats").json()
    assert stats["requests"]["total"] >= 2
    assert stats["domains"]["by_source"]["codegen"]["header"] >= 1
    assert abs(sum(stats["domains"]["share"].values()) - 1) < 0.01
    llama = stats["llama"]
    assert llama["reachable"] is True
    assert "codegen" in llama["routed_tokens"] and "hits" in llama and "misses" in llama
    assert "hot_set" in llama


def test_prompts_are_not_logged(start_gateway, llama32):
    gw = start_gateway(llama32.url, MOE_L2_PREDICTOR_URLS=f"http://127.0.0.1:{_free()}", MOE_L2_PROXY_ACCESS_LOG="true")
    secret = "zebracorn-secret-prompt"
    gw.client.post("/v1/chat/completions", json=chat_body(secret))
    gw.client.post("/v1/chat/completions", json=chat_body(secret, stream=True))
    gw.client.post(
        "/api/generate", json={"model": "d", "prompt": secret, "stream": False, "options": {"num_predict": 2}}
    )
    gw.client.post("/v1/chat/completions", content=b'{"messages": "' + secret.encode() + b'"}')
    log = gw.log_text()
    assert "POST /v1/chat/completions" in log  # the access log is on, yet
    assert secret not in log


def _free() -> int:
    from moe_l2_ops.supervisor import free_port

    return free_port()


def read_response(conn: socket.socket) -> bytes:
    """One whole HTTP/1.1 response with a Content-Length (head and body, however the reads split it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data  # closed: an incomplete response, which fails the caller's check
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    while len(body) < int(fields[b"content-length"]) and (chunk := conn.recv(65536)):
        body += chunk
    return head + b"\r\n\r\n" + body


@pytest.mark.slow
def test_idle_client_connection_outlives_the_clients_own_expiry(gateway):
    # httpx and the OpenAI SDK drop idle pooled connections after 5 s. A server that closes at 5 s
    # too races them: a request sent just as the gateway closes fails with a read error.
    host, port = gateway.url.removeprefix("http://").split(":")
    request = f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(request)
        assert read_response(conn).startswith(b"HTTP/1.1 200")
        time.sleep(6.0)
        conn.sendall(request)
        second = read_response(conn)  # same connection, still served
        assert second.startswith(b"HTTP/1.1 200") and second.endswith(b'{"status":"ok"}')


@pytest.mark.parametrize("stream", [False, True])
def test_empty_messages_is_400(gateway, stream):
    resp = gateway.client.post("/v1/chat/completions", json={"messages": [], "max_tokens": 2, "stream": stream})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and "messages" in error["message"]


def test_ollama_chat_without_messages_loads_the_model_as_ollama_does(gateway):
    # Ollama's documented "load a model" call (clients preload with it): not an error there either
    resp = gateway.client.post("/api/chat", json={"model": "d", "messages": [], "stream": False})
    assert resp.status_code == 200 and resp.json()["done_reason"] == "load"


IMAGE = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
# Client mistakes llama-server answers with a 500 (its std::runtime_error, not invalid_argument)
LLAMA_500_MISTAKES = {
    "image without a projector": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{IMAGE}"}}],
                }
            ]
        },
        "image input is not supported",
    ),
    "tools not a list": ({"messages": [{"role": "user", "content": "hi"}], "tools": 5}, "Failed to parse tools"),
    "tools of an unknown type": (
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "zz"}]},
        "Failed to parse tools",
    ),
    "null text part": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
        "Failed to parse messages",
    ),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", sorted(LLAMA_500_MISTAKES))
def test_llama_500s_for_client_mistakes_are_400_on_v1(gateway, llama32, case, stream):
    body, message = LLAMA_500_MISTAKES[case]
    body = {**body, "max_tokens": 2, "stream": stream}
    direct = llama32.client.post("/v1/chat/completions", json=body)
    assert direct.status_code == 500 and direct.json()["error"]["type"] == "server_error"  # what llama does
    resp = gateway.client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith(message)
    assert error["message"] == direct.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_llama_500s_for_client_mistakes_are_400_on_api(gateway, stream):
    options = {"num_predict": 2}
    cases = [
        ("/api/chat", {"messages": [{"role": "user", "content": "hi", "images": [IMAGE]}]}, "image input"),
        ("/api/generate", {"prompt": "describe", "images": [IMAGE]}, "image input"),
        ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "zz"}]}, "Failed to parse"),
    ]
    for path, body, message in cases:
        resp = gateway.client.post(path, json={"model": "d", **body, "stream": stream, "options": options})
        assert resp.status_code == 400, (path, resp.text)
        assert resp.json()["error"].startswith(message)


def test_only_client_mistakes_among_llama_500s_become_400s():
    def body(message: str, kind: str = "server_error") -> bytes:
        return json.dumps({"error": {"code": 500, "message": message, "type": kind}}).encode()

    assert client_mistake(500, body("Failed to parse tools: Expected 'tools' to be an array, got 5"))
    assert client_mistake(500, body("audio input is not supported - hint: ..."))
    # llama's own failures stay 500s: generation errors, a full KV cache, anything not recognised
    for message in (
        "got exception: failed to decode",
        "Failed to tokenize prompt",
        "No available space in KV cache or invalid slot save file",
        "Internal Server Error",
        "the image input is not supported - hint",
        # serialising llama's own output failed: not the client's body
        "[json.exception.type_error.316] invalid UTF-8 byte at index 1: 0xC3",
    ):
        assert client_mistake(500, body(message)) is None, message
    assert client_mistake(500, b"Internal Server Error") is None
    assert client_mistake(503, body("Failed to parse tools: x")) is None
    assert client_mistake(500, body("Failed to parse tools: x", kind="unavailable_error")) is None


def test_gateway_publishes_its_openapi_document(gateway):
    resp = gateway.client.get("/openapi.json")
    assert resp.status_code == 200
    doc = resp.json()
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) >= {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/api/chat",
        "/api/generate",
        "/api/tags",
        "/api/ps",
        "/api/show",
        "/api/version",
    }
    assert unresolved(doc) == []
    chat = request_validator(doc, "/v1/chat/completions")
    assert chat.is_valid(chat_body())
    assert not chat.is_valid({"messages": []})
    assert request_validator(doc, "/api/generate").is_valid({"model": "d", "prompt": "hi", "options": {"seed": 1}})
    header = doc["paths"]["/v1/chat/completions"]["post"]["parameters"][0]
    assert header["name"] == "X-MoE-Domain" and set(header["schema"]["enum"]) == set(known_domains())


@pytest.mark.parametrize("number", ["NaN", "-Infinity", "1e400"])
def test_numbers_json_cannot_carry_are_400(gateway, llama32, number):
    # Python's JSON reader takes these; llama's parser refuses them with a 500
    body = (
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": ' + number.encode() + b"}"
    )
    direct = llama32.client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert direct.status_code == 500
    for stream in (b"false", b"true"):
        sent = body[:-1] + b', "stream": ' + stream + b"}"
        resp = gateway.client.post("/v1/chat/completions", content=sent, headers={"content-type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["type"] == "invalid_request_error"
    ollama_body = (
        b'{"model": "d", "prompt": "hi", "stream": false, "options": {"temperature": ' + number.encode() + b"}}"
    )
    resp = gateway.client.post("/api/generate", content=ollama_body)
    assert resp.status_code == 400 and isinstance(resp.json()["error"], str)
    fmt = b'{"model": "d", "messages": [{"role": "user", "content": "hi"}], "format": {"x": ' + number.encode() + b"}}"
    resp = gateway.client.post("/api/chat", content=fmt)
    assert resp.status_code == 400 and isinstance(resp.json()["error"], str)
