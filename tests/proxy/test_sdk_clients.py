"""The official clients, unchanged, pointed at the gateway in front of the real llama-server."""

from __future__ import annotations

import ollama
import openai
import pytest
from langchain_openai import ChatOpenAI

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
