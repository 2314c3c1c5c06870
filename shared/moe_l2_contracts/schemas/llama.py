"""The patched llama-server's MoE endpoints (services/llama/patches): /moe/routing, /moe/hot-set,
/moe/cache and /moe/cache/profile."""

from __future__ import annotations

import base64

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, Field

# layer (decimal string) -> expert id (decimal string) -> activations
LayerCounts = dict[str, dict[str, int]]


class LayerPairCounts(BaseModel):
    """One domain's cross-layer transitions in a routing snapshot (patch 0032, LLAMA_ARG_MOE_TRANSITIONS):
    for each layer l of `pairs`, how often expert a at MoE layer l and expert b at the next MoE layer (l+1, or
    l+2 where a dense layer comes between, as in llama4) were selected for
    the same token (every top-k x top-k pair); `counts` is base64 of little-endian uint32
    [len(pairs)][n_expert][n_expert]. Only layer pairs with counts are sent."""

    pairs: list[int]
    counts: str

    def tables(self, n_expert: int) -> dict[int, NDArray[np.uint32]]:
        """layer l -> [n_expert][n_expert] counts of (a at l, b at l+1); ValueError on a wrong size."""
        raw = base64.b64decode(self.counts, validate=True)
        shape = (len(self.pairs), n_expert, n_expert)
        if len(raw) != 4 * int(np.prod(shape)):
            raise ValueError(f"{len(raw) // 4} uint32 counts for {len(self.pairs)} layer pairs of {n_expert} experts")
        blocks = np.frombuffer(raw, dtype="<u4").reshape(shape)
        return {layer: blocks[i] for i, layer in enumerate(self.pairs)}


class RoutingSnapshot(BaseModel):
    """GET /moe/routing[?reset=1]: activations per domain tag, layer and expert since the last reset, and
    with LLAMA_ARG_MOE_TRANSITIONS the cross-layer transitions of each tag."""

    model: str = ""
    enabled: bool = True
    n_layer: int
    n_expert: int
    n_expert_used: int
    tokens: int = Field(description="tokens routed since the last reset, all tags together")
    tokens_by_domain: dict[str, int] = Field(default_factory=dict)
    domains: dict[str, LayerCounts] = Field(default_factory=dict)
    transitions: dict[str, LayerPairCounts] = Field(default_factory=dict)


class HotSetRequest(BaseModel):
    """POST /moe/hot-set: the experts to prepare, per layer, most used first: llama's expert cache
    pre-loads them in that order (patches 0016 and 0031), as many as its slots allow."""

    domain: str
    layers: dict[str, list[int]]


def encode_f32(table: NDArray[np.floating] | None) -> str | None:
    """A table as the profile body carries it: base64 of its values as little-endian float32, row-major."""
    if table is None:
        return None
    return base64.b64encode(np.ascontiguousarray(table, dtype="<f4").tobytes()).decode("ascii")


def decode_f32(text: str | None, shape: tuple[int, ...]) -> NDArray[np.float64] | None:
    """The inverse of encode_f32, as float64 (what the engine computes with); ValueError on a wrong size."""
    if text is None:
        return None
    raw = base64.b64decode(text, validate=True)
    n = int(np.prod(shape))
    if len(raw) != 4 * n:
        raise ValueError(f"{len(raw) // 4} float32 values for a table of shape {list(shape)} ({n})")
    return np.frombuffer(raw, dtype="<f4").astype(np.float64).reshape(shape)


class ExpertCacheShape(BaseModel):
    """GET /moe/cache (501 when the server runs without --moe-cache-bytes): the expert cache's shape.
    `layers` are the model layers it holds, in the order of a profile's tables; `profile` the domains
    it has tables for (POST /moe/cache/profile), "untagged" for the table of requests of no domain."""

    n_layer: int
    n_slot: int
    n_expert: int
    layers: list[int]
    device_bytes: int
    slot_bytes: int
    # the two buffers of a prompt's copies one expert tensor ahead (patch 0021), within device_bytes; 0 when off
    ahead_bytes: int = 0
    profile: list[str] = Field(default_factory=list)


class ExpertCacheProfile(BaseModel):
    """POST /moe/cache/profile (admin token): one domain's tables of the expert cache's routing profile.

    Layers are the cache's (GET /metrics: llamacpp:moe_cache_layers), in model order. `freq` [n_layer][n_expert]
    (each layer sums to 1) is the domain's prior for the hybrid policy; `transitions`
    [n_layer-1][n_expert][n_expert] is P(expert b at layer l+1 | expert a at layer l), what the default policy
    prefetches by. domain null: the tables of requests of no known domain (its transitions also serve a domain
    without its own; its frequencies are no prior). Both null removes the domain's tables. The engine
    computes with the float32 values widened to float64, so a replay must use the decoded tables."""

    domain: str | None = None
    freq: str | None = Field(default=None, description="base64, little-endian float32, row-major")
    transitions: str | None = Field(default=None, description="base64, little-endian float32, row-major")

    @classmethod
    def from_tables(
        cls,
        domain: str | None,
        freq: NDArray[np.floating] | None = None,
        transitions: NDArray[np.floating] | None = None,
    ) -> ExpertCacheProfile:
        return cls(domain=domain, freq=encode_f32(freq), transitions=encode_f32(transitions))


class ExpertCacheProfileResult(BaseModel):
    """POST /moe/cache/profile's answer."""

    domain: str | None
    n_layer: int
    n_expert: int
    freq: bool
    transitions: bool
