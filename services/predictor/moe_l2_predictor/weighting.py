"""Per-prompt probabilities from per-text ones: a chat's segments averaged by weight, then language rules."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from moe_l2_predictor.prompt import Prompt
from moe_l2_predictor.rules import LanguageRules

TextProba = Callable[[list[str]], np.ndarray]  # texts -> [n, k] probabilities in taxonomy order


def prompt_proba(prompts: Sequence[Prompt], text_proba: TextProba, rules: LanguageRules) -> np.ndarray:
    """[len(prompts), k]: every segment of every prompt scored in one call, then combined per prompt."""
    texts = [text for p in prompts for text, _ in p.segments]
    if not texts:
        raise ValueError("no prompts")
    per_text = text_proba(texts)
    out = np.empty((len(prompts), per_text.shape[1]))
    row = 0
    for i, p in enumerate(prompts):
        n = len(p.segments)
        weights = np.array([w for _, w in p.segments])
        out[i] = weights @ per_text[row : row + n] / weights.sum()
        row += n
    return rules.apply(out, [p.lang for p in prompts])


def columns_in_order(proba: np.ndarray, classes: Sequence[int], k: int) -> np.ndarray:
    """A classifier's probabilities (columns in `classes` order) as [n, k] in taxonomy order."""
    if list(classes) == list(range(k)):
        return proba
    out = np.zeros((proba.shape[0], k))
    out[:, list(classes)] = proba
    return out
