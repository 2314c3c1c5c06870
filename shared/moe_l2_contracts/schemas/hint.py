"""The cache-manager's hint contract (POST /v1/hint), sent by the gateway fire-and-forget."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class HintRequest(BaseModel):
    """A request of `domain` is about to run. (The cache-manager serves one model; a `model` field
    that older gateways sent is ignored.)"""

    model_config = ConfigDict(extra="ignore")

    domain: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")


class HintResponse(BaseModel):
    accepted: bool
    active_domain: str | None = None
    switched: bool = False
    reason: str = ""
