"""Cross-layer prefetch: a token's experts at layer l predict its experts at layer l+1.

After each access at layer l, the `n_predict` experts with the highest mean P(b at l+1 | a at l)
over the accessed experts a (a table learned on training traces) are loaded into layer l+1's cache
of the inner policy, ahead of demand. They keep their old priority there, so a wrong guess is the
first to leave. Whether a prefetch lands before layer l+1 needs it is not modelled: a prefetched
expert counts as a hit, and every prefetch that was not used is extra bytes.

The threshold prefetch (`hybrid_threshold_prefetch`, `min_lift` > 0) loads only the predictions that
are confident enough, from the request's domain's table, so that what it saves in misses pays for
what it wastes: on ESFT it moves fewer bytes than LRU (docs/cache-policy-study.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


# How much likelier than chance a prediction must be before the threshold prefetch loads it: the
# best hit rate on an inner split of the ESFT profile split among the values that move no more bytes
# than LRU there (bench/cache_policies.py, docs/cache-policy-study.md). In units of chance (k of n
# experts) so that it carries over between models: on ESFT (6 of 64) it is P > 0.30.
MIN_LIFT = 3.2


class CrossLayerPrefetch:
    """Wraps a demand policy (LRU, LFRU, the hybrid) and prefetches into it.

    `min_lift` > 0 loads only predictions whose mean P(b at l+1 | a at l) exceeds min_lift times
    chance, k / n_expert for k experts per token (at most `n_predict` of them; without `n_predict`,
    all of them), so a confident layer prefetches more than an unsure one. `domain_transitions` are
    per-domain tables, used while a request of that domain runs; the global table serves any other.
    Without any table nothing is prefetched and the policy is its inner one (the cache-manager's
    host pool has no per-token traces to learn one from).
    """

    def __init__(
        self,
        inner: DemandPolicy,
        transitions: FloatArray | None,
        n_predict: int | None = None,
        min_lift: float = 0.0,
        domain_transitions: Mapping[str, FloatArray] | None = None,
        name: str | None = None,
    ) -> None:
        if n_predict is not None and n_predict < 1:
            raise PolicyError(f"n_predict must be >= 1 (got {n_predict})")
        if not 0.0 <= min_lift < inner.n_expert:
            raise PolicyError(f"min_lift must be in [0, n_expert) (got {min_lift})")
        self.inner = inner
        self.name = name or ("xlayer_prefetch" if inner.name == "lru" else f"{inner.name}_prefetch")
        self.n_predict = n_predict
        self.min_lift = float(min_lift)
        self.n_layer = inner.n_layer
        self.n_expert = inner.n_expert
        self.capacity = inner.capacity
        self._global = None if transitions is None else self._checked("transitions", transitions)
        self._domains = {
            d: self._checked(f"domain_transitions[{d!r}]", t) for d, t in (domain_transitions or {}).items()
        }
        self.reset()

    def _checked(self, what: str, transitions: FloatArray) -> FloatArray:
        table = np.asarray(transitions, dtype=np.float64)
        shape = (self.n_layer - 1, self.n_expert, self.n_expert)
        if table.shape != shape:
            raise PolicyError(f"{what} must have shape {list(shape)}, got {list(table.shape)}")
        return table

    # -- the interface ------------------------------------------------------------------------

    def reset(self) -> None:
        self.inner.reset()
        self._table = self._global
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
        self._table = self._global if domain is None else self._domains.get(domain, self._global)

    def set_priors(self, global_freq: FloatArray | None, domain_freq: Mapping[str, FloatArray] | None) -> None:
        """Hands the flywheel's prior tables to the inner policy, if it takes any (the pool calls this)."""
        set_priors = getattr(self.inner, "set_priors", None)
        if set_priors is not None:
            set_priors(global_freq, domain_freq)

    def access(self, layer: int, experts: Sequence[int]) -> int:
        ex = np.asarray(experts, dtype=np.int64).reshape(1, -1)
        rows = np.array([layer], dtype=np.int64)
        hits = self.inner.access(layer, experts)
        self._score_predictions(rows, ex)
        if layer + 1 < self.n_layer and self._table is not None:
            self._prefetch(rows, ex)
        return hits

    def access_token(self, experts: NDArray[np.integer]) -> IntArray:
        # Layers are separate caches, so loading every layer's prediction (from the layer before,
        # of this same token) and then accessing all layers is the same as going layer by layer.
        ex = np.asarray(experts, dtype=np.int64)
        rows = np.arange(self.n_layer, dtype=np.int64)
        if self._table is not None:
            self._prefetch(rows[:-1], ex[:-1])
        hits = self.inner.access_token(ex)
        self._score_predictions(rows, ex)
        return hits

    def resident(self, layer: int) -> set[int]:
        return self.inner.resident(layer)

    def preload(self, layer: int, experts: Sequence[int]) -> int:
        return self.inner.preload(layer, experts)

    def resident_table(self) -> BoolArray:
        return self.inner.resident_table()

    # -- prediction ---------------------------------------------------------------------------

    def predict(self, layer: int, experts: Sequence[int]) -> list[int]:
        """The experts predicted for layer+1 from `experts` at layer (best first)."""
        if self._table is None:
            return []
        ex = np.asarray(experts, dtype=np.int64).reshape(1, -1)
        scores = self._table[layer][ex[0]].mean(axis=0)
        best = np.argsort(-scores, kind="stable")[: self._n_predict(ex.shape[1])]
        return [int(e) for e in best if scores[e] > self._threshold(ex.shape[1])]

    def _n_predict(self, k: int) -> int:
        """At most this many predictions per layer: n_predict, else top-k, or every expert with a threshold."""
        if self.n_predict:
            return min(self.n_predict, self.n_expert)
        return self.n_expert if self.min_lift > 0 else min(k, self.n_expert)

    def _threshold(self, k: int) -> float:
        """The P(b at l+1) a prediction must exceed: min_lift times chance (k of n_expert)."""
        return self.min_lift * k / self.n_expert

    def _predicted(self, rows: IntArray, ex: IntArray) -> BoolArray:
        """Per row, the top-`n_predict` experts by mean P(b at l+1 | a at l) over a in `ex`, and of those
        only the ones above the threshold (so a confident layer prefetches more than an unsure one)."""
        assert self._table is not None
        scores = self._table[rows[:, None], ex].mean(axis=1)  # [R, n_expert]
        n = self._n_predict(ex.shape[1])
        if n >= self.n_expert:
            predicted = np.ones((len(rows), self.n_expert), dtype=bool)
        else:
            pred = np.argpartition(-scores, n - 1, axis=1)[:, :n]
            predicted = np.zeros((len(rows), self.n_expert), dtype=bool)
            predicted[np.arange(len(rows))[:, None], pred] = True
        if self.min_lift > 0:
            predicted &= scores > self._threshold(ex.shape[1])
        return predicted

    def _prefetch(self, rows: IntArray, ex: IntArray) -> None:
        """After accessing `ex` at `rows`, loads predictions into `rows + 1`."""
        if not len(rows):
            return
        predicted = self._predicted(rows, ex)
        targets = rows + 1
        before = self.inner._resident[targets]
        self.inner._insert(targets, predicted)
        # more predictions than slots (possible with a threshold): those that did not fit were not loaded
        loaded = predicted & ~before & self.inner._resident[targets]
        self._pending[targets] = predicted
        self._pending_new[targets] = loaded
        self.stats.loads += int(loaded.sum())

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
