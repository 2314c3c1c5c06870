"""The offline study's policies: what docs/cache-policy-study.md measured the product's policies against.

Not in the product's package: Belady needs the whole future stream (an upper bound, never a usable
policy), and the static hot sets lost to LRU from C = 16 up on real traces (the study's table), so no
service runs them. `make_study_policy` makes these by name and the product's (moe_l2_cache.policy)
otherwise; bench/cache_policies.py is its user, tests/policy/test_study_policies.py its tests.

Belady's offline optimum: it knows the future, so it is an upper bound, not a usable policy.

On every access the experts kept at a layer are the `capacity` ones, among those resident and those
just used, whose next use at that layer comes soonest. With bypass (the default) a just-used expert
that is needed later than every resident one is not kept; that is optimal when a miss can be
computed from a streamed copy without caching it, which is the cost model of every policy here
(each miss is one load, whether it is kept or not). Prefetching policies load ahead of demand and
are not bounded by it.

Static hot sets: the top-C experts of a learned frequency table stay resident; misses are streamed
in to be computed but never kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from moe_l2_cache.policy import ExpertCachePolicy, PolicyError, make_policy
from moe_l2_cache.policy.base import BoolArray, FloatArray, IntArray, TablePolicy, top_c_mask

NEVER = np.iinfo(np.int64).max


def next_use(experts: NDArray[np.integer], n_expert: int) -> IntArray:
    """next_use[t, l, s]: the first token after t whose layer-l experts include experts[t, l, s] (or NEVER)."""
    ex = np.asarray(experts, dtype=np.int64)
    n_tok, n_layer = ex.shape[:2]
    out = np.empty_like(ex)
    for layer in range(n_layer):
        used = np.zeros((n_tok + 1, n_expert), dtype=bool)
        used[np.arange(n_tok)[:, None], ex[:, layer, :]] = True
        stamp = np.where(used, np.arange(n_tok + 1)[:, None], NEVER)
        stamp[n_tok] = NEVER
        # first use at or after t, then shift by one to get "strictly after t".
        first_from = np.minimum.accumulate(stamp[::-1], axis=0)[::-1]
        out[:, layer, :] = first_from[np.arange(1, n_tok + 1)[:, None], ex[:, layer, :]]
    return out


class Belady(TablePolicy):
    """Replays exactly the stream it was built with (`future[token, layer, slot]`), token by token and
    layer by layer; any other access is an error, since the optimum is only defined for that stream."""

    name = "belady"

    def __init__(
        self, n_layer: int, n_expert: int, capacity: int, future: NDArray[np.integer], bypass: bool = True
    ) -> None:
        fut = np.asarray(future, dtype=np.int64)
        if fut.ndim != 3 or fut.shape[1] != n_layer:
            raise PolicyError(f"future must be [token, {n_layer}, k], got {fut.shape}")
        self._future = fut
        self._next = next_use(fut, n_expert)
        self.bypass = bypass
        super().__init__(n_layer, n_expert, capacity)

    def reset(self) -> None:
        super().reset()
        self._next_by_expert: FloatArray = np.full((self.n_layer, self.n_expert), np.inf)
        self._pos = np.zeros(self.n_layer, dtype=np.int64)  # next token index per layer

    def _update(self, rows: IntArray, ex: IntArray) -> None:
        t = self._pos[rows]
        if np.any(t >= len(self._future)):
            raise PolicyError("Belady was given more accesses than its future stream holds")
        expected = np.sort(self._future[t, rows], axis=1)
        if expected.shape != ex.shape or not np.array_equal(expected, np.sort(ex, axis=1)):
            raise PolicyError("Belady must replay exactly the stream it was built with")
        r = np.arange(len(rows))[:, None]
        order = np.argsort(self._future[t, rows], axis=1)
        nxt = self._next[t, rows]
        # Match each accessed expert to its next-use entry (both sorted by expert id).
        sorted_ex = np.take_along_axis(self._future[t, rows], order, axis=1)
        sorted_next = np.take_along_axis(nxt, order, axis=1).astype(np.float64)
        sorted_next[sorted_next == NEVER] = np.inf
        table = self._next_by_expert[rows]
        table[r, sorted_ex] = sorted_next
        self._next_by_expert[rows] = table
        candidates = self._resident[rows].copy()
        candidates[r, ex] = True
        priority = -table
        if not self.bypass:
            priority[r, ex] = np.inf
        self._resident[rows] = top_c_mask(priority, self.capacity, candidates)
        self._pos[rows] += 1


def belady_hits(future: NDArray[np.integer], n_expert: int, capacity: int, bypass: bool = True) -> IntArray:
    """Offline entry point: hits[token, layer] of Belady replaying `future[token, layer, slot]`."""
    fut = np.asarray(future, dtype=np.int64)
    policy = Belady(fut.shape[1], n_expert, capacity, fut, bypass=bypass)
    hits = np.zeros(fut.shape[:2], dtype=np.int64)
    for t in range(len(fut)):
        hits[t] = policy.access_token(fut[t])
    return hits


def top_c_table(freq: FloatArray, capacity: int) -> BoolArray:
    """Per layer, the `capacity` most frequent experts (ties: lower id first, so the set is stable)."""
    n_expert = freq.shape[1]
    # A tiny decreasing bonus by id makes ties deterministic without changing any real ordering.
    tie = -np.arange(n_expert) * 1e-12
    return top_c_mask(freq + tie, capacity, np.ones(freq.shape, dtype=bool))


def _check_table(name: str, table: FloatArray, n_layer: int, n_expert: int) -> FloatArray:
    arr = np.asarray(table, dtype=np.float64)
    if arr.shape != (n_layer, n_expert):
        raise PolicyError(f"{name} must have shape [{n_layer}, {n_expert}], got {arr.shape}")
    return arr


class StaticGlobal(TablePolicy):
    """One hot set for all traffic: the top-C experts per layer over every domain of the profile."""

    name = "static_global"

    def __init__(self, n_layer: int, n_expert: int, capacity: int, global_freq: FloatArray) -> None:
        self._table = top_c_table(_check_table("global_freq", global_freq, n_layer, n_expert), capacity)
        super().__init__(n_layer, n_expert, capacity)

    def reset(self) -> None:
        super().reset()
        # The set is there before traffic starts (pinned ahead), so filling it is not a per-token cost.
        self._resident[:] = self._table


class StaticDomain(TablePolicy):
    """One hot set per domain, swapped in when a request of another domain starts; a request with
    an unknown domain (or none) gets the global set."""

    name = "static_domain"

    def __init__(
        self,
        n_layer: int,
        n_expert: int,
        capacity: int,
        global_freq: FloatArray,
        domain_freq: Mapping[str, FloatArray],
    ) -> None:
        self._global = top_c_table(_check_table("global_freq", global_freq, n_layer, n_expert), capacity)
        self._tables = {
            d: top_c_table(_check_table(f"domain_freq[{d!r}]", f, n_layer, n_expert), capacity)
            for d, f in domain_freq.items()
        }
        super().__init__(n_layer, n_expert, capacity)

    def reset(self) -> None:
        super().reset()
        self._resident[:] = self._global

    def table_for(self, domain: str | None) -> BoolArray:
        return self._tables.get(domain, self._global) if domain is not None else self._global

    def on_domain(self, domain: str | None) -> None:
        if domain != self.domain:
            self._set_resident(np.arange(self.n_layer), self.table_for(domain))
        super().on_domain(domain)


def _need(profile: Mapping[str, Any], key: str, policy: str) -> Any:
    value = profile.get(key)
    if value is None:
        raise PolicyError(f"policy {policy!r} needs a profile with {key!r} (see moe_l2_cache.policy.profile)")
    return value


STUDY_FACTORIES: dict[str, Callable[[int, int, int, Mapping[str, Any]], ExpertCachePolicy]] = {
    "static_global": lambda n_layer, n_expert, capacity, p: StaticGlobal(
        n_layer, n_expert, capacity, _need(p, "global_freq", "static_global")
    ),
    "static_domain": lambda n_layer, n_expert, capacity, p: StaticDomain(
        n_layer, n_expert, capacity, _need(p, "global_freq", "static_domain"), p.get("domain_freq") or {}
    ),
    "belady": lambda n_layer, n_expert, capacity, p: Belady(
        n_layer, n_expert, capacity, _need(p, "future", "belady"), p.get("bypass", True)
    ),
}


def make_study_policy(name: str, n_layer: int, n_expert: int, capacity: int, **profile: Any) -> ExpertCachePolicy:
    """A study policy by name (`future` is Belady's whole stream, [token, layer, k]), else the product's."""
    if name in STUDY_FACTORIES:
        return STUDY_FACTORIES[name](n_layer, n_expert, capacity, profile)
    return make_policy(name, n_layer, n_expert, capacity, **profile)
