"""hypothesis on the gateway's parsers: the X-MoE-Domain header (in process, and through the real
gateway) and the Ollama translation both ways. Each property is what the callers rely on: a parser
either gives a usable answer or fails the way its caller handles (a 400, a skipped event)."""

from __future__ import annotations

import json
import string
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from moe_l2_contracts.domains import DOMAIN_TAG
from moe_l2_contracts.schemas.ollama import ChatRequest, GenerateRequest, Message, Options, ToolCall, ToolFunctionCall
from moe_l2_contracts.schemas.openai import FunctionCall
from moe_l2_contracts.schemas.openai import ToolCall as OpenAIToolCall
from moe_l2_domains.known import known_domains
from moe_l2_proxy.domain import DomainHeader
from moe_l2_proxy.errors import GatewayError
from moe_l2_proxy.ollama_translate import (
    StreamTranslator,
    blocking_to_ollama,
    chat_to_openai,
    generate_to_openai,
    tool_calls_to_ollama,
)
from tests.fuzz.conftest import FuzzCounts, examples

KNOWN = sorted(known_domains())
PARSER_SETTINGS = settings(
    max_examples=examples(300), deadline=None, suppress_health_check=list(HealthCheck), database=None
)

# JSON values as a client or llama may send them (no NaN: JSON has none)
json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)

# Header values: tags, near-tags, reserved names, padding, and anything printable in latin-1
tagish = st.text(alphabet=string.ascii_letters + string.digits + "_.:-", min_size=1, max_size=70)
header_values = st.one_of(
    st.sampled_from(KNOWN),
    st.sampled_from(KNOWN).map(lambda d: f"  {d}\t"),
    st.sampled_from(KNOWN).map(str.upper),
    tagish,
    tagish.map(lambda t: "_" + t),
    st.text(max_size=80),
)


@PARSER_SETTINGS
@given(value=header_values | st.none())
@example(value="_global")
@example(value="")
@example(value="codegen\x00")
def test_domain_header_accepts_exactly_the_known_domains(value: str | None) -> None:
    header = DomainHeader(KNOWN)
    try:
        parsed = header.parse(value)
    except GatewayError as exc:
        assert value is not None and value.strip() not in KNOWN
        assert exc.status == 400
        stripped = value.strip()
        if not DOMAIN_TAG.match(stripped):
            assert exc.code == "invalid_domain"
            # arbitrary input is not echoed back
            assert exc.message == "invalid X-MoE-Domain header: expected one of the domains " + ", ".join(KNOWN)
        elif stripped.startswith("_"):
            assert exc.code == "reserved_domain"
        else:
            assert exc.code == "unknown_domain"
        assert all(name in exc.message for name in KNOWN)
        return
    if value is None:
        assert parsed is None
    else:
        assert parsed == value.strip() and parsed in KNOWN


printable_latin1 = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=70
)


@pytest.mark.llama
@pytest.mark.slow
def test_domain_header_through_the_real_gateway(fuzz_gateway: str, fuzz_counts: FuzzCounts) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with httpx.Client(base_url=fuzz_gateway, timeout=120) as client:

        @settings(max_examples=examples(60), deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(
            value=header_values.filter(lambda v: all(" " <= c <= "\xff" and c != "\x7f" for c in v)) | printable_latin1
        )
        def run(value: str) -> None:
            # HTTP drops a value's leading and trailing blanks on the wire (and h11 will not send them)
            value = value.strip(" \t")
            resp = client.post("/v1/chat/completions", json=body, headers={"X-MoE-Domain": value.encode("latin-1")})
            fuzz_counts.record("gateway (X-MoE-Domain)", resp.status_code)
            if value.strip() in KNOWN:
                assert resp.status_code == 200 and resp.headers["x-moe-domain"] == value.strip()
            else:
                assert resp.status_code == 400, (value, resp.text)
                assert resp.json()["error"]["code"] in {"invalid_domain", "reserved_domain", "unknown_domain"}

        run()


# --- the Ollama translation ------------------------------------------------------------------------

finite = st.floats(allow_nan=False, allow_infinity=False)
options = st.builds(
    Options,
    temperature=st.none() | finite,
    top_p=st.none() | finite,
    top_k=st.none() | st.integers(),
    seed=st.none() | st.integers(),
    stop=st.none() | st.text() | st.lists(st.text(), max_size=3),
    num_predict=st.none() | st.integers(min_value=-3, max_value=10_000),
    repeat_penalty=st.none() | finite,
    mirostat=st.none() | st.integers(),
    num_ctx=st.none() | st.integers(),
)
tool_calls = st.lists(
    st.builds(
        ToolCall,
        function=st.builds(ToolFunctionCall, name=st.text(), arguments=st.dictionaries(st.text(), json_values)),
    ),
    max_size=3,
)
messages = st.builds(
    Message,
    role=st.sampled_from(["system", "user", "assistant", "tool"]) | st.text(),
    content=st.text(),
    images=st.none() | st.lists(st.text(string.ascii_letters + string.digits + "+/=", max_size=40), max_size=2),
    tool_calls=st.none() | tool_calls,
    tool_name=st.none() | st.text(),
)
formats = st.none() | st.just("json") | st.text(max_size=5) | st.dictionaries(st.text(max_size=8), json_values)
chat_requests = st.builds(
    ChatRequest,
    model=st.text(),
    messages=st.lists(messages, max_size=5),
    tools=st.none() | st.lists(st.dictionaries(st.text(max_size=8), json_values), max_size=2),
    stream=st.booleans(),
    format=formats,
    options=st.none() | options,
)
generate_requests = st.builds(
    GenerateRequest,
    model=st.text(),
    prompt=st.text(),
    system=st.none() | st.text(),
    images=st.none() | st.lists(st.text(string.ascii_letters, max_size=20), max_size=2),
    stream=st.booleans(),
    raw=st.booleans(),
    format=formats,
    options=st.none() | options,
)


def common_fields(req: ChatRequest | GenerateRequest, body: dict[str, Any]) -> None:
    json.dumps(body, allow_nan=False)  # what llama receives is strict JSON
    assert body["stream"] is req.stream
    assert ("stream_options" in body) is req.stream  # the final Ollama object needs the usage
    num_predict = req.options.num_predict if req.options else None
    if num_predict is not None and num_predict >= 0:
        assert body["max_tokens"] == num_predict
    else:
        assert "max_tokens" not in body  # llama's default: until done


@PARSER_SETTINGS
@given(req=chat_requests)
def test_chat_requests_translate_to_a_valid_openai_body(req: ChatRequest) -> None:
    body = chat_to_openai(req)
    common_fields(req, body)
    assert [m["role"] for m in body["messages"]] == [m.role for m in req.messages]
    for sent, message in zip(body["messages"], req.messages, strict=True):
        if message.images:
            parts = sent["content"]
            assert parts[0] == {"type": "text", "text": message.content}
            assert [p["image_url"]["url"].startswith("data:") for p in parts[1:]] == [True] * len(message.images)
        else:
            assert sent["content"] == message.content
        for call, original in zip(sent.get("tool_calls", []), message.tool_calls or [], strict=True):
            assert json.loads(call["function"]["arguments"]) == original.function.arguments
    # the round trip of Ollama's own wire format
    assert ChatRequest.model_validate_json(req.model_dump_json()).model_dump() == req.model_dump()


@PARSER_SETTINGS
@given(req=generate_requests)
def test_generate_requests_translate_to_a_valid_openai_body(req: GenerateRequest) -> None:
    path, body = generate_to_openai(req)
    common_fields(req, body)
    if req.raw:
        assert path == "/v1/completions" and body["prompt"] == req.prompt
    else:
        assert path == "/v1/chat/completions"
        assert [m["role"] for m in body["messages"]] == (["system"] if req.system else []) + ["user"]


@PARSER_SETTINGS
@given(doc=json_values)
@example(doc={"messages": [{"role": "user", "content": None}]})
@example(doc={"options": {"temperature": "hot"}})
def test_ollama_requests_either_parse_or_are_a_validation_error(doc: Any) -> None:
    raw = json.dumps(doc).encode()
    for model in (ChatRequest, GenerateRequest):
        try:
            model.model_validate_json(raw)
        except ValidationError:
            pass  # the gateway's 400


# llama's answers: chunks shaped like its SSE events (so they reach the translation), and anything
deltas = st.fixed_dictionaries(
    {},
    optional={
        "role": st.none() | st.text(max_size=5),
        "content": st.none() | st.text(),
        "reasoning_content": st.none() | st.text(),
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "index": st.none() | st.integers(min_value=-2, max_value=5),
                    "id": st.text(max_size=5),
                    "function": st.fixed_dictionaries(
                        {}, optional={"name": st.none() | st.text(), "arguments": st.none() | st.text()}
                    ),
                },
            ),
            max_size=3,
        ),
    },
)
usage = st.fixed_dictionaries({}, optional={k: st.integers() for k in ("prompt_tokens", "completion_tokens")})
timings = st.fixed_dictionaries(
    {}, optional={k: finite for k in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms")}
)
chunks = st.fixed_dictionaries(
    {},
    optional={
        "choices": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "delta": st.none() | deltas,
                    "message": st.none() | deltas,
                    "text": st.text(),
                    "finish_reason": st.none()
                    | st.sampled_from(["stop", "length", "tool_calls"])
                    | st.text(max_size=5),
                },
            ),
            max_size=2,
        ),
        "usage": st.none() | usage,
        "timings": st.none() | timings,
    },
)
payloads = st.one_of(chunks.map(json.dumps), json_values.map(json.dumps), st.text())


def parses_as_ndjson(data: bytes, done: bool) -> list[dict[str, Any]]:
    lines = data.split(b"\n")
    assert lines[-1] == b""
    objects = [json.loads(line) for line in lines[:-1]]
    assert objects and all(isinstance(o, dict) and o["done"] is False for o in objects[:-1])
    assert objects[-1]["done"] is done
    return objects


@PARSER_SETTINGS
@given(kind=st.sampled_from(["chat", "generate"]), raw=st.booleans(), events=st.lists(payloads, max_size=8))
@example(kind="chat", raw=False, events=['{"choices": [], "timings": {"prompt_ms": NaN, "predicted_ms": 1e308}}'])
def test_stream_translation_skips_or_translates_every_event(kind: str, raw: bool, events: list[str]) -> None:
    translator = StreamTranslator(kind, "m", raw, time.perf_counter())  # type: ignore[arg-type]
    for payload in events:
        try:
            line = translator.event(payload)
        except ValidationError:
            continue  # ollama_api skips an event it cannot read
        if line is not None:
            parses_as_ndjson(line, done=False)
    final = parses_as_ndjson(translator.final(), done=True)[-1]
    assert final["done_reason"] in {"stop", "length"}
    assert final["model"] == "m"


@PARSER_SETTINGS
@given(kind=st.sampled_from(["chat", "generate"]), raw=st.booleans(), answer=payloads)
@example(
    kind="generate", raw=True, answer='{"choices": [], "timings": {"prompt_ms": -1e308, "predicted_ms": Infinity}}'
)
def test_blocking_translation_gives_one_final_object_or_a_validation_error(kind: str, raw: bool, answer: str) -> None:
    try:
        out = blocking_to_ollama(kind, "m", answer.encode(), raw, time.perf_counter())  # type: ignore[arg-type]
    except ValidationError:
        return  # ollama_api answers 502: llama sent something unexpected
    [obj] = parses_as_ndjson(out, done=True)
    assert obj["done_reason"] in {"stop", "length"}


@PARSER_SETTINGS
@given(arguments=st.none() | st.text() | json_values.map(json.dumps))
@example(arguments="[" * 100_000)  # nested past Python's recursion limit
@example(arguments='"just a string"')
def test_tool_call_arguments_always_become_an_object(arguments: str | None) -> None:
    [call] = tool_calls_to_ollama([OpenAIToolCall(function=FunctionCall(name="f", arguments=arguments))])
    assert isinstance(call.function.arguments, dict)
    json.dumps(call.function.arguments)
