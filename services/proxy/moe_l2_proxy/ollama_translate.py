"""Ollama requests to llama-server's OpenAI API and its answers back into Ollama's wire format.

Pure functions and one small state machine (`StreamTranslator`); the routes live in ollama_api.
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import UTC, datetime
from typing import Any, Literal

from moe_l2_contracts.schemas.ollama import (
    ChatRequest,
    ChatResponse,
    FinalStats,
    GenerateRequest,
    GenerateResponse,
    Message,
    ModelDetails,
    ModelEntry,
    Options,
    ResponseMessage,
    ToolCall,
    ToolFunctionCall,
)
from moe_l2_contracts.schemas.openai import ChatCompletion, Completion, ModelCard, TextChoice, Timings, Usage
from moe_l2_contracts.schemas.openai import ToolCall as OpenAIToolCall

Kind = Literal["chat", "generate"]

# Ollama option -> llama-server request field (llama's OpenAI endpoints accept its native samplers)
OPTION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "seed": "seed",
    "stop": "stop",
    "num_keep": "n_keep",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "mirostat": "mirostat",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
}
# llama never unloads its model: /api/ps reports no expiry this way
NEVER_EXPIRES = "9999-12-31T23:59:59Z"


def now_rfc3339() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def options_to_openai(options: Options | None) -> dict[str, Any]:
    if options is None:
        return {}
    body: dict[str, Any] = {}
    for name, field in OPTION_FIELDS.items():
        value = getattr(options, name)
        if value is not None:
            body[field] = value
    # num_predict: -1 is "until done", -2 "fill the context": both are llama's default (no limit)
    if options.num_predict is not None and options.num_predict >= 0:
        body["max_tokens"] = options.num_predict
    return body


def format_to_openai(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """Ollama's `format` ("json" or a JSON schema) as an OpenAI response_format."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "ollama_format", "schema": fmt}}
    return None


def image_part(image: str) -> dict[str, Any]:
    # llama-server decodes the bytes whatever the declared type; Ollama sends bare base64
    url = image if image.startswith("data:") else f"data:image/png;base64,{image}"
    return {"type": "image_url", "image_url": {"url": url}}


def message_to_openai(message: Message, index: int) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role}
    if message.images:
        out["content"] = [{"type": "text", "text": message.content}, *(image_part(i) for i in message.images)]
    else:
        out["content"] = message.content
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": f"call_{index}_{n}",
                "type": "function",
                "function": {"name": call.function.name, "arguments": json.dumps(call.function.arguments)},
            }
            for n, call in enumerate(message.tool_calls)
        ]
    if message.role == "tool" and message.tool_name:
        out["name"] = message.tool_name
    return out


def _common(model: str, stream: bool, options: Options | None, fmt: str | dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": stream}
    if stream:
        # the final Ollama object needs the prompt token count, which llama sends only when asked
        body["stream_options"] = {"include_usage": True}
    body.update(options_to_openai(options))
    if (response_format := format_to_openai(fmt)) is not None:
        body["response_format"] = response_format
    return body


def chat_to_openai(req: ChatRequest) -> dict[str, Any]:
    body = _common(req.model, req.stream, req.options, req.format)
    body["messages"] = [message_to_openai(m, i) for i, m in enumerate(req.messages)]
    if req.tools:
        body["tools"] = req.tools
    return body


def generate_to_openai(req: GenerateRequest) -> tuple[str, dict[str, Any]]:
    """(llama path, body): a raw prompt is completed as is, otherwise it is one user turn of a chat."""
    body = _common(req.model, req.stream, req.options, req.format)
    if req.raw:
        body["prompt"] = req.prompt
        return "/v1/completions", body
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": req.system})
    user = Message(role="user", content=req.prompt, images=req.images)
    messages.append(message_to_openai(user, 0))
    body["messages"] = messages
    return "/v1/chat/completions", body


def done_reason(finish_reason: str | None) -> str:
    return "length" if finish_reason == "length" else "stop"


# Ollama's durations are int64 nanoseconds: 9.2e12 ms is their limit
_MAX_MS = 9.2e12


def ns(ms: float) -> int:
    """llama's milliseconds as Ollama's nanoseconds; a value no int64 holds is clamped, not an error
    that would end the answer."""
    if not ms > 0:  # negative, or NaN
        return 0
    return int(min(ms, _MAX_MS) * 1e6)


def final_stats(finish_reason: str | None, usage: Usage | None, timings: Timings | None, t0: float) -> FinalStats:
    """The counters of Ollama's last object; durations in nanoseconds."""
    prompt = usage.prompt_tokens if usage else (timings.prompt_n + timings.cache_n if timings else 0)
    completion = usage.completion_tokens if usage else (timings.predicted_n if timings else 0)
    return FinalStats(
        done_reason=done_reason(finish_reason),
        total_duration=int((time.perf_counter() - t0) * 1e9),
        load_duration=0,  # llama-server keeps its model loaded
        prompt_eval_count=prompt,
        prompt_eval_duration=ns(timings.prompt_ms) if timings else 0,
        eval_count=completion,
        eval_duration=ns(timings.predicted_ms) if timings else 0,
    )


def tool_calls_to_ollama(calls: list[OpenAIToolCall]) -> list[ToolCall]:
    out = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except (ValueError, RecursionError):  # the model's text: not JSON, or nested past Python's stack
            arguments = {"_raw": call.function.arguments}
        if not isinstance(arguments, dict):
            arguments = {"value": arguments}
        out.append(ToolCall(function=ToolFunctionCall(name=call.function.name or "", arguments=arguments)))
    return out


def fragment(
    kind: Kind, model: str, text: str, thinking: str | None = None, tool_calls: list[ToolCall] | None = None
) -> ChatResponse | GenerateResponse:
    if kind == "chat":
        message = ResponseMessage(content=text, thinking=thinking, tool_calls=tool_calls)
        return ChatResponse(model=model, created_at=now_rfc3339(), message=message, done=False)
    return GenerateResponse(model=model, created_at=now_rfc3339(), response=text, thinking=thinking, done=False)


def finished(
    kind: Kind, model: str, stats: FinalStats, text: str = "", **extra: Any
) -> ChatResponse | GenerateResponse:
    obj = fragment(kind, model, text, **extra)
    return obj.model_copy(update={**stats.model_dump(), "done": True})


def line(obj: ChatResponse | GenerateResponse) -> bytes:
    return obj.model_dump_json(exclude_none=True).encode() + b"\n"


def blocking_to_ollama(kind: Kind, model: str, upstream_json: bytes, raw: bool, t0: float) -> bytes:
    """A whole llama answer as Ollama's single object (`stream: false`)."""
    if raw:
        completion = Completion.model_validate_json(upstream_json)
        choice = completion.choices[0] if completion.choices else None
        stats = final_stats(choice.finish_reason if choice else None, completion.usage, completion.timings, t0)
        return line(finished(kind, model, stats, choice.text if choice else ""))
    chat = ChatCompletion.model_validate_json(upstream_json)
    choice = chat.choices[0] if chat.choices else None
    message = choice.message if choice else None
    stats = final_stats(choice.finish_reason if choice else None, chat.usage, chat.timings, t0)
    tool_calls = tool_calls_to_ollama(message.tool_calls) if message and message.tool_calls else None
    extra: dict[str, Any] = {"thinking": message.reasoning_content if message else None}
    if kind == "chat":
        extra["tool_calls"] = tool_calls
    return line(finished(kind, model, stats, (message.content or "") if message else "", **extra))


class StreamTranslator:
    """llama's SSE events in, Ollama NDJSON lines out, one line per generated fragment."""

    def __init__(self, kind: Kind, model: str, raw: bool, t0: float) -> None:
        self.kind = kind
        self.model = model
        self.raw = raw
        self.t0 = t0
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.timings: Timings | None = None
        self.tool_calls: dict[int, OpenAIToolCall] = {}
        self.first_text_sent = False  # set by the relay when it times the first token

    def event(self, payload: str) -> bytes | None:
        """The NDJSON line for one SSE payload, or None when it carries no text for the client."""
        chunk: ChatCompletion | Completion
        chunk = Completion.model_validate_json(payload) if self.raw else ChatCompletion.model_validate_json(payload)
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.timings is not None:
            self.timings = chunk.timings
        if not chunk.choices:
            return None
        choice = chunk.choices[0]
        if choice.finish_reason is not None:
            self.finish_reason = choice.finish_reason
        if isinstance(choice, TextChoice):
            text, thinking = choice.text, None
        else:
            if choice.delta is None:
                return None
            self._collect_tool_calls(choice.delta.tool_calls or [])
            text, thinking = choice.delta.content or "", choice.delta.reasoning_content
        if not text and not thinking:
            return None
        return line(fragment(self.kind, self.model, text, thinking))

    def _collect_tool_calls(self, deltas: list[OpenAIToolCall]) -> None:
        for d in deltas:
            index = d.index if d.index is not None else len(self.tool_calls)
            call = self.tool_calls.setdefault(index, OpenAIToolCall(index=index))
            if d.function.name:
                call.function.name = d.function.name
            if d.function.arguments:
                call.function.arguments = (call.function.arguments or "") + d.function.arguments

    def final(self) -> bytes:
        lines = b""
        if self.tool_calls and self.kind == "chat":
            calls = tool_calls_to_ollama([self.tool_calls[i] for i in sorted(self.tool_calls)])
            lines += line(fragment("chat", self.model, "", tool_calls=calls))
        stats = final_stats(self.finish_reason, self.usage, self.timings, self.t0)
        return lines + line(finished(self.kind, self.model, stats))


def model_entry(card: ModelCard, ftype: str = "") -> ModelEntry:
    """A model of /api/tags from llama's /v1/models card."""
    meta = card.meta or {}
    n_params = int(meta.get("n_params") or 0)
    return ModelEntry(
        name=card.id,
        model=card.id,
        modified_at=datetime.fromtimestamp(card.created or 0, UTC).isoformat().replace("+00:00", "Z"),
        size=int(meta.get("size") or 0),
        # a stable identifier of the served name (the gateway cannot hash a file llama maps)
        digest=hashlib.sha256(card.id.encode()).hexdigest(),
        details=ModelDetails(
            format="gguf",
            parameter_size=parameter_size(n_params) if n_params else "",
            quantization_level=ftype,
        ),
    )


def parameter_size(n: int) -> str:
    """Ollama's short form: 3.9M, 7.2B, 235B."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value >= 100 else f"{value:.1f}{unit}"
    return str(n)
