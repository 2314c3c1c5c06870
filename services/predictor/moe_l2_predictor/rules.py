"""The taxonomy's language rules on probability vectors (the keyword tier applies them to raw scores).

A domain restricted to some languages (chinese_tech: zh) gets no probability outside them, and
inside them takes over the probability of the domains it absorbs (codegen, debug). Applying the
same rules to every tier keeps "Chinese technology prompt" one decision, not three.
"""

from __future__ import annotations

import numpy as np

from moe_l2_domains.taxonomy import Taxonomy


class LanguageRules:
    def __init__(self, taxonomy: Taxonomy) -> None:
        names = taxonomy.names
        self.fallback = names.index(taxonomy.fallback)
        self.absorb: dict[str, list[tuple[int, list[int]]]] = {}
        self.restricted: list[tuple[int, frozenset[str]]] = []
        for i, d in enumerate(taxonomy.domains):
            if d.languages:
                self.restricted.append((i, frozenset(d.languages)))
                for lang in d.languages:
                    self.absorb.setdefault(lang, []).append((i, [names.index(a) for a in d.absorbs]))

    def apply(self, proba: np.ndarray, langs: list[str]) -> np.ndarray:
        """Rows of `proba` ([n, k], each summing to 1) after the rules for each row's language."""
        if not self.restricted:
            return proba
        out = proba.copy()
        for row, lang in enumerate(langs):
            for target, absorbed in self.absorb.get(lang, ()):
                out[row, target] += out[row, absorbed].sum()
                out[row, absorbed] = 0.0
            for i, allowed in self.restricted:
                if lang not in allowed:
                    out[row, i] = 0.0
        totals = out.sum(axis=1, keepdims=True)
        empty = totals[:, 0] <= 0.0
        if empty.any():
            out[empty, self.fallback] = 1.0
            totals[empty] = 1.0
        return out / totals
