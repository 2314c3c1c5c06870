"""One decode step and one prompt micro-batch of a placement (`decode`, `prompt`): the formula of
docs/placement-model.md, term by term, and the host's page cache over the experts it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_l2_placement.curve import CacheStats, esft_stats
from moe_l2_placement.machine import HBM_EFFICIENCY, Machine
from moe_l2_placement.shape import NotModelled, Shape
from moe_l2_placement.split import choose_split, split_time

OFFLOAD_MIN_BATCH = 32  # ggml's GGML_OP_OFFLOAD_MIN_BATCH: a prompt of fewer rows computes host experts on the CPU
# ESFT prompts of the bench: the experts a 117-token prompt uses, a share of a layer's 64 (p50's b: 7.16 GB
# copied = 26 layers x 56.6 experts x 4.87 MB)
PROMPT_USED_SHARE = 0.884


@dataclass(frozen=True)
class Placement:
    """Where each MoE layer's experts are: n_dev + n_cpu + n_copy + n_cache = L."""

    label: str
    n_dev: int = 0  # wholly on the device
    n_cpu: int = 0  # computed on the CPU in decode (the stock host layers)
    n_copy: int = 0  # used experts copied every step (d)
    n_cache: int = 0  # behind the expert cache
    slots: int = 0
    cpu_misses: bool = False  # the new design: misses split between copies and the CPU
    host: str = "pinned"  # pinned | mapped | ring: where the host experts are copied from
    prompt_through_cache: bool = True  # patch 0017: a prompt's misses copied by the cache, one expert each
    prompt_ahead: bool = False  # patch 0021: a prompt's copies one expert tensor ahead, overlapping compute


@dataclass
class Estimate:
    """One cell's time and its terms (seconds); tok/s and the bounding term follow."""

    tokens: float
    terms: dict[str, float]
    total_s: float = 0.0
    bound_override: str | None = None

    def __post_init__(self) -> None:
        if not self.total_s:
            self.total_s = sum(self.terms.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s

    @property
    def bound(self) -> str:
        if self.bound_override:
            return self.bound_override
        name, t = max(self.terms.items(), key=lambda kv: kv[1])
        return f"{name} {100 * t / self.total_s:.0f}%"


def split_gpu_time(shape: Shape, machine: Machine) -> dict[str, float]:
    """T_gpu as 'GPU weights read' (decode_read_bytes at HBM_EFFICIENCY of the data sheet) and 'per-token
    overhead' (launches, synchronisation: the rest); one term when the GPU's bandwidth is unknown."""
    if not machine.hbm_gbps:
        return {"GPU step (all on device)": machine.gpu_token_s}
    read = min(machine.gpu_token_s, shape.decode_read_bytes / (machine.hbm_gbps * HBM_EFFICIENCY * 1e9))
    return {"GPU weights read": read, "per-token overhead": machine.gpu_token_s - read}


def expected_crit(stats: CacheStats, shape: Shape, machine: Machine, cpu_misses: bool, host: str) -> float:
    """E[crit] a cached layer a token over the replay's spread of m (see the module docstring)."""
    t_x = machine.expert_copy_s(shape.expert_bytes, host)
    if not cpu_misses:
        return stats.misses * t_x
    t_cpu = machine.cpu_expert_s(shape.expert_bytes)
    total = 0.0
    for m, p in enumerate(stats.miss_hist):
        c = choose_split(m, 1, shape.expert_bytes, 0, 0, t_copy_s=t_x, t_cpu_s=t_cpu, t_return_s=machine.copy_latency_s)
        total += p * split_time(m, c, t_x, t_cpu, machine.copy_latency_s)
    # the spread's mean may differ from the replay's m by rounding: scale to the replay's misses
    mean = sum(m * p for m, p in enumerate(stats.miss_hist))
    return total * (stats.misses / mean) if mean > 0 else 0.0


def decode(shape: Shape, machine: Machine, pl: Placement, stats: CacheStats | None = None) -> Estimate:
    """One decode step of `pl` (the module docstring's formula)."""
    terms = split_gpu_time(shape, machine)
    crossing = pl.n_cpu + pl.n_copy + pl.n_cache
    terms["host round trips"] = crossing * machine.t_rt_s
    terms["CPU experts"] = pl.n_cpu * shape.top_k * machine.cpu_expert_s(shape.expert_bytes)
    copies = pl.n_copy * shape.top_k * machine.expert_copy_s(shape.expert_bytes, pl.host) if pl.n_copy else 0.0
    link = copies
    if pl.n_cache:
        if stats is None:
            raise NotModelled("a cached placement needs the policy's hit rate")
        t_x = machine.expert_copy_s(shape.expert_bytes, pl.host)
        crit = expected_crit(stats, shape, machine, pl.cpu_misses, pl.host)
        copies += pl.n_cache * stats.prefetch * t_x
        if pl.cpu_misses:
            terms["misses: PCIe || CPU"] = pl.n_cache * crit
        else:
            copies += pl.n_cache * crit
        link += pl.n_cache * (stats.misses + stats.prefetch) * t_x
    terms["PCIe copies"] = terms.get("PCIe copies", 0.0) + copies
    terms["NVMe reads"] = page_cache_misses(shape, machine, pl) * shape.expert_bytes / nvme_bps(machine)
    est = Estimate(1, {k: v for k, v in terms.items() if v > 0})
    if pl.cpu_misses and link > est.total_s:
        est.total_s = link
        est.bound_override = "PCIe link (demand copies, admissions, prefetch) 100%"
    return est


def prompt(
    shape: Shape,
    machine: Machine,
    pl: Placement,
    n: int,
    copied_bytes: float | None = None,
    stats: CacheStats | None = None,
) -> Estimate:
    """One prompt micro-batch of n tokens; `copied_bytes` are the run's own (else predicted)."""
    terms = {"GPU prompt compute": machine.gpu_prompt_s(n)}
    host_layers = pl.n_cpu + pl.n_copy + pl.n_cache
    if not host_layers:
        return Estimate(n, terms)
    terms["host round trips"] = host_layers * machine.t_rt_s
    used = min(distinct_used(shape, n), PROMPT_USED_SHARE * shape.n_expert)
    if n < OFFLOAD_MIN_BATCH and not pl.n_cache and not pl.n_copy:
        # a short prompt's host experts are computed on the CPU: each used expert read once, for its tokens
        tokens = n * shape.top_k / used
        terms["CPU experts"] = pl.n_cpu * used * machine.cpu_expert_s(shape.expert_bytes, tokens)
        return Estimate(n, terms)
    if copied_bytes is None:
        share = stats.prompt_copy_share if (pl.n_cache and stats and pl.prompt_through_cache) else 1.0
        copied_bytes = host_layers * used * share * shape.expert_bytes
    if pl.n_cache and pl.prompt_through_cache:
        n_copies = copied_bytes / shape.expert_bytes
        copy_s = n_copies * machine.expert_copy_s(shape.expert_bytes, pl.host)
        if pl.prompt_ahead:
            return prompt_ahead(n, terms, copy_s, used / shape.n_expert, pl.n_cache)
        terms["PCIe copies"] = copy_s
    else:
        terms["PCIe copies"] = machine.bulk_copy_s(copied_bytes, pl.host)
    terms["NVMe reads"] = copied_bytes * page_cache_miss_share(shape, machine, pl) / nvme_bps(machine)
    return Estimate(n, {k: v for k, v in terms.items() if v > 0})


# -- the host's memory: the page cache over the experts the host holds, the drive under it ---------------------

HOST_RESERVE_BYTES = 8e9  # assumed: the OS, the server, its buffers: host memory the experts cannot have


def host_held_bytes(shape: Shape, pl: Placement) -> int:
    """Expert bytes the host holds: every MoE layer not wholly on the device (a cached layer's experts all stay
    in host memory, the slots hold copies)."""
    return (pl.n_cpu + pl.n_copy + pl.n_cache) * shape.layer_bytes


def page_cache_share(shape: Shape, machine: Machine, pl: Placement) -> float:
    """The share of each host-held layer's experts the host's memory keeps (1: all of them)."""
    return ram_share(machine.host_ram_bytes, host_held_bytes(shape, pl))


def ram_share(host_ram_bytes: float, held_bytes: float) -> float:
    """The share of `held_bytes` of experts a host of `host_ram_bytes` keeps in memory, less HOST_RESERVE_BYTES
    (1: all of them; a host of 0 bytes is unbounded)."""
    if not host_ram_bytes or held_bytes == 0:
        return 1.0
    return max(0.0, min(1.0, (host_ram_bytes - HOST_RESERVE_BYTES) / held_bytes))


def page_cache_misses(shape: Shape, machine: Machine, pl: Placement) -> float:
    """Experts the host-held layers read from the drive a decode token, all of them together.

    The page cache keeps the experts read most (an LRU over each layer's experts), so a stock host layer
    misses like a cache of the page cache's share of the layer: the policy's replay at that share
    (esft_stats); below a sixteenth of the layer, every use is a miss. An expert in one of a cached layer's
    device slots is not read from the host while it is there, so the page cache ages it out: the device's
    slots and the page cache add up, and a cached layer misses like a cache of both."""
    share = page_cache_share(shape, machine, pl)
    if share >= 1.0:
        return 0.0
    E = shape.n_expert
    return (pl.n_cpu + pl.n_copy) * layer_misses_at(shape, share * E) + pl.n_cache * layer_misses_at(
        shape, pl.slots + share * E
    )


def layer_misses_at(shape: Shape, slots: float) -> float:
    """Misses a layer a token of an LRU-like cache of `slots` of its experts (page_cache_misses)."""
    E, k = shape.n_expert, shape.top_k
    if slots >= E:
        return 0.0
    if slots < E / 16:
        return float(k)
    return esft_stats(round(slots), k, E).misses


def page_cache_miss_share(shape: Shape, machine: Machine, pl: Placement) -> float:
    """Of the expert bytes a prompt reads from the host, the share that comes from the drive."""
    host_layers = pl.n_cpu + pl.n_copy + pl.n_cache
    return page_cache_misses(shape, machine, pl) / (host_layers * shape.top_k) if host_layers else 0.0


def nvme_bps(machine: Machine) -> float:
    return (machine.nvme_gbps or math.inf) * 1e9


EXPERT_TENSORS = 3  # gate, up, down: the expert nodes of a layer, each a split of its own
AHEAD_LAYER_SHARE = 0.75  # patch 0021 copies the next layer ahead when this one used this share of its experts


def prompt_ahead(n: int, terms: dict[str, float], copy_s: float, used_share: float, n_cache: int) -> Estimate:
    """Patch 0021: while one expert tensor computes, the next one's misses cross on the copy stream. Only the
    first tensor's copies stay in line; the others overlap the compute, so the prompt takes the longer of the
    two. Across layers the copies ahead take every expert not in a slot (the next layer's ids are not known
    yet): a share 1 - used_share of them goes unused, which the copy stream carries too."""
    if used_share >= AHEAD_LAYER_SHARE:
        copy_s /= used_share
        first = copy_s / (EXPERT_TENSORS * n_cache)
    else:
        first = copy_s / EXPERT_TENSORS  # each layer's first tensor in line, the other two ahead
    compute = sum(terms.values())
    terms["PCIe copies (in line)"] = first
    terms["PCIe copies (beyond the compute)"] = max(0.0, copy_s - first - compute)
    return Estimate(n, terms)


def distinct_used(shape: Shape, n: int) -> float:
    """Distinct experts n tokens use in a layer, routed uniformly: an upper bound (the ESFT prompts of the
    bench, skewed, use PROMPT_USED_SHARE of a layer's experts, which caps it in prompt())."""
    return shape.n_expert * (1 - (1 - shape.top_k / shape.n_expert) ** n)
