"""Ollama's API (https://github.com/ollama/ollama/blob/main/docs/api.md), the part the gateway serves.

Requests are lenient (unknown fields ignored, as Ollama does); responses are serialized with
`exclude_none`, so a streamed fragment carries only `model`, `created_at`, its text and
`done: false`, and the final object adds `done_reason` and the counters (durations in ns).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Options(BaseModel):
    """Sampling options; those llama-server has no per-request equivalent for are accepted and ignored."""

    # NaN and infinities are not JSON: Python's reader takes them, llama's does not
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    num_predict: int | None = None
    num_keep: int | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    num_ctx: int | None = None


class ToolFunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    function: ToolFunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = Field(default=None, description="base64-encoded images")
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None


class ChatRequest(BaseModel):
    """POST /api/chat."""

    model_config = ConfigDict(extra="ignore")

    model: str = ""
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: float | str | None = None
    think: bool | str | None = None


class GenerateRequest(BaseModel):
    """POST /api/generate."""

    model_config = ConfigDict(extra="ignore")

    model: str = ""
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None
    stream: bool = True
    raw: bool = False
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: float | str | None = None
    think: bool | str | None = None


class ShowRequest(BaseModel):
    """POST /api/show (`name` is the older spelling of `model`)."""

    model_config = ConfigDict(extra="ignore")

    model: str = ""
    name: str = ""
    verbose: bool = False


class ResponseMessage(BaseModel):
    role: str = "assistant"
    content: str = ""
    thinking: str | None = None
    tool_calls: list[ToolCall] | None = None


class FinalStats(BaseModel):
    """The counters of the last object of a chat or generate answer (durations in nanoseconds)."""

    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


# The answers repeat FinalStats' fields rather than inherit them, so they serialize in Ollama's
# order: model, created_at, the text, done, then the counters.


class ChatResponse(BaseModel):
    """One NDJSON line of /api/chat (or the single object with `stream: false`)."""

    model: str
    created_at: str
    message: ResponseMessage
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class GenerateResponse(BaseModel):
    """One NDJSON line of /api/generate (or the single object with `stream: false`)."""

    model: str
    created_at: str
    response: str
    thinking: str | None = None
    done: bool
    done_reason: str | None = None
    context: list[int] | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class ModelDetails(BaseModel):
    parent_model: str = ""
    format: str = "gguf"
    family: str = ""
    families: list[str] | None = None
    parameter_size: str = ""
    quantization_level: str = ""


class ModelEntry(BaseModel):
    """A model of GET /api/tags; GET /api/ps adds `expires_at`, `size_vram` and `context_length`."""

    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str | None = None
    size_vram: int | None = None
    context_length: int | None = None


class ModelList(BaseModel):
    models: list[ModelEntry]


class ShowResponse(BaseModel):
    modelfile: str = ""
    parameters: str = ""
    template: str = ""
    details: ModelDetails
    model_info: dict[str, Any] = Field(default_factory=dict)
    capabilities: list[str] = Field(default_factory=list)
    modified_at: str | None = None


class VersionResponse(BaseModel):
    version: str


class ErrorBody(BaseModel):
    """Ollama's error JSON: `{"error": "..."}` (also one NDJSON line when a stream fails midway)."""

    error: str
