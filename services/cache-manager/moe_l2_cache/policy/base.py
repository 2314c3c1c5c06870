"""The common interface of expert-cache policies and the residency machinery they share.

A policy decides, for every MoE layer, which experts are resident in a cache of `capacity` experts
per layer. It sees the stream the engine sees: a request of some (predicted) domain starts
(`on_domain`), then for every token the experts each layer activated (`access`). `access` returns
how many of those experts were already resident (hits) and updates residency.

State is kept in numpy arrays of shape [n_layer, n_expert] so that one token's accesses at every
layer can be applied at once (`access_token`); the per-layer `access` is the same code on one row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]
FloatArray = NDArray[np.float64]


@runtime_checkable
class ExpertCachePolicy(Protocol):
    """What the cache-manager and the benchmark drive; every policy of this package implements it."""

    name: str

    def reset(self) -> None:
        """Forget everything learned online (profiles given at construction stay)."""
        ...

    def on_domain(self, domain: str | None) -> None:
        """A request of this (predicted) domain starts; None when no domain is known."""
        ...

    def access(self, layer: int, experts: Sequence[int]) -> int:
        """One token's experts at one layer: returns how many were resident, then updates residency."""
        ...

    def resident(self, layer: int) -> set[int]:
        """The experts resident at this layer now."""
        ...


class PolicyError(ValueError):
    """A policy was asked for with a bad name, shape or profile; the message says which."""


class TablePolicy:
    """Residency as a [n_layer, n_expert] boolean table, with counters the benchmark reads.

    `loads` counts experts copied into fast memory: every miss (the expert has to be brought in to
    be computed, whether it is then kept or not), plus whatever a policy fills or prefetches on its own.
    """

    name = "table"

    def __init__(self, n_layer: int, n_expert: int, capacity: int) -> None:
        if n_layer < 1 or n_expert < 1:
            raise PolicyError(f"n_layer and n_expert must be >= 1 (got {n_layer}, {n_expert})")
        if capacity < 0:
            raise PolicyError(f"capacity must be >= 0 (got {capacity})")
        self.n_layer = n_layer
        self.n_expert = n_expert
        self.capacity = min(capacity, n_expert)
        self.reset()

    # -- the interface ------------------------------------------------------------------------

    def reset(self) -> None:
        self._resident: BoolArray = np.zeros((self.n_layer, self.n_expert), dtype=bool)
        self._clock: IntArray = np.zeros(self.n_layer, dtype=np.int64)
        self.domain: str | None = None
        self.accesses = 0  # expert activations seen
        self.hits = 0
        self.loads = 0

    def on_domain(self, domain: str | None) -> None:
        self.domain = domain

    def access(self, layer: int, experts: Sequence[int]) -> int:
        if not 0 <= layer < self.n_layer:
            raise PolicyError(f"layer {layer} outside [0, {self.n_layer})")
        ex = np.asarray(experts, dtype=np.int64).reshape(1, -1)
        return int(self._step(np.array([layer], dtype=np.int64), ex)[0])

    def access_token(self, experts: NDArray[np.integer]) -> IntArray:
        """One token's experts at every layer ([n_layer, k]), layer by layer; hits per layer."""
        ex = np.asarray(experts, dtype=np.int64)
        if ex.ndim != 2 or ex.shape[0] != self.n_layer:
            raise PolicyError(f"expected experts of shape [{self.n_layer}, k], got {ex.shape}")
        return self._step(np.arange(self.n_layer, dtype=np.int64), ex)

    def resident(self, layer: int) -> set[int]:
        return {int(e) for e in np.flatnonzero(self._resident[layer])}

    def resident_table(self) -> BoolArray:
        """A copy of the whole residency table ([n_layer, n_expert])."""
        return self._resident.copy()

    # -- shared machinery ---------------------------------------------------------------------

    def _step(self, rows: IntArray, ex: IntArray) -> IntArray:
        """Counts hits of `ex[i]` at layer `rows[i]`, then lets the policy update its state."""
        if ex.size and (ex.min() < 0 or ex.max() >= self.n_expert):
            raise PolicyError(f"expert id outside [0, {self.n_expert})")
        hits = self._resident[rows[:, None], ex].sum(axis=1).astype(np.int64)
        self._clock[rows] += 1
        self.accesses += int(ex.size)
        n_hits = int(hits.sum())
        self.hits += n_hits
        self.loads += int(ex.size) - n_hits
        self._update(rows, ex)
        return hits

    def _update(self, rows: IntArray, ex: IntArray) -> None:
        """Residency after an access; the base class keeps it unchanged (a static set)."""

    def _set_resident(self, rows: IntArray, table: BoolArray) -> None:
        """Replaces the residency of `rows`, counting experts that come in as loads."""
        self.loads += int((table & ~self._resident[rows]).sum())
        self._resident[rows] = table


def top_c_mask(priority: FloatArray, capacity: int, candidates: BoolArray) -> BoolArray:
    """Per row, the `capacity` candidates of highest priority (all candidates if there are fewer).

    Ties keep the lower expert id. The rule is defined, not left to the selection algorithm, because the
    engine's port of the policies (llama-server's expert cache) must keep exactly the same experts."""
    n_rows, n_expert = priority.shape
    if capacity >= n_expert:
        return candidates.copy()
    if capacity <= 0:
        return np.zeros_like(candidates)
    masked = np.where(candidates, priority, -np.inf)
    idx = np.argsort(-masked, axis=1, kind="stable")[:, :capacity]
    keep = np.zeros_like(candidates)
    keep[np.arange(n_rows)[:, None], idx] = True
    return keep & candidates


class DemandPolicy(TablePolicy):
    """Demand caching: every miss is admitted, and when a layer is over capacity the resident experts
    of lowest priority leave. Subclasses define the priority (recency, frequency, ...)."""

    name = "demand"

    def _update(self, rows: IntArray, ex: IntArray) -> None:
        self._on_use(rows, ex)
        self._admit(rows, ex)

    def _admit(self, rows: IntArray, ex: IntArray) -> None:
        """Brings `ex` in (they outrank everything) and keeps the top-capacity of the rest.

        Misses were counted as loads in _step already; this only moves the table."""
        incoming = np.zeros((len(rows), self.n_expert), dtype=bool)
        incoming[np.arange(len(rows))[:, None], ex] = True
        self._insert(rows, incoming)

    def _insert(self, rows: IntArray, incoming: BoolArray) -> None:
        """Brings the experts of `incoming` ([len(rows), n_expert]) in, outranking everything, and
        keeps the top-capacity of the rest (prefetches use it with a different count per row)."""
        table = self._resident[rows] | incoming
        over = np.flatnonzero(table.sum(axis=1) > self.capacity)
        if len(over):
            # Only layers over capacity need an eviction decision (most accesses are all hits).
            priority = np.where(incoming[over], np.inf, self._priority(rows[over]))
            table[over] = top_c_mask(priority, self.capacity, table[over])
        self._resident[rows] = table

    def preload(self, layer: int, experts: Sequence[int]) -> int:
        """Brings `experts` into `layer` ahead of demand, as a prefetch does: they outrank the residents,
        whose priorities stay (llama's preload of a domain's hot set). Returns how many were copied in."""
        rows = np.array([layer], dtype=np.int64)
        incoming = np.zeros((1, self.n_expert), dtype=bool)
        incoming[0, np.asarray(experts, dtype=np.int64)] = True
        before = self._resident[rows].copy()
        self._insert(rows, incoming)
        return int((incoming & ~before & self._resident[rows]).sum())

    def _on_use(self, rows: IntArray, ex: IntArray) -> None:
        raise NotImplementedError

    def _priority(self, rows: IntArray) -> FloatArray:
        raise NotImplementedError
