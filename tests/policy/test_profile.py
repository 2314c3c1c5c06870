"""Profiles: frequency tables and cross-layer transitions fitted from traces or telemetry counts."""

from __future__ import annotations

import numpy as np
import pytest

from moe_l2_cache.policy import PolicyError, fit_profile, freq_from_counts, profile_from_counts
from moe_l2_cache.policy.profile import expert_counts, transition_counts


def test_fit_profile_counts_by_domain_and_layer():
    # 3 tokens, 2 layers, top-2, 4 experts.
    experts = np.array(
        [
            [[0, 1], [2, 3]],
            [[0, 2], [2, 3]],
            [[3, 1], [0, 1]],
        ]
    )
    profile = fit_profile(experts, ["a", "a", "b"], n_expert=4)
    np.testing.assert_allclose(profile.global_freq[0], [2 / 6, 2 / 6, 1 / 6, 1 / 6])
    np.testing.assert_allclose(profile.domain_freq["a"][0], [0.5, 0.25, 0.25, 0.0])
    np.testing.assert_allclose(profile.domain_freq["b"][1], [0.5, 0.5, 0.0, 0.0])
    assert profile.top_k == 2
    # P(b at layer 1 | a at layer 0): expert 0 at layer 0 (tokens 0, 1) is always followed by 2 and 3.
    np.testing.assert_allclose(profile.transitions[0, 0], [0.0, 0.0, 1.0, 1.0])
    # Expert 1 (tokens 0 and 2): followed by 2, 3 once and 0, 1 once.
    np.testing.assert_allclose(profile.transitions[0, 1], [0.5, 0.5, 0.5, 0.5])
    # An expert never seen at layer 0 predicts nothing.
    assert transition_counts(experts, 4)[0, 2].sum() == 2
    assert expert_counts(experts, 4).sum() == experts.size


def test_fit_profile_rejects_bad_shapes():
    with pytest.raises(PolicyError, match="token, layer, slot"):
        fit_profile(np.zeros((3, 2)), ["a"] * 3, 4)
    with pytest.raises(PolicyError, match="one domain per token"):
        fit_profile(np.zeros((3, 2, 1), dtype=int), ["a"] * 2, 4)


def test_profile_from_telemetry_counts():
    # The shape GET /moe/routing gives: {domain: {"<layer>": {"<expert>": count}}}.
    counts = {
        "math": {"0": {"1": 3, "2": 1}, "1": {"0": 4}},
        "code": {"0": {"3": 4}, "9": {"0": 7}},  # layer 9 does not exist in this model: ignored
    }
    profile = profile_from_counts(counts, n_layer=2, n_expert=4, top_k=1)
    np.testing.assert_allclose(profile.domain_freq["math"][0], [0, 0.75, 0.25, 0])
    np.testing.assert_allclose(profile.domain_freq["code"][1], [0, 0, 0, 0])  # no counts: all zero
    np.testing.assert_allclose(profile.global_freq[0], [0, 3 / 8, 1 / 8, 4 / 8])
    assert profile.transitions is None
    np.testing.assert_allclose(freq_from_counts(counts["math"], 2, 4)[1], [1, 0, 0, 0])
