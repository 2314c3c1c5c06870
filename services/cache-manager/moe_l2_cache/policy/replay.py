"""Replays llama-server's expert-cache access log through a policy of this package.

The engine's cache (patch 0008, `--moe-cache-bytes`) is a port of `lru` and of the default policy. Run
with LLAMA_MOE_CACHE_LOG=<file> (test only), it writes one line per micro-batch and cached layer:

    <ubatch> <layer> <bypass> <expert> <expert> ...

the distinct experts the micro-batch's tokens selected at that layer (layer counts the cached MoE layers
from 0). A line with bypass 1 used more experts than the layer has slots: the engine copied them
without the cache and left its residency alone, so the replay skips it too.

The engine's counters (`/metrics`: moe_cache_accesses_total, _hits_total, _loads_total) must equal the
replay's, exactly: the port computes the same floating-point operations in the same order, and ties
keep the lower expert id on both sides (base.top_c_mask).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from moe_l2_cache.policy.base import PolicyError
from moe_l2_cache.policy.registry import DEFAULT_POLICY, make_policy

# the engine's policy names and the policies of this package they port
ENGINE_POLICIES = {"lru": "lru", "hybrid": "hybrid", "default": DEFAULT_POLICY}


@dataclass(frozen=True)
class Access:
    ubatch: int
    layer: int
    bypass: bool
    experts: tuple[int, ...]


@dataclass(frozen=True)
class ReplayCounts:
    accesses: int  # distinct experts used by the accesses the cache served (bypasses left out)
    hits: int
    loads: int
    bypass: int  # accesses over capacity, not replayed

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
        try:
            ubatch, layer, bypass, *experts = (int(f) for f in fields)
        except ValueError:
            raise PolicyError(f"{path}:{number}: not an access line: {line!r}") from None
        if bypass not in (0, 1) or layer < 0 or not experts:
            raise PolicyError(f"{path}:{number}: not an access line: {line!r}")
        accesses.append(Access(ubatch, layer, bool(bypass), tuple(experts)))
    return accesses


def replay_accesses(
    accesses: Iterable[Access], policy: str, n_layer: int, n_expert: int, capacity: int, top_k: int
) -> ReplayCounts:
    """Replays the accesses through the engine policy `policy` (lru, hybrid or default), no domain."""
    if policy not in ENGINE_POLICIES:
        raise PolicyError(f"unknown engine policy {policy!r}; known: {', '.join(ENGINE_POLICIES)}")
    cache = make_policy(ENGINE_POLICIES[policy], n_layer, n_expert, capacity, top_k=top_k)
    cache.on_domain(None)
    hits = total = bypass = 0
    for access in accesses:
        if access.layer >= n_layer:
            raise PolicyError(f"access at layer {access.layer}, but the cache has {n_layer} layers")
        if access.bypass:
            bypass += 1
            continue
        hits += cache.access(access.layer, access.experts)
        total += len(access.experts)
    loads = int(cache.loads)  # type: ignore[attr-defined]  # every policy of the registry counts loads
    return ReplayCounts(accesses=total, hits=hits, loads=loads, bypass=bypass)
