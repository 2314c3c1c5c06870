"""Admission (a miss is computed but kept only if it outranks its victim) and threshold prefetch
(only confident cross-layer predictions are loaded), on hand-made streams whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from moe_l2_cache.policy import (
    LFRU,
    CrossLayerPrefetch,
    DomainPriorHybrid,
    PolicyError,
    fit_profile,
    make_policy,
)

from .streams import one_layer, random_stream, replay_hits

# -- admission ------------------------------------------------------------------------------------


def test_admission_keeps_a_frequent_expert_against_a_one_off():
    accesses = [[1], [2], [1], [2], [1], [2], [7], [1], [2]]
    admit = LFRU(n_layer=1, n_expert=8, capacity=2, half_life=4.0, admission=True)
    # 7 is computed (a miss, so a load) but not kept: its one use does not beat 1's three or 2's three.
    assert one_layer(admit, accesses) == [0, 0, 1, 1, 1, 1, 0, 1, 1]
    assert admit.resident(0) == {1, 2}
    assert admit.loads == 3  # 1, 2 and the bypassed 7
    plain = LFRU(n_layer=1, n_expert=8, capacity=2, half_life=4.0)
    # Without admission 7 displaces 1 (the older of the two), which then misses.
    assert one_layer(plain, accesses) == [0, 0, 1, 1, 1, 1, 0, 0, 1]
    assert plain.loads == 4


def test_admission_remembers_a_bypassed_expert_until_it_earns_its_slot():
    # 2's uses are counted while it is not resident (the ghost history), so its third use outranks
    # 1's three older ones and it comes in.
    admit = LFRU(n_layer=1, n_expert=4, capacity=1, half_life=100.0, admission=True)
    assert one_layer(admit, [[1], [1], [1], [2], [2], [2], [2]]) == [0, 1, 1, 0, 0, 0, 1]
    assert admit.resident(0) == {2}


def test_admission_fills_free_slots_and_a_margin_favours_the_resident():
    admit = LFRU(n_layer=1, n_expert=8, capacity=3, half_life=8.0, admission=True, admit_margin=5.0)
    one_layer(admit, [[1], [2], [3]])
    assert admit.resident(0) == {1, 2, 3}  # room for all: nothing to compare against
    one_layer(admit, [[4], [4], [4]])  # three uses of 4 are not 5 activations better than 1's one
    assert admit.resident(0) == {1, 2, 3}
    eager = LFRU(n_layer=1, n_expert=8, capacity=3, half_life=8.0, admission=True, admit_margin=-5.0)
    one_layer(eager, [[1], [1], [1], [2], [3], [4]])
    assert 4 in eager.resident(0)  # a negative margin lets a newcomer displace the thrice-used 1


def test_hybrid_admission_weighs_the_domain_prior():
    prior = {"code": np.array([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])}
    hybrid = DomainPriorHybrid(1, 6, 1, None, prior, half_life=4.0, prior_weight=1.0, top_k=1, admission=True)
    assert hybrid.name == "hybrid_admit"
    hybrid.on_domain("code")
    one_layer(hybrid, [[5], [1], [2]])
    # 1 and 2 are streamed in and computed, but the code prior keeps 5 over each of them.
    assert hybrid.resident(0) == {5}
    assert hybrid.loads == 3


def test_hybrid_admit_by_name_admits_selectively():
    stream = random_stream(300, n_layer=2, n_expert=12, k=2, seed=7)
    admit = make_policy("hybrid_admit", 2, 12, 4, admit_margin=0.0)
    plain = make_policy("hybrid", 2, 12, 4)
    admit.on_domain(None)
    plain.on_domain(None)
    assert replay_hits(admit, stream) != replay_hits(plain, stream)
    # Every miss is a load in both: admission changes what is kept, never what a miss costs.
    assert admit.loads == admit.accesses - admit.hits
    assert plain.loads == plain.accesses - plain.hits


# -- threshold prefetch ---------------------------------------------------------------------------


def two_layer_table(n_expert: int, probs: dict[tuple[int, int], float]) -> np.ndarray:
    table = np.zeros((1, n_expert, n_expert))
    for (a, b), p in probs.items():
        table[0, a, b] = p
    return table


def test_threshold_prefetch_loads_only_confident_predictions():
    table = two_layer_table(6, {(0, 2): 0.9, (0, 3): 0.2, (1, 4): 0.6})
    # One expert per token of 6: chance is 1/6, so a lift of 3 asks for P > 0.5 (with two, P > 1).
    policy = CrossLayerPrefetch(LFRU(2, 6, 3), table, min_lift=3.0)
    policy.access(0, [0])
    assert policy.resident(1) == {2}  # 0.9 clears 0.5; 3 (0.2) is not loaded
    assert policy.stats.loads == 1
    assert policy.access(1, [2]) == 1
    # With 0 and 1 at layer 0, each candidate's confidence is the mean over both: 2 has 0.45, 4 has 0.3,
    # and with two experts per token chance is 2/6, so a lift of 1.2 asks for P > 0.4: only 2 clears it.
    policy.access(0, [0, 1])
    assert policy.stats.loads == 1
    policy.min_lift = 1.2
    policy.access(0, [0, 1])
    assert policy.resident(1) >= {2} and 4 not in policy.resident(1)
    assert policy.loads == 2 + 1  # the misses 0 (then 1) at layer 0, plus one prefetch (2 was resident)


def test_threshold_prefetch_above_every_prediction_loads_nothing():
    table = two_layer_table(6, {(0, 2): 0.9})
    policy = CrossLayerPrefetch(LFRU(2, 6, 3), table, min_lift=5.7)  # P > 0.95
    policy.access(0, [0])
    assert policy.resident(1) == set()
    assert policy.stats.loads == 0 and policy.predict(0, [0]) == []


def test_threshold_prefetch_uses_the_requests_domain_table():
    glob = two_layer_table(6, {(0, 2): 0.9})
    code = two_layer_table(6, {(0, 3): 0.9})
    policy = CrossLayerPrefetch(LFRU(2, 6, 3), glob, min_lift=3.0, domain_transitions={"code": code})
    policy.on_domain("code")
    policy.access(0, [0])
    assert policy.resident(1) == {3}
    for domain in ("law", None):  # no table of its own, or no domain: the global table
        policy.reset()
        policy.on_domain(domain)
        policy.access(0, [0])
        assert policy.resident(1) == {2}


def test_threshold_prefetch_without_tables_is_the_hybrid():
    # The cache-manager's pool has no per-token traces: the policy must run, and be the hybrid.
    stream = random_stream(200, n_layer=3, n_expert=10, k=2, seed=8)
    policy = make_policy("hybrid_threshold_prefetch", 3, 10, 4, top_k=2)
    hybrid = make_policy("hybrid", 3, 10, 4, top_k=2)
    assert policy.name == "hybrid"  # the name says what runs
    assert replay_hits(policy, stream) == replay_hits(hybrid, stream)
    assert policy.loads == hybrid.loads


def test_threshold_prefetch_passes_priors_to_its_hybrid():
    # The pool hands priors with policy.set_priors(global_freq, domain_freq).
    policy = make_policy("hybrid_threshold_prefetch", 1, 4, 1, fill_weight=1.0, top_k=1)
    policy.set_priors(None, {"math": np.array([[0.0, 0.0, 1.0, 0.0]])})
    policy.on_domain("math")
    assert policy.resident(0) == {2}


def test_lift_must_be_reachable_and_tables_must_fit():
    with pytest.raises(PolicyError, match="min_lift"):
        CrossLayerPrefetch(LFRU(2, 4, 2), np.zeros((1, 4, 4)), min_lift=4.0)
    with pytest.raises(PolicyError, match="domain_transitions"):
        CrossLayerPrefetch(LFRU(2, 4, 2), None, domain_transitions={"x": np.zeros((1, 5, 5))})


def test_fit_profile_learns_one_transition_table_per_domain():
    # Domain a: 0 at layer 0 is followed by 1; domain b: by 2. The global table mixes them.
    a = np.array([[[0], [1]]] * 3)
    b = np.array([[[0], [2]]])
    profile = fit_profile(np.concatenate([a, b]), ["a"] * 3 + ["b"], n_expert=3)
    assert profile.domain_transitions["a"][0, 0].tolist() == [0.0, 1.0, 0.0]
    assert profile.domain_transitions["b"][0, 0].tolist() == [0.0, 0.0, 1.0]
    assert profile.transitions is not None
    np.testing.assert_allclose(profile.transitions[0, 0], [0.0, 0.75, 0.25])
    assert set(profile.as_kwargs()["domain_transitions"]) == {"a", "b"}
