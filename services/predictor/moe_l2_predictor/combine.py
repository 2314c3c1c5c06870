"""The hybrid: a calibrated log-linear combination of the tiers' probabilities.

score(domain) = sum over tiers of w_tier * log p_tier(domain) + b_domain, softmaxed. One weight
per tier and one bias per domain, fitted by maximum likelihood on out-of-fold predictions of the
training examples (never on the held-out set): few parameters, so it calibrates rather than
memorizes, and the weights say how much each tier is trusted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize

EPS = 1e-4
BIAS_L2 = 0.01


def _stack(probas: list[np.ndarray]) -> np.ndarray:
    """[n, k, tiers] of log probabilities."""
    return np.stack([np.log(np.clip(p, EPS, 1.0)) for p in probas], axis=2)


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


@dataclass(frozen=True)
class Combiner:
    tiers: tuple[str, ...]
    weights: tuple[float, ...]
    bias: tuple[float, ...]

    def combine(self, probas: list[np.ndarray]) -> np.ndarray:
        """[n, k] probabilities from one [n, k] array per tier (in `tiers` order)."""
        x = _stack(probas)
        return _softmax(x @ np.array(self.weights) + np.array(self.bias))


def fit_combiner(tiers: tuple[str, ...], probas: list[np.ndarray], labels: np.ndarray) -> Combiner:
    x = _stack(probas)
    n, k, t = x.shape
    onehot = np.zeros((n, k))
    onehot[np.arange(n), labels] = 1.0

    def loss(params: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = params[:t], params[t:]
        p = _softmax(x @ w + b)
        nll = -np.log(np.clip(p[np.arange(n), labels], 1e-12, 1.0)).mean() + BIAS_L2 * (b @ b)
        g = (p - onehot) / n
        grad_w = np.einsum("nk,nkt->t", g, x)
        grad_b = g.sum(axis=0) + 2 * BIAS_L2 * b
        return float(nll), np.concatenate([grad_w, grad_b])

    start = np.concatenate([np.ones(t), np.zeros(k)])
    bounds = [(0.0, None)] * t + [(None, None)] * k  # a tier can be ignored, never inverted
    result = minimize(loss, start, jac=True, method="L-BFGS-B", bounds=bounds)
    params = result.x
    return Combiner(tiers=tiers, weights=tuple(map(float, params[:t])), bias=tuple(map(float, params[t:])))
