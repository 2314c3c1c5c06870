"""The domain of a request: the client's X-MoE-Domain header, else the predictor within its budget,
else the in-process keyword tier. Prediction never fails a request."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from moe_l2_common.keywords import KeywordClassifier
from moe_l2_common.schemas.predict import ChatMessage, PredictRequest
from moe_l2_proxy.errors import GatewayError
from moe_l2_proxy.predictor_pool import PredictorPool

Source = Literal["header", "predictor", "fallback"]

# What llama-server accepts as a domain tag (patch 0001) and the cache-manager as a hint.
DOMAIN_TAG = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
# The predictor weighs the last user turn most; older turns add little but cost bytes and time.
MAX_PREDICT_MESSAGES = 16


@dataclass(frozen=True)
class Decision:
    domain: str
    source: Source
    seconds: float  # time spent deciding

    def headers(self) -> dict[str, str]:
        return {
            "X-MoE-Domain": self.domain,
            "X-MoE-Domain-Source": self.source,
            "Server-Timing": f"domain;dur={self.seconds * 1000:.2f}",
        }


def message_text(content: str | list[dict] | None) -> str:
    """The text of a message; of a list of content parts, the text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(str(part.get("text", "")) for part in content if part.get("type", "text") == "text")


def last_user_text(messages: Sequence[ChatMessage]) -> str:
    """The text the keyword tier reads: the last user turn (all turns if there is none)."""
    for message in reversed(messages):
        if message.role == "user":
            return message_text(message.content)
    return "\n".join(message_text(m.content) for m in messages)


def header_domain(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip()
    if not DOMAIN_TAG.match(value):
        raise GatewayError(
            400, "invalid X-MoE-Domain header: expected 1 to 64 characters of [A-Za-z0-9_.:-]", code="invalid_domain"
        )
    return value


class DomainResolver:
    def __init__(self, predictors: PredictorPool | None, budget_s: float, keywords: KeywordClassifier) -> None:
        self.predictors = predictors
        self.budget_s = budget_s
        self.keywords = keywords

    async def for_messages(self, header: str | None, messages: Sequence[ChatMessage]) -> Decision:
        return await self._resolve(
            header,
            lambda: PredictRequest(messages=list(messages[-MAX_PREDICT_MESSAGES:])),
            lambda: last_user_text(messages),
        )

    async def for_text(self, header: str | None, text: str) -> Decision:
        return await self._resolve(header, lambda: PredictRequest(text=text), lambda: text)

    async def _resolve(
        self, header: str | None, predict_request: Callable[[], PredictRequest], fallback_text: Callable[[], str]
    ) -> Decision:
        t0 = time.perf_counter()
        if (tagged := header_domain(header)) is not None:
            return Decision(tagged, "header", time.perf_counter() - t0)
        if self.predictors is not None and self.budget_s > 0:
            answer = await self.predictors.predict(predict_request(), self.budget_s)
            if answer is not None and DOMAIN_TAG.match(answer.domain):
                return Decision(answer.domain, "predictor", time.perf_counter() - t0)
        guess = self.keywords.predict(fallback_text())
        return Decision(guess.domain, "fallback", time.perf_counter() - t0)
