"""Cross-layer prefetch: a token's experts at layer l predict its experts at layer l+1.

After each access at layer l, the `n_predict` experts with the highest mean P(b at l+1 | a at l)
over the accessed experts a (a table learned on training traces) are loaded into layer l+1's cache
of the inner policy, ahead of demand. They keep their old priority there, so a wrong guess is the
first to leave. Whether a prefetch lands before layer l+1 needs it is not modelled: a prefetched
expert counts as a hit, and every prefetch that was not used is extra bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from moe_l2_cache.policy.base import BoolArray, DemandPolicy, FloatArray, IntArray, PolicyError


@dataclass
class PrefetchStats:
    predicted: int = 0  # predictions made
    correct: int = 0  # predictions the next layer then activated
    actual: int = 0  # activations at layers that had a prediction
    loads: int = 0  # predicted experts that were not resident and were loaded
    used: int = 0  # of those loads, the ones activated right after

    @property
    def precision(self) -> float:
        return self.correct / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        return self.correct / self.actual if self.actual else 0.0

    @property
    def wasted(self) -> int:
        return self.loads - self.used


class CrossLayerPrefetch:
    """Wraps a demand policy (LRU, LFRU, the hybrid) and prefetches into it."""

    def __init__(self, inner: DemandPolicy, transitions: FloatArray, n_predict: int | None = None) -> None:
        table = np.asarray(transitions, dtype=np.float64)
        shape = (inner.n_layer - 1, inner.n_expert, inner.n_expert)
        if table.shape != shape:
            raise PolicyError(f"transitions must have shape {list(shape)}, got {list(table.shape)}")
        if n_predict is not None and n_predict < 1:
            raise PolicyError(f"n_predict must be >= 1 (got {n_predict})")
        self.inner = inner
        self.name = "xlayer_prefetch" if inner.name == "lru" else f"{inner.name}_prefetch"
        self._table = table
        self.n_predict = n_predict
        self.n_layer = inner.n_layer
        self.n_expert = inner.n_expert
        self.capacity = inner.capacity
        self.reset()

    # -- the interface ------------------------------------------------------------------------

    def reset(self) -> None:
        self.inner.reset()
        self.stats = PrefetchStats()
        self._pending: BoolArray = np.zeros((self.n_layer, self.n_expert), dtype=bool)  # predicted
        self._pending_new: BoolArray = np.zeros((self.n_layer, self.n_expert), dtype=bool)  # and loaded

    @property
    def domain(self) -> str | None:
        return self.inner.domain

    @property
    def hits(self) -> int:
        return self.inner.hits

    @property
    def accesses(self) -> int:
        return self.inner.accesses

    @property
    def loads(self) -> int:
        return self.inner.loads + self.stats.loads

    def on_domain(self, domain: str | None) -> None:
        self.inner.on_domain(domain)

    def access(self, layer: int, experts: Sequence[int]) -> int:
        ex = np.asarray(experts, dtype=np.int64).reshape(1, -1)
        rows = np.array([layer], dtype=np.int64)
        hits = self.inner.access(layer, experts)
        self._score_predictions(rows, ex)
        if layer + 1 < self.n_layer:
            self._prefetch(rows, ex)
        return hits

    def access_token(self, experts: NDArray[np.integer]) -> IntArray:
        # Layers are separate caches, so loading every layer's prediction (from the layer before,
        # of this same token) and then accessing all layers is the same as going layer by layer.
        ex = np.asarray(experts, dtype=np.int64)
        rows = np.arange(self.n_layer, dtype=np.int64)
        self._prefetch(rows[:-1], ex[:-1])
        hits = self.inner.access_token(ex)
        self._score_predictions(rows, ex)
        return hits

    def resident(self, layer: int) -> set[int]:
        return self.inner.resident(layer)

    def resident_table(self) -> BoolArray:
        return self.inner.resident_table()

    # -- prediction ---------------------------------------------------------------------------

    def predict(self, layer: int, experts: Sequence[int]) -> list[int]:
        """The experts predicted for layer+1 from `experts` at layer (best first)."""
        ex = np.asarray(experts, dtype=np.int64).reshape(1, -1)
        scores = self._table[layer][ex[0]].mean(axis=0)
        n = self.n_predict or ex.shape[1]
        return [int(e) for e in np.argsort(-scores, kind="stable")[:n]]

    def _prefetch(self, rows: IntArray, ex: IntArray) -> None:
        """After accessing `ex` at `rows`, loads predictions into `rows + 1`."""
        if not len(rows):
            return
        n = min(self.n_predict or ex.shape[1], self.n_expert)
        scores = self._table[rows[:, None], ex].mean(axis=1)  # [R, n_expert]: mean P(b | a) over a in ex
        pred = np.argpartition(-scores, n - 1, axis=1)[:, :n]
        targets = rows + 1
        r = np.arange(len(rows))[:, None]
        resident = self.inner._resident[targets]
        predicted = np.zeros_like(resident)
        predicted[r, pred] = True
        self._pending[targets] = predicted
        self._pending_new[targets] = predicted & ~resident
        self.stats.loads += int((predicted & ~resident).sum())
        self.inner._admit(targets, pred)

    def _score_predictions(self, rows: IntArray, ex: IntArray) -> None:
        pending = self._pending[rows]
        has = pending.any(axis=1)
        if not has.any():
            return
        used = np.zeros_like(pending)
        used[np.arange(len(rows))[:, None], ex] = True
        self.stats.predicted += int(pending.sum())
        self.stats.correct += int((pending & used).sum())
        self.stats.actual += int(used[has].sum())
        self.stats.used += int((self._pending_new[rows] & used).sum())
        self._pending[rows] = False
        self._pending_new[rows] = False
