"""Static hot sets: the top-C experts of a learned frequency table stay resident; misses are streamed
in to be computed but never kept."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from moe_l2_cache.policy.base import BoolArray, FloatArray, PolicyError, TablePolicy, top_c_mask


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
