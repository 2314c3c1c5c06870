"""The patched llama-server's MoE endpoints (services/llama/patches): /moe/routing and /moe/hot-set."""

from __future__ import annotations

from pydantic import BaseModel, Field

# layer (decimal string) -> expert id (decimal string) -> activations
LayerCounts = dict[str, dict[str, int]]


class RoutingSnapshot(BaseModel):
    """GET /moe/routing[?reset=1]: activations per domain tag, layer and expert since the last reset."""

    model: str = ""
    enabled: bool = True
    n_layer: int
    n_expert: int
    n_expert_used: int
    tokens: int = Field(description="tokens routed since the last reset, all tags together")
    tokens_by_domain: dict[str, int] = Field(default_factory=dict)
    domains: dict[str, LayerCounts] = Field(default_factory=dict)


class HotSetRequest(BaseModel):
    """POST /moe/hot-set: the experts to prepare, per layer."""

    domain: str
    layers: dict[str, list[int]]


class HotSet(BaseModel):
    """POST /moe/hot-set's answer and GET /moe/hot-set."""

    domain: str | None
    version: int
    n_experts: int
    layers: dict[str, list[int]]
    applied_version: int | None = Field(default=None, description="GET only: the version the compute thread uses")
