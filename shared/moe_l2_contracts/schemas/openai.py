"""The OpenAI API as llama-server speaks it, the parts the gateway reads (clients send the rest through).

Request views are lenient (`extra="allow"`): the gateway reads what it needs to route a request
(messages, prompt, stream) and forwards the client's original bytes, so fields it does not know
reach llama unchanged. Response models cover what the Ollama translation consumes, including
llama-server's `timings` extension.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from moe_l2_contracts.schemas.predict import ChatMessage


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorBody(BaseModel):
    """OpenAI's error JSON: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


class ChatCompletionRequestView(BaseModel):
    """POST /v1/chat/completions, as far as the gateway needs it."""

    model_config = ConfigDict(extra="allow")

    model: str = ""
    # OpenAI refuses an empty list; llama-server would answer it with a generation from nothing
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool | None = False


class CompletionRequestView(BaseModel):
    """POST /v1/completions: `prompt` may be a string, a list of strings or token ids."""

    model_config = ConfigDict(extra="allow")

    model: str = ""
    prompt: str | list[str] | list[int] | list[list[int]] = ""
    stream: bool | None = False


class Usage(BaseModel):
    model_config = ConfigDict(extra="allow")

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class Timings(BaseModel):
    """llama-server's per-request timings (milliseconds), sent with the last chunk or the response."""

    model_config = ConfigDict(extra="allow")

    cache_n: int = 0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str | None = None
    arguments: str | None = None


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int | None = None
    id: str | None = None
    type: str | None = None
    function: FunctionCall = Field(default_factory=FunctionCall)


class AssistantMessage(BaseModel):
    """`message` of a chat completion and `delta` of a chunk (every field optional in a delta)."""

    model_config = ConfigDict(extra="allow")

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int = 0
    message: AssistantMessage | None = None
    delta: AssistantMessage | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    """A chat completion or one streamed chunk of it."""

    model_config = ConfigDict(extra="allow")

    id: str = ""
    model: str = ""
    choices: list[ChatChoice] = Field(default_factory=list)
    usage: Usage | None = None
    timings: Timings | None = None


class TextChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int = 0
    text: str = ""
    finish_reason: str | None = None


class Completion(BaseModel):
    """A text completion or one streamed chunk of it."""

    model_config = ConfigDict(extra="allow")

    id: str = ""
    model: str = ""
    choices: list[TextChoice] = Field(default_factory=list)
    usage: Usage | None = None
    timings: Timings | None = None


class ModelCard(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = ""
    meta: dict[str, Any] | None = Field(default=None, description="llama-server: n_params, size, n_ctx_train, ...")


class ModelList(BaseModel):
    model_config = ConfigDict(extra="allow")

    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)
