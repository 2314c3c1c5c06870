"""Tier 1: the keyword classifier of moe_l2_domains, over a chat's weighted segments."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moe_l2_domains.keywords import FALLBACK_PRIOR, KeywordClassifier, KeywordPrediction
from moe_l2_domains.taxonomy import Taxonomy
from moe_l2_predictor.prompt import Prompt

# Added to every domain's evidence before the hybrid sees it: no keyword means "no idea" (near
# uniform), not "certainly general_qa", and one weak keyword is a hint, not a verdict.
SMOOTHING = 0.5


class KeywordTier:
    name = "keyword"

    def __init__(self, taxonomy: Taxonomy) -> None:
        self.classifier = KeywordClassifier(taxonomy)
        self._fallback = taxonomy.names.index(taxonomy.fallback)

    def evidence(self, prompt: Prompt) -> list[float]:
        total = [0.0] * len(self.classifier.names)
        for text, weight in prompt.segments:
            raw, _ = self.classifier.raw_scores(text, prompt.lang)
            for i, value in enumerate(raw):
                total[i] += weight * value
        return total

    def predict(self, prompt: Prompt) -> KeywordPrediction:
        return self.classifier.decide(self.evidence(prompt), prompt.lang)

    def proba(self, prompts: Sequence[Prompt]) -> np.ndarray:
        """Smoothed evidence shares, [n, k]: what the hybrid combines."""
        rows = np.array([self.evidence(p) for p in prompts], dtype=float)
        rows[:, self._fallback] += FALLBACK_PRIOR
        rows += SMOOTHING
        return rows / rows.sum(axis=1, keepdims=True)
