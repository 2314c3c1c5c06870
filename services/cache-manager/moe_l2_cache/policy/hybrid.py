"""Domain prior plus online policy: a request's (predicted) domain says which experts it will likely
use; what the request then actually activates says more, and soon.

The online part is LFRU (decayed activation counts). The prior is the domain's expert frequency
expressed in the same unit: the decayed count an expert would reach if it kept being activated at
the domain's average rate, f * k * half_life / ln 2. Two knobs (fitted on training traces by the
benchmark):

- `fill_weight`: on a domain switch the prior is added to the scores once, the top-C experts are
  loaded (slots filled by the prior), and the boost then decays like any activation, so the online
  policy takes over as the request runs;
- `prior_weight`: a standing bias of the current domain's prior in every eviction decision.

A request of an unknown domain (or none) gets no prior: the policy is then plain LFRU.

With `admission` (LFRU's option), a missed expert is computed from a streamed copy but kept only if
its score, prior included, beats that of the expert it would displace (`hybrid_admit`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from moe_l2_cache.policy.base import FloatArray, IntArray, PolicyError, top_c_mask
from moe_l2_cache.policy.online import LFRU

# Chosen on an inner split of the ESFT profile split by bench/cache_policies.py (docs/cache-policy-study.md).
HALF_LIFE = 8.0
PRIOR_WEIGHT = 2.0
FILL_WEIGHT = 0.0
# For `hybrid_admit` (the hybrid with admission), chosen on the same inner split. On ESFT every margin
# measured below admitting every miss (docs/cache-policy-study.md), so plain `hybrid` admits every miss.
ADMIT_MARGIN = -1.0


class DomainPriorHybrid(LFRU):
    name = "hybrid"

    def __init__(
        self,
        n_layer: int,
        n_expert: int,
        capacity: int,
        global_freq: FloatArray | None = None,
        domain_freq: Mapping[str, FloatArray] | None = None,
        *,
        half_life: float = HALF_LIFE,
        prior_weight: float = PRIOR_WEIGHT,
        fill_weight: float = FILL_WEIGHT,
        top_k: int | None = None,
        admission: bool = False,
        admit_margin: float = 0.0,
    ) -> None:
        self.n_layer, self.n_expert = n_layer, n_expert
        self.set_priors(global_freq, domain_freq)
        if prior_weight < 0 or fill_weight < 0:
            raise PolicyError("prior_weight and fill_weight must be >= 0")
        self.prior_weight = float(prior_weight)
        self.fill_weight = float(fill_weight)
        self._top_k = top_k  # activations per token and layer; learned from the first access if unset
        self.name = "hybrid_admit" if admission else "hybrid"
        super().__init__(n_layer, n_expert, capacity, half_life, admission=admission, admit_margin=admit_margin)

    def set_priors(self, global_freq: FloatArray | None, domain_freq: Mapping[str, FloatArray] | None) -> None:
        """Replaces the prior tables (the flywheel relearns them as traffic changes); without any the
        policy is plain LFRU. Takes effect at the next domain switch.

        `global_freq` is checked and kept (so a whole profile can be handed over) but is not a prior:
        a request of no known domain gets none (see prior_table)."""
        shape = (self.n_layer, self.n_expert)
        glob = np.zeros(shape) if global_freq is None else np.asarray(global_freq, dtype=np.float64)
        domains = {d: np.asarray(f, dtype=np.float64) for d, f in (domain_freq or {}).items()}
        for d, table in {"global_freq": glob, **domains}.items():
            if table.shape != shape:
                raise PolicyError(f"prior table {d!r} must have shape {list(shape)}, got {list(table.shape)}")
        self.global_freq, self._domains = glob, domains
        self._none = np.zeros(shape)

    def reset(self) -> None:
        super().reset()
        self._freq = self._none

    def prior_table(self, domain: str | None) -> FloatArray:
        """The domain's frequency table; none (zeros) for an unknown domain or none at all.

        Not the global table: with no domain there is nothing to add to the online evidence, and a
        global prior measured no better (ESFT -0.2 points, demo +0.5; docs/cache-policy-study.md)."""
        if domain is None or domain not in self._domains:
            return self._none
        return self._domains[domain]

    def _steady(self, freq: FloatArray) -> FloatArray:
        rate = float(self._top_k) if self._top_k else 1.0
        return freq * rate * self.half_life / np.log(2.0)

    def on_domain(self, domain: str | None) -> None:
        if domain != self.domain:
            self._freq = self.prior_table(domain)
            if self.fill_weight > 0 and self._top_k:
                rows = np.arange(self.n_layer)
                self.boost(rows, self.fill_weight * self._steady(self._freq))
                everything = np.ones((self.n_layer, self.n_expert), dtype=bool)
                self._set_resident(rows, top_c_mask(self._priority(rows), self.capacity, everything))
        super().on_domain(domain)

    def _on_use(self, rows: IntArray, ex: IntArray) -> None:
        if self._top_k is None:
            self._top_k = int(ex.shape[1])
        super()._on_use(rows, ex)

    def _priority(self, rows: IntArray) -> FloatArray:
        if self.prior_weight == 0:
            return self._score[rows]
        return self._value(rows)

    def _value(self, rows: IntArray) -> FloatArray:
        return self._decayed(rows) + self.prior_weight * self._steady(self._freq[rows])
