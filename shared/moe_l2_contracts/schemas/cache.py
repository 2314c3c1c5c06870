"""The cache-manager's read-side contract: GET /v1/index, /v1/stats, /v1/hotset/{domain}, POST /v1/pull.

The hint (POST /v1/hint) is in schemas/hint.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

# -- GET /v1/index (and `moe-l2 index --json`) ------------------------------------------------------


class IndexTensor(BaseModel):
    """One routed-expert tensor: expert e is `expert_bytes` bytes at `offset + e * expert_bytes` of `file`."""

    name: str
    kind: Literal["gate", "up", "down", "gate_up"]
    part: str = Field(description="weight, bias, ...")
    ggml_type: str
    shape: list[int] = Field(description="ggml order: innermost first, the expert dimension last")
    file: str
    offset: int
    n_bytes: int
    expert_bytes: int


class IndexLayer(BaseModel):
    layer: int
    expert_bytes: int = Field(description="one expert's bytes over all its tensors in this layer")
    tensors: list[IndexTensor]


class IndexSummary(BaseModel):
    model_id: str = Field(description="hash of the metadata and tensor tables; namespaces the Redis keys")
    path: str
    files: list[str]
    file_bytes: int
    arch: str
    name: str
    n_layer: int
    moe_layers: list[int]
    n_expert: int
    n_expert_used: int
    leading_dense: int
    n_shared_experts: int
    expert_bytes_min: int
    expert_bytes_max: int
    routed_bytes: int
    other_bytes: int = Field(description="every tensor byte that is not a routed expert's")
    shared_expert_bytes: int
    tensor_bytes: int
    quant_types: list[str]
    layers: list[IndexLayer] = Field(default_factory=list)


class ExpertRange(BaseModel):
    file: str
    offset: int
    length: int


class ExpertRanges(BaseModel):
    """GET /v1/index/{layer}/{expert}: the byte ranges of one expert's slices."""

    layer: int
    expert: int
    ranges: list[ExpertRange]


# -- GET /v1/hotset/{domain} ----------------------------------------------------------------------


class HotSetResponse(BaseModel):
    """A domain's hot set: the most useful experts per layer under a byte budget, most useful first."""

    model_id: str
    domain: str
    layers: dict[str, list[int]]
    n_experts: int
    bytes: int
    budget_bytes: int
    activations: float = Field(description="(decayed) activations in the domain's tables when computed")
    coverage: float = Field(description="share of those activations that fall inside the hot set")
    computed_at: float = Field(description="unix time")


# -- GET /v1/stats --------------------------------------------------------------------------------


class PoolStats(BaseModel):
    budget_bytes: int
    policy: str
    capacity_per_layer: int = Field(description="experts per MoE layer the budget holds (the policy's capacity)")
    lock_mode: Literal["mlock", "prefetch-only"]
    lock_problem: str | None = Field(default=None, description="why the pool degraded to prefetch-only")
    memlock_limit_bytes: int | None = Field(default=None, description="RLIMIT_MEMLOCK soft limit; None = unlimited")
    pinned_experts: int
    pinned_bytes: int = Field(description="bytes of the pinned hot set (locked, or prefetched when degraded)")
    locked_bytes: int = Field(description="bytes held by mlock")
    tracked_experts: int
    tracked_bytes: int = Field(description="bytes of every expert the pool holds (pinned + prefetched)")
    resident_bytes: int = Field(description="of tracked_bytes, in the page cache now (mincore)")
    prefetch_bytes_total: int
    evicted_bytes_total: int
    lock_failures: int


class RamTierStats(BaseModel):
    """MOE_L2_RAM_BUDGET: the model file's residency held within a budget (docs/ram-tier.md)."""

    budget_bytes: int = Field(description="MOE_L2_RAM_BUDGET: the model file's resident bytes at most")
    non_expert_bytes: int = Field(description="tensors every token needs and the header: locked, never paged out")
    expert_bytes: int = Field(description="all routed experts' slices")
    kept_bytes: int = Field(
        default=0,
        description="the pages always resident: every page with a non-expert byte, and the pages two experts' "
        "slices share (never paged out); what the budget counts, where non_expert_bytes are the tensors' bytes",
    )
    expert_budget_bytes: int = Field(description="budget - kept bytes")
    headroom_bytes: int = Field(description="of the expert budget, left for the misses llama faults in between sweeps")
    pool_bytes: int = Field(description="of the expert budget, what the pool's policy holds")
    resident_expert_bytes: int = Field(description="expert pages in the page cache now (mincore)")
    resident_non_expert_bytes: int
    max_resident_bytes: int = Field(description="the most the model file had resident at a sweep, before it paged out")
    over_budget_sweeps: int = Field(description="sweeps that found more than the budget resident")
    paged_out_bytes_total: int = Field(
        description="resident expert bytes the tier paged out (process_madvise MADV_PAGEOUT on llama's mapping, "
        "then POSIX_FADV_DONTNEED)"
    )
    misses_seen_total: int = Field(description="experts found resident that the pool did not hold (llama's misses)")
    sweeps: int
    mean_sweep_ms: float
    llama_pids: list[int] = Field(description="the processes mapping the model file that the tier pages out of")
    lock_mode: Literal["mlock", "prefetch-only"] = Field(description="how the non-expert tensors are kept")
    problem: str | None = Field(default=None, description="a degraded mode, said once")
    generation: int = Field(default=0, description="times the model file was replaced and the pool rebuilt on it")


class FlywheelStats(BaseModel):
    pulls: int
    pull_errors: int
    last_pull_at: float | None
    last_error: str | None
    activations_pulled: int = Field(description="activations received from llama since start")
    tokens_pulled: int
    transitions_pulled: int = Field(
        default=0,
        description="(expert, next layer's expert) pairs received from llama since start (LLAMA_ARG_MOE_TRANSITIONS)",
    )
    flushes: int
    redis_ok: bool
    redis_errors: int
    buffered_cells: int = Field(description="(domain, layer, expert) and expert-pair counts waiting for Redis")
    buffered_activations: int
    dropped_activations: int = Field(description="activations dropped because the buffer was full")
    dropped_snapshots: int
    domains: list[str]
    skipped: dict[str, int] = Field(
        default_factory=dict,
        description="entries of Redis or of llama's routing snapshots skipped as unusable, per kind "
        "(domain, routing_key, routing_field, tokens_field, hotset, wrong_type, unknown_key, snapshot_domain, "
        "snapshot_cell; see moe_l2_cache.skips)",
    )


class HintStats(BaseModel):
    active_domain: str | None
    active_since: float | None = Field(description="unix time of the last switch")
    dwell_s: float
    hints: int
    switches: int
    held_by_dwell: int = Field(description="hints for another domain that came within the dwell time")
    pushes: int = Field(description="hot sets posted to llama")
    push_errors: int
    last_push_error: str | None = None
    scope: Literal["domain", "traffic"] = Field(
        default="domain", description="whose hot set is pushed: the active domain's, or the recent traffic's"
    )
    traffic: dict[str, float] | None = Field(
        default=None,
        description="traffic scope: each recently hinted domain's decayed share of the hints (they sum to 1)",
    )


class StatsResponse(BaseModel):
    mode: Literal["active", "pass-through"]
    reason: str = Field(default="", description="why the service runs in pass-through mode")
    model_id: str | None
    model_path: str | None
    pool: PoolStats | None
    ram_tier: RamTierStats | None = Field(default=None, description="null unless MOE_L2_RAM_BUDGET is set")
    flywheel: FlywheelStats | None
    hints: HintStats
    llama_url: str | None = Field(
        default=None,
        description="the llama-server this cache-manager serves: the replica it claimed (MOE_L2_CACHE_CLAIM_LLAMA), "
        "else MOE_L2_LLAMA_URL",
    )


# -- POST /v1/pull (admin) --------------------------------------------------------------------------


class PullResponse(BaseModel):
    ok: bool
    error: str | None = None
    tokens: int = 0
    activations: int = 0
    domains: list[str] = Field(default_factory=list)
    flushed: bool = Field(default=False, description="the counts reached Redis (else they wait in the buffer)")
    buffered_cells: int = 0
