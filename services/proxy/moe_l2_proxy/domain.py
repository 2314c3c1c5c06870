"""The domain of a request: the client's X-MoE-Domain header, else the predictor within its budget,
else the in-process keyword tier. Prediction never fails a request.

Only known domains (moe_l2_domains.known.known_domains(): the taxonomy's names plus
MOE_L2_EXTRA_DOMAINS) become tags: each tag is a label set in llama's telemetry, a Redis domain
and a routing table per layer, all persisted, so a header with a free value would let any client
grow them without limit. Anything else in the header is the client's 400, with the valid names.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from moe_l2_contracts.domains import DOMAIN_TAG, is_reserved
from moe_l2_contracts.schemas.predict import ChatMessage, PredictRequest
from moe_l2_domains.keywords import KeywordClassifier
from moe_l2_domains.known import known_domains
from moe_l2_proxy.errors import GatewayError
from moe_l2_proxy.predictor_pool import PredictorPool

log = logging.getLogger("moe_l2_proxy")

Source = Literal["header", "predictor", "fallback"]

# The predictor weighs the last user turn most; older turns add little but cost bytes and time.
MAX_PREDICT_MESSAGES = 16
# A predictor with another taxonomy could answer many names; each is logged once, up to this many.
_MAX_WARNED = 16


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


class DomainHeader:
    """Parses X-MoE-Domain against the set of known domains, fixed when the gateway starts."""

    def __init__(self, known: Iterable[str]) -> None:
        self.known = frozenset(known)
        self._listed = ", ".join(sorted(self.known))

    def parse(self, value: str | None) -> str | None:
        """The header's domain, None without the header; a value that is not a known domain is a 400."""
        if value is None:
            return None
        value = value.strip()
        if value in self.known:
            return value
        if not DOMAIN_TAG.match(value):
            raise GatewayError(
                400,
                "invalid X-MoE-Domain header: expected one of the domains " + self._listed,
                code="invalid_domain",
            )
        if is_reserved(value):
            raise GatewayError(
                400,
                f"X-MoE-Domain {value!r} is reserved for the services' own use; "
                f"expected one of the domains {self._listed}",
                code="reserved_domain",
            )
        raise GatewayError(
            400, f"unknown X-MoE-Domain {value!r}: expected one of the domains {self._listed}", code="unknown_domain"
        )


class DomainResolver:
    def __init__(
        self,
        predictors: PredictorPool | None,
        budget_s: float,
        keywords: KeywordClassifier,
        known: Iterable[str] | None = None,
    ) -> None:
        self.predictors = predictors
        self.budget_s = budget_s
        self.keywords = keywords
        # computed once: the taxonomy and MOE_L2_EXTRA_DOMAINS are read at startup, never per request
        self.header = DomainHeader(known_domains() if known is None else known)
        self._warned: set[str] = set()

    def header_domain(self, value: str | None) -> str | None:
        return self.header.parse(value)

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
        if (tagged := self.header.parse(header)) is not None:
            return Decision(tagged, "header", time.perf_counter() - t0)
        if self.predictors is not None and self.budget_s > 0:
            answer = await self.predictors.predict(predict_request(), self.budget_s)
            if answer is not None:
                if answer.domain in self.header.known:
                    return Decision(answer.domain, "predictor", time.perf_counter() - t0)
                self._warn_unknown(answer.domain)
        guess = self.keywords.predict(fallback_text())
        return Decision(guess.domain, "fallback", time.perf_counter() - t0)

    def _warn_unknown(self, domain: str) -> None:
        # a predictor on another taxonomy than the gateway's: its answers are not tags here
        if domain not in self._warned and len(self._warned) < _MAX_WARNED:
            self._warned.add(domain)
            log.warning(
                "the predictor answered domain %r, not one of this gateway's domains: using the keyword tier "
                "(do the predictor and the gateway share MOE_L2_TAXONOMY_PATH and MOE_L2_EXTRA_DOMAINS?)",
                domain[:64],
            )
