"""Small hand-made and seeded random routing streams for the policy tests."""

from __future__ import annotations

import numpy as np

from moe_l2_cache.policy import ExpertCachePolicy


def one_layer(policy: ExpertCachePolicy, accesses: list[list[int]], layer: int = 0) -> list[int]:
    """Feeds the accesses to one layer; hits per access."""
    return [policy.access(layer, experts) for experts in accesses]


def random_stream(
    n_tokens: int, n_layer: int, n_expert: int, k: int, seed: int, hot: int = 4, hot_share: float = 0.6
) -> np.ndarray:
    """[token, layer, k] distinct experts per token and layer, skewed towards `hot` experts per layer."""
    rng = np.random.default_rng(seed)
    p = np.r_[np.full(hot, hot_share / hot), np.full(n_expert - hot, (1 - hot_share) / (n_expert - hot))]
    out = np.empty((n_tokens, n_layer, k), dtype=np.int64)
    for t in range(n_tokens):
        for layer in range(n_layer):
            out[t, layer] = rng.choice(n_expert, size=k, replace=False, p=np.roll(p, layer))
    return out


def replay_hits(policy: ExpertCachePolicy, stream: np.ndarray) -> int:
    """Token by token, layer by layer, through the per-layer interface."""
    return sum(
        policy.access(layer, stream[t, layer].tolist()) for t in range(len(stream)) for layer in range(stream.shape[1])
    )
