"""Online policies: they learn only from the accesses they see (no profile)."""

from __future__ import annotations

import numpy as np

from moe_l2_cache.policy.base import DemandPolicy, FloatArray, IntArray, PolicyError, top_c_mask

# LFU breaks ties between equal counts by recency; counts are scaled so that no clock value can
# outweigh one access (exact in float64 while counts and clocks stay below 2**21 and 2**32).
_TIE_SCALE = 2.0**32


def pow2(exponent: FloatArray) -> FloatArray:
    """2**x elementwise with C's pow(), the function the engine's port calls (np.exp2 may use SIMD code
    that rounds differently in the last bit, and the engine must reproduce these scores exactly)."""
    return np.array([2.0 ** float(x) for x in np.ravel(exponent)], dtype=np.float64).reshape(np.shape(exponent))


# LFRU's half-life in tokens, chosen on an inner split of the ESFT profile split (docs/cache-policy-study.md).
HALF_LIFE = 16.0


class LRU(DemandPolicy):
    """Least recently used: evicts the expert whose last activation at that layer is oldest."""

    name = "lru"

    def reset(self) -> None:
        super().reset()
        self._last = np.full((self.n_layer, self.n_expert), -np.inf)

    def _on_use(self, rows: IntArray, ex: IntArray) -> None:
        self._last[rows[:, None], ex] = self._clock[rows][:, None]

    def _priority(self, rows: IntArray) -> FloatArray:
        return self._last[rows]


class LFU(DemandPolicy):
    """Least frequently used, counting every activation since reset (resident or not); ties go to LRU."""

    name = "lfu"

    def reset(self) -> None:
        super().reset()
        self._count = np.zeros((self.n_layer, self.n_expert))
        self._last = np.zeros((self.n_layer, self.n_expert))

    def _on_use(self, rows: IntArray, ex: IntArray) -> None:
        self._count[rows[:, None], ex] += 1
        self._last[rows[:, None], ex] = self._clock[rows][:, None]

    def _priority(self, rows: IntArray) -> FloatArray:
        return self._count[rows] * _TIE_SCALE + self._last[rows]


class LFRU(DemandPolicy):
    """Frequency weighted by recency (LRFU, Lee et al. 2001): every activation adds 1 to an expert's
    score and scores decay by half every `half_life` tokens. A short half-life behaves like LRU,
    an infinite one like LFU; in between it keeps experts that are both frequent and recent."""

    name = "lfru"

    # Scores are kept inflated by 2**((clock - base) / half_life) so that decaying costs nothing:
    # an activation at time t adds 2**((t - base) / half_life), and comparing inflated scores within
    # a layer is comparing decayed ones. A layer is renormalised before the factor can overflow.
    _RENORM_EXPONENT = 512.0

    def __init__(
        self,
        n_layer: int,
        n_expert: int,
        capacity: int,
        half_life: float = HALF_LIFE,
        *,
        admission: bool = False,
        admit_margin: float = 0.0,
    ) -> None:
        if not half_life > 0:
            raise PolicyError(f"half_life must be > 0 (got {half_life})")
        self.half_life = float(half_life)
        self.admission = bool(admission)
        self.admit_margin = float(admit_margin)
        super().__init__(n_layer, n_expert, capacity)

    def reset(self) -> None:
        super().reset()
        self._score = np.zeros((self.n_layer, self.n_expert))
        self._base = np.zeros(self.n_layer)

    def _exponent(self, rows: IntArray) -> FloatArray:
        return (self._clock[rows] - self._base[rows]) / self.half_life

    def _inflation(self, rows: IntArray) -> FloatArray:
        """2**((now - base) / half_life) per row, renormalising rows that grew too far."""
        exponent = self._exponent(rows)
        far = exponent > self._RENORM_EXPONENT
        if far.any():
            far_rows = rows[far]
            self._score[far_rows] *= pow2(-exponent[far])[:, None]
            self._base[far_rows] = self._clock[far_rows]
            exponent = self._exponent(rows)
        return pow2(exponent)

    def _decayed(self, rows: IntArray) -> FloatArray:
        """The scores as of now (activations counted 1 when they happen, then halving per half-life)."""
        inflation = self._inflation(rows)  # first: it may renormalise the scores read next
        return self._score[rows] / inflation[:, None]

    def _on_use(self, rows: IntArray, ex: IntArray) -> None:
        inflation = self._inflation(rows)  # first: it may renormalise the rows being updated
        self._score[rows[:, None], ex] += inflation[:, None]

    def _priority(self, rows: IntArray) -> FloatArray:
        return self._score[rows]

    def _value(self, rows: IntArray) -> FloatArray:
        """The priority in activations as of now (what admission compares, margin included)."""
        return self._decayed(rows)

    def _update(self, rows: IntArray, ex: IntArray) -> None:
        self._on_use(rows, ex)
        if self.admission:
            self._admit_if_better(rows, ex)
        else:
            self._admit(rows, ex)

    def _admit_if_better(self, rows: IntArray, ex: IntArray) -> None:
        """TinyLFU-style admission: a missed expert was streamed in to be computed (a load, counted in
        _step), but it is kept only if its value beats, by `admit_margin`, that of the resident it
        would displace. Scores of non-resident experts live on (decaying), so frequency survives
        eviction: this is the ghost history an expert needs to earn its way in."""
        table = self._resident[rows]
        incumbent = table.copy()
        table[np.arange(len(rows))[:, None], ex] = True
        over = np.flatnonzero(table.sum(axis=1) > self.capacity)
        if len(over):
            value = self._value(rows[over]) + self.admit_margin * incumbent[over]
            table[over] = top_c_mask(value, self.capacity, table[over])
        self._resident[rows] = table

    def boost(self, rows: IntArray, weights: FloatArray) -> None:
        """Adds `weights` (in activations as of now) to the scores of `rows` (used by the domain-prior hybrid)."""
        inflation = self._inflation(rows)  # first: it may renormalise the rows being updated
        self._score[rows] += weights * inflation[:, None]
