"""Replays llama-server's expert-cache access log through a policy of this package.

The engine's cache (patch 0009, `--moe-cache-bytes`) is a port of `lru` and of the default policy. Run
with `--moe-cache-log FILE` (LLAMA_ARG_MOE_CACHE_LOG), it writes one line per micro-batch and cached layer:

    <ubatch> <layer> <bypass> <domain> <expert> <expert> ...

the distinct experts the micro-batch's tokens selected at that layer (layer counts the cached MoE layers
from 0), and the micro-batch's domain (`-` for none: no tag, or sequences of several domains). A line
with bypass 1 used more experts than the layer has slots: the engine computed it on a full-size copy of the
layer's experts and left its residency alone, so the replay does not change residency either; it counts
the used experts that were resident then (`bypass_hits`: the engine copied those from their slots on the
device, patch 0017, and only the others from host memory). A line with `P` in place of bypass is a preload
(a domain's hot set, POST /moe/hot-set, before that micro-batch): the experts brought in as a prefetch
would be, already cut to the slots the engine gives a preload (n_slot - top-k).

With a routing profile (POST /moe/cache/profile: per domain a prior and cross-layer transitions) the
replay is given the same tables, as the engine holds them (float32 widened to float64), and switches
domain where the log does.

The engine's counters (`/metrics`: moe_cache_accesses_total, _hits_total, _loads_total, _prefetch_total,
_prefetch_used_total, and per domain _domain_prefetch_total and _domain_prefetch_used_total: a prefetch
charged to the micro-batch that made it, its use to the same one) must equal the replay's, exactly: the
port computes the same floating-point operations in the same order, and ties keep the lower expert id on
both sides (base.top_c_mask).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from moe_l2_cache.policy.base import FloatArray, PolicyError
from moe_l2_cache.policy.prefetch import CrossLayerPrefetch
from moe_l2_cache.policy.registry import DEFAULT_POLICY, make_policy

# the engine's policy names and the policies of this package they port
ENGINE_POLICIES = {"lru": "lru", "hybrid": "hybrid", "default": DEFAULT_POLICY}


@dataclass(frozen=True)
class Access:
    ubatch: int
    layer: int
    bypass: bool
    experts: tuple[int, ...]
    domain: str | None = None
    preload: bool = False  # the experts are a preload's, not an access's


@dataclass(frozen=True)
class DomainTables:
    """One domain's tables of the engine's routing profile (ExpertCacheProfile, decoded)."""

    freq: FloatArray | None = None  # [n_layer, n_expert]
    transitions: FloatArray | None = None  # [n_layer - 1, n_expert, n_expert]


@dataclass(frozen=True)
class ReplayCounts:
    accesses: int  # distinct experts used by the accesses the cache served (bypasses left out)
    hits: int
    loads: int  # misses copied in (demand loads)
    bypass: int  # accesses over capacity, not replayed
    bypass_hits: int = 0  # used experts of those accesses that were resident then (copied from slots)
    prefetch: int = 0  # experts copied in ahead of use
    prefetch_used: int = 0  # of those, the ones the layer then used
    # domain (None: none, or several) -> (prefetch, prefetch_used) of the micro-batches of that domain
    prefetch_by_domain: dict[str | None, tuple[int, int]] = field(default_factory=dict)
    preload: int = 0  # experts copied in by preloads

    @property
    def misses(self) -> int:
        return self.accesses - self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


def read_access_log(path: Path) -> list[Access]:
    """The accesses of a log; a malformed line is a PolicyError naming it."""
    accesses = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        preload = len(fields) > 2 and fields[2] == "P"
        try:
            ubatch, layer = (int(f) for f in fields[:2])
            bypass = 0 if preload else int(fields[2])
            experts = tuple(int(f) for f in fields[4:])
        except (ValueError, IndexError):
            raise PolicyError(f"{path}:{number}: not an access line: {line!r}") from None
        if len(fields) < 5 or bypass not in (0, 1) or layer < 0:
            raise PolicyError(f"{path}:{number}: not an access line: {line!r}")
        domain = None if fields[3] == "-" else fields[3]
        accesses.append(Access(ubatch, layer, bool(bypass), experts, domain, preload))
    return accesses


def replay_accesses(
    accesses: Iterable[Access],
    policy: str,
    n_layer: int,
    n_expert: int,
    capacity: int,
    top_k: int,
    profile: Mapping[str | None, DomainTables] | None = None,
) -> ReplayCounts:
    """Replays the accesses through the engine policy `policy` (lru, hybrid or default) with the engine's
    routing profile (domain None: the tables of no domain), switching domain where the log does."""
    if policy not in ENGINE_POLICIES:
        raise PolicyError(f"unknown engine policy {policy!r}; known: {', '.join(ENGINE_POLICIES)}")
    profile = profile or {}
    none = profile.get(None, DomainTables())
    domains = {d: t for d, t in profile.items() if d is not None}
    cache = make_policy(
        ENGINE_POLICIES[policy],
        n_layer,
        n_expert,
        capacity,
        top_k=top_k,
        domain_freq={d: t.freq for d, t in domains.items() if t.freq is not None},
        transitions=none.transitions,
        domain_transitions={d: t.transitions for d, t in domains.items() if t.transitions is not None},
    )
    cache.on_domain(None)
    domain: str | None = None
    hits = total = bypass = bypass_hits = preloaded = 0
    by_domain: dict[str | None, list[int]] = {}
    filled_by: list[str | None] = [None] * n_layer  # the domain whose prefetch last loaded into each layer
    for access in accesses:
        if access.layer >= n_layer:
            raise PolicyError(f"access at layer {access.layer}, but the cache has {n_layer} layers")
        if access.bypass:
            bypass += 1
            bypass_hits += len(cache.resident(access.layer).intersection(access.experts))
            continue
        if access.preload:
            preloaded += cache.preload(access.layer, access.experts)  # type: ignore[attr-defined]
            continue
        if access.domain != domain:
            domain = access.domain
            cache.on_domain(domain)
        before = (cache.stats.loads, cache.stats.used) if isinstance(cache, CrossLayerPrefetch) else (0, 0)
        hits += cache.access(access.layer, access.experts)
        total += len(access.experts)
        if isinstance(cache, CrossLayerPrefetch):
            loaded, used = cache.stats.loads - before[0], cache.stats.used - before[1]
            if used:
                by_domain.setdefault(filled_by[access.layer], [0, 0])[1] += used
            if loaded:
                by_domain.setdefault(domain, [0, 0])[0] += loaded
                filled_by[access.layer + 1] = domain
    if isinstance(cache, CrossLayerPrefetch):
        return ReplayCounts(
            accesses=total,
            hits=hits,
            loads=int(cache.inner.loads),
            bypass=bypass,
            bypass_hits=bypass_hits,
            prefetch=cache.stats.loads,
            prefetch_used=cache.stats.used,
            prefetch_by_domain={d: (p, u) for d, (p, u) in by_domain.items()},
            preload=preloaded,
        )
    loads = int(cache.loads)  # type: ignore[attr-defined]  # every policy of the registry counts loads
    return ReplayCounts(
        accesses=total, hits=hits, loads=loads, bypass=bypass, bypass_hits=bypass_hits, preload=preloaded
    )
