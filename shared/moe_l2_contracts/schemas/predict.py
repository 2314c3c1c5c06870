"""The predictor's contract (POST /v1/predict, /v1/predict/batch), used by the predictor and the gateway."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Tier = Literal["keyword", "tfidf", "semantic", "hybrid"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    # OpenAI allows a list of content parts; only the text parts matter for prediction
    content: str | list[dict] | None = None


class PredictRequest(BaseModel):
    """Either a text or chat messages (the last user message weighs most)."""

    # `one_input` in the published schema too, so clients (and fuzzers) know what is accepted
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "oneOf": [
                {"required": ["text"], "properties": {"text": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        },
    )

    text: str | None = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def one_input(self) -> PredictRequest:
        if (self.text is None) == (self.messages is None):
            raise ValueError("give exactly one of `text` or `messages`")
        return self


class PredictResponse(BaseModel):
    domain: str
    confidence: float = Field(ge=0.0, le=1.0)
    lang: str = Field(description="script-level language: zh, ja, ko, ru, en, ... or unknown")
    tier: Tier = Field(description="the tier whose answer was returned")
    scores: dict[str, float] = Field(default_factory=dict, description="per-domain scores of that tier")


class PredictBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[PredictRequest] = Field(max_length=256)


class PredictBatchResponse(BaseModel):
    results: list[PredictResponse]
