"""The official clients, unchanged, pointed at the gateway in front of the real llama-server."""

from __future__ import annotations

import json
from pathlib import Path

import ollama
import openai
import pytest
from gguf import GGUFReader
from langchain_openai import ChatOpenAI

from tests.proxy.support import chat_body, llama_spec

pytestmark = pytest.mark.llama


@pytest.fixture(scope="module")
def oai(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def olm(gateway) -> ollama.Client:
    return ollama.Client(host=gateway.url, timeout=120)


def test_openai_chat_blocking(oai):
    raw = oai.chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": "write a python function"}], max_tokens=6
    )
    completion = raw.parse()
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content
    assert completion.usage.completion_tokens == 6
    assert raw.headers["x-moe-domain-source"] == "fallback"
    assert raw.headers["x-moe-domain"]


def test_openai_chat_stream(oai):
    stream = oai.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_openai_completions(oai):
    completion = oai.completions.create(model="demo", prompt="Once upon a time", max_tokens=5)
    assert completion.choices[0].text
    assert completion.usage.completion_tokens == 5
    streamed = list(oai.completions.create(model="demo", prompt="Once upon a time", max_tokens=5, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices)


def test_openai_models(oai, llama32):
    ids = [m.id for m in oai.models.list()]
    direct = llama32.client.get("/v1/models").json()
    assert ids == [m["id"] for m in direct["data"]]


def test_ollama_chat_blocking(olm):
    answer = olm.chat(model="demo", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 5})
    assert answer.done is True
    assert answer.done_reason == "length"
    assert answer.message.role == "assistant" and answer.message.content
    assert answer.eval_count == 5
    assert answer.prompt_eval_count and answer.prompt_eval_count > 0
    assert answer.total_duration and answer.total_duration >= answer.eval_duration > 0


def test_ollama_chat_stream(olm):
    parts = list(
        olm.chat(model="demo", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 6}, stream=True)
    )
    assert all(not p.done for p in parts[:-1])
    assert parts[-1].done and parts[-1].done_reason == "length"
    assert parts[-1].eval_count == 6
    assert sum(1 for p in parts[:-1] if p.message.content) >= 1
    assert parts[-1].model == "demo"


def test_ollama_generate(olm):
    answer = olm.generate(model="demo", prompt="tell me a story", options={"num_predict": 4})
    assert answer.done and answer.response and answer.eval_count == 4
    parts = list(olm.generate(model="demo", prompt="tell me a story", options={"num_predict": 4}, stream=True))
    assert parts[-1].done and "".join(p.response for p in parts)


def test_ollama_list_ps_show_version(olm, gateway, llama32):
    served = llama32.client.get("/v1/models").json()["data"][0]
    listed = olm.list().models
    assert [m.model for m in listed] == [served["id"]]
    assert listed[0].size == served["meta"]["size"]
    assert listed[0].details.format == "gguf"
    assert [m.model for m in olm.ps().models] == [served["id"]]
    shown = olm.show(served["id"])
    assert shown.template and shown.modelinfo["general.parameter_count"] == served["meta"]["n_params"]
    assert gateway.client.get("/api/version").json()["version"]


def test_langchain_invoke_and_stream(gateway):
    llm = ChatOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", model="demo", max_tokens=6, max_retries=0)
    message = llm.invoke("write a sorting function")
    assert message.content
    assert message.usage_metadata["output_tokens"] == 6
    pieces = [chunk.content for chunk in llm.stream("write a sorting function")]
    assert len([p for p in pieces if p]) >= 2


def gguf_name(path: Path) -> str:
    field = GGUFReader(path).get_field("general.name")
    return str(field.contents())


def served_names(gateway) -> dict[str, dict]:
    """Every place a client is told the model's name, and every answer it came in (as text)."""
    client = gateway.client
    chat = chat_body("hello", 2)
    answers = {
        "/v1/models": client.get("/v1/models"),
        "/v1/chat/completions": client.post(
            "/v1/chat/completions", json={k: v for k, v in chat.items() if k != "model"}
        ),
        "/v1/chat/completions stream": client.post("/v1/chat/completions", json={**chat, "stream": True}),
        "/v1/completions": client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}),
        "/api/tags": client.get("/api/tags"),
        "/api/ps": client.get("/api/ps"),
        "/api/show": client.post("/api/show", json={"model": "anything"}),
    }
    for route, resp in answers.items():
        assert resp.status_code == 200, (route, resp.text[:200])
    names: dict[str, list[str]] = {route: [] for route in answers}
    names["/v1/models"] = [m["id"] for m in answers["/v1/models"].json()["data"]]
    names["/v1/models"] += [m[k] for m in answers["/v1/models"].json().get("models", []) for k in ("name", "model")]
    names["/v1/chat/completions"] = [answers["/v1/chat/completions"].json()["model"]]
    names["/v1/chat/completions stream"] = [
        json.loads(line[6:])["model"]
        for line in answers["/v1/chat/completions stream"].text.splitlines()
        if line.startswith("data: {")
    ]
    names["/v1/completions"] = [answers["/v1/completions"].json()["model"]]
    for route in ("/api/tags", "/api/ps"):
        names[route] = [m[k] for m in answers[route].json()["models"] for k in ("name", "model")]
    texts = {route: resp.text for route, resp in answers.items()}
    return {"names": names, "texts": texts}


def assert_only_the_name(seen: dict, name: str, model_path: Path) -> None:
    for route, found in seen["names"].items():
        if route == "/api/show":
            continue  # Ollama's show answer carries no name of its own
        assert found and set(found) == {name}, (route, found)
    for route, text in seen["texts"].items():
        assert ".gguf" not in text, route
        assert str(model_path.parent) not in text, route


def test_clients_see_the_model_name_never_a_host_path(gateway, demo_model):
    # the alias every launcher gives llama-server (MOE_L2_LLAMA_MODEL_ALIAS), never the model file's path
    name = "moe-l2"
    assert gguf_name(demo_model) != name  # the file's own name is not what clients see
    assert_only_the_name(served_names(gateway), name, demo_model)


def test_the_model_alias_is_the_name_clients_see(start_gateway, managed, llama_binary, demo_model, monkeypatch):
    monkeypatch.setenv("MOE_L2_LLAMA_MODEL_ALIAS", "acme-moe-7b")
    llama = managed("alias-llama", llama_spec(llama_binary, demo_model, "alias-llama"))
    llama.start()
    gw = start_gateway(llama.url)
    assert_only_the_name(served_names(gw), "acme-moe-7b", demo_model)
    assert [m.model for m in ollama.Client(host=gw.url).list().models] == ["acme-moe-7b"]
