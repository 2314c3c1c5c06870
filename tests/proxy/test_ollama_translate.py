"""The Ollama <-> OpenAI translation on its own (no server)."""

from __future__ import annotations

import json
import time

from moe_l2_contracts.schemas.ollama import ChatRequest, GenerateRequest, Options
from moe_l2_proxy.ollama_translate import (
    StreamTranslator,
    blocking_to_ollama,
    chat_to_openai,
    format_to_openai,
    generate_to_openai,
    options_to_openai,
    parameter_size,
)


def test_options_are_mapped():
    opts = Options(
        temperature=0.2, top_p=0.9, top_k=20, seed=7, stop=["\n"], num_predict=12, repeat_penalty=1.1, num_ctx=4096
    )
    assert options_to_openai(opts) == {
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 20,
        "seed": 7,
        "stop": ["\n"],
        "max_tokens": 12,
        "repeat_penalty": 1.1,
    }
    assert "max_tokens" not in options_to_openai(Options(num_predict=-1))
    assert options_to_openai(None) == {}


def test_format_is_mapped():
    assert format_to_openai("json") == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert format_to_openai(schema)["json_schema"]["schema"] == schema
    assert format_to_openai(None) is None and format_to_openai("") is None


def test_chat_request_translation():
    req = ChatRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "look", "images": ["aGVsbG8="]},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}],
                },
                {"role": "tool", "content": "42", "tool_name": "f"},
            ],
            "options": {"temperature": 0},
            "format": "json",
        }
    )
    body = chat_to_openai(req)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}  # Ollama streams by default
    assert body["temperature"] == 0 and body["response_format"] == {"type": "json_object"}
    user, assistant, tool = body["messages"]
    assert user["content"][0] == {"type": "text", "text": "look"}
    assert user["content"][1]["image_url"]["url"] == "data:image/png;base64,aGVsbG8="
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"x": 1}
    assert tool["name"] == "f"


def test_generate_request_translation():
    path, body = generate_to_openai(GenerateRequest(model="m", prompt="p", system="s", stream=False))
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "system", "content": "s"}, {"role": "user", "content": "p"}]
    assert "stream_options" not in body
    path, body = generate_to_openai(GenerateRequest(model="m", prompt="raw text", raw=True))
    assert path == "/v1/completions" and body["prompt"] == "raw text"


# llama-server's events for a two-token chat stream with include_usage (abridged, real field names)
CHAT_EVENTS = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": " Hello"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": " world"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
    {
        "choices": [],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
        "timings": {"cache_n": 3, "prompt_n": 6, "prompt_ms": 1.5, "predicted_n": 2, "predicted_ms": 4.25},
    },
]


def test_stream_translation_chat():
    translator = StreamTranslator("chat", "m", raw=False, t0=time.perf_counter())
    lines = [out for e in CHAT_EVENTS if (out := translator.event(json.dumps(e))) is not None]
    parts = [json.loads(x) for x in lines]
    assert [p["message"]["content"] for p in parts] == [" Hello", " world"]
    assert all(p["done"] is False and p["model"] == "m" and p["created_at"].endswith("Z") for p in parts)
    assert list(parts[0]) == ["model", "created_at", "message", "done"]  # Ollama's fields, in its order
    final = json.loads(translator.final())
    assert final["done"] is True and final["done_reason"] == "length"
    assert final["prompt_eval_count"] == 9 and final["eval_count"] == 2
    assert final["prompt_eval_duration"] == 1_500_000 and final["eval_duration"] == 4_250_000
    assert final["total_duration"] > 0 and final["load_duration"] == 0
    assert final["message"] == {"role": "assistant", "content": ""}


def test_stream_translation_tool_calls():
    translator = StreamTranslator("chat", "m", raw=False, t0=time.perf_counter())
    events = [
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "get", "arguments": '{"ci'}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
    ]
    assert all(translator.event(json.dumps(e)) is None for e in events)
    calls_line, final_line = translator.final().splitlines()
    assert json.loads(calls_line)["message"]["tool_calls"] == [
        {"function": {"name": "get", "arguments": {"city": "Paris"}}}
    ]
    assert json.loads(final_line)["done_reason"] == "stop"


def test_stream_translation_raw_generate():
    translator = StreamTranslator("generate", "m", raw=True, t0=time.perf_counter())
    out = translator.event(json.dumps({"choices": [{"text": "abc", "finish_reason": None}]}))
    assert json.loads(out) | {"created_at": ""} == {"model": "m", "created_at": "", "response": "abc", "done": False}
    translator.event(json.dumps({"choices": [{"text": "", "finish_reason": "stop"}], "timings": {"predicted_n": 1}}))
    final = json.loads(translator.final())
    assert final["response"] == "" and final["done_reason"] == "stop" and final["eval_count"] == 1


def test_blocking_translation():
    answer = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi there"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
        "timings": {"prompt_n": 5, "prompt_ms": 2.0, "predicted_n": 2, "predicted_ms": 3.0},
    }
    chat = json.loads(blocking_to_ollama("chat", "m", json.dumps(answer).encode(), raw=False, t0=time.perf_counter()))
    assert chat["message"] == {"role": "assistant", "content": "hi there"} and chat["done"] is True
    assert chat["eval_count"] == 2 and chat["done_reason"] == "stop"
    gen = json.loads(
        blocking_to_ollama("generate", "m", json.dumps(answer).encode(), raw=False, t0=time.perf_counter())
    )
    assert gen["response"] == "hi there" and "message" not in gen


def test_parameter_size():
    assert parameter_size(3_871_424) == "3.9M"
    assert parameter_size(235_000_000_000) == "235B"
    assert parameter_size(7_241_000_000) == "7.2B"
