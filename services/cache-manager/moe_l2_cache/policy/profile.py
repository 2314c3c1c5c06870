"""Profiles: what profiled policies learn from routing seen before (static tables, priors, transitions).

A profile is fitted on one set of traces and handed to `make_policy(..., **profile.as_kwargs())`.
The cache-manager, which has per-domain counts from the llama-server telemetry, builds the
frequency tables with `freq_from_counts`, and the transitions with `transitions_from_counts` from the
pair counts llama counts with LLAMA_ARG_MOE_TRANSITIONS (moe_l2_cache.transitions).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from moe_l2_cache.policy.base import FloatArray, PolicyError


@dataclass(frozen=True)
class RoutingProfile:
    """Learned tables, all shaped per MoE layer.

    global_freq: [n_layer, n_expert] share of activations per expert (each row sums to 1, or is 0).
    domain_freq: domain -> the same table for that domain's requests only.
    transitions: [n_layer - 1, n_expert, n_expert], P(expert b at layer l+1 | expert a at layer l)
        for the same token, or None when only counts were available.
    top_k: experts activated per token and layer.
    domain_transitions: domain -> the transitions of that domain's tokens only (empty without traces).
    """

    global_freq: FloatArray
    domain_freq: Mapping[str, FloatArray] = field(default_factory=dict)
    transitions: FloatArray | None = None
    top_k: int | None = None
    domain_transitions: Mapping[str, FloatArray] = field(default_factory=dict)

    @property
    def n_layer(self) -> int:
        return int(self.global_freq.shape[0])

    @property
    def n_expert(self) -> int:
        return int(self.global_freq.shape[1])

    def as_kwargs(self) -> dict[str, Any]:
        return {
            "global_freq": self.global_freq,
            "domain_freq": dict(self.domain_freq),
            "transitions": self.transitions,
            "top_k": self.top_k,
            "domain_transitions": dict(self.domain_transitions),
        }


def _normalise_rows(counts: FloatArray) -> FloatArray:
    totals = counts.sum(axis=-1, keepdims=True)
    return np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)


def expert_counts(experts: NDArray[np.integer], n_expert: int) -> FloatArray:
    """Activations per layer and expert of a trace `experts[token, layer, slot]`."""
    ex = np.asarray(experts, dtype=np.int64)
    n_layer = ex.shape[1]
    flat = (np.arange(n_layer)[None, :, None] * n_expert + ex).ravel()
    return np.bincount(flat, minlength=n_layer * n_expert).reshape(n_layer, n_expert).astype(np.float64)


def transition_counts(experts: NDArray[np.integer], n_expert: int) -> FloatArray:
    """Counts of (expert a at layer l, expert b at layer l+1) over the same token, all k x k pairs."""
    ex = np.asarray(experts, dtype=np.int64)
    n_layer = ex.shape[1]
    if n_layer < 2:
        return np.zeros((0, n_expert, n_expert))
    a = ex[:, :-1, :, None]  # [T, L-1, k, 1]
    b = ex[:, 1:, None, :]  # [T, L-1, 1, k]
    layer = np.arange(n_layer - 1)[None, :, None, None]
    flat = ((layer * n_expert + a) * n_expert + b).ravel()
    size = (n_layer - 1) * n_expert * n_expert
    return np.bincount(flat, minlength=size).reshape(n_layer - 1, n_expert, n_expert).astype(np.float64)


def fit_profile(
    experts: NDArray[np.integer],
    domains: Sequence[str],
    n_expert: int,
    *,
    with_transitions: bool = True,
) -> RoutingProfile:
    """Fits every table on a trace `experts[token, layer, slot]` whose token i has domain `domains[i]`."""
    ex = np.asarray(experts, dtype=np.int64)
    if ex.ndim != 3:
        raise PolicyError(f"experts must be [token, layer, slot], got shape {ex.shape}")
    labels = np.asarray(domains)
    if labels.shape != (ex.shape[0],):
        raise PolicyError(f"need one domain per token ({ex.shape[0]}), got {labels.shape}")
    domain_freq = {str(d): _normalise_rows(expert_counts(ex[labels == d], n_expert)) for d in np.unique(labels)}
    transitions = None
    domain_transitions: dict[str, FloatArray] = {}
    if with_transitions:
        transitions = _transitions(ex, n_expert)
        domain_transitions = {str(d): _transitions(ex[labels == d], n_expert) for d in np.unique(labels)}
    return RoutingProfile(
        _normalise_rows(expert_counts(ex, n_expert)), domain_freq, transitions, int(ex.shape[2]), domain_transitions
    )


def _transitions(ex: NDArray[np.int64], n_expert: int) -> FloatArray:
    return transitions_from_counts(transition_counts(ex, n_expert), int(ex.shape[2]))


def transitions_from_counts(counts: FloatArray, top_k: int) -> FloatArray:
    """P(b at l+1 | a at l) from `transition_counts` (or llama's, patch 0032): each activation of a at
    layer l co-occurs with k experts at l+1, so a row sums to k and an entry is the probability that b
    follows a; a row without counts is 0."""
    return _normalise_rows(np.asarray(counts, dtype=np.float64)) * top_k


def _counts_table(layer_counts: Mapping[str, Mapping[str, int]], n_layer: int, n_expert: int) -> FloatArray:
    counts = np.zeros((n_layer, n_expert))
    for layer, row in layer_counts.items():
        for expert, n in row.items():
            li, ei = int(layer), int(expert)
            if 0 <= li < n_layer and 0 <= ei < n_expert:
                counts[li, ei] += n
    return counts


def freq_from_counts(layer_counts: Mapping[str, Mapping[str, int]], n_layer: int, n_expert: int) -> FloatArray:
    """A frequency table from telemetry counts ({"<layer>": {"<expert>": n}}, as GET /moe/routing gives)."""
    return _normalise_rows(_counts_table(layer_counts, n_layer, n_expert))


def profile_from_counts(
    by_domain: Mapping[str, Mapping[str, Mapping[str, int]]], n_layer: int, n_expert: int, top_k: int | None = None
) -> RoutingProfile:
    """A profile without transitions from the telemetry's per-domain counts ({domain: {layer: {expert: n}}})."""
    tables = {d: _counts_table(c, n_layer, n_expert) for d, c in by_domain.items()}
    # The global table weighs each domain by how much of it was seen, like the traffic did.
    summed = sum(tables.values(), np.zeros((n_layer, n_expert)))
    return RoutingProfile(_normalise_rows(summed), {d: _normalise_rows(t) for d, t in tables.items()}, None, top_k)
