"""Each policy on small hand-made streams whose right answer is worked out by hand (or by brute force)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_l2_cache.policy import (
    LFRU,
    LFU,
    LRU,
    POLICY_NAMES,
    CrossLayerPrefetch,
    DomainPriorHybrid,
    ExpertCachePolicy,
    PolicyError,
    fit_profile,
    make_policy,
)

from .streams import one_layer, random_stream, replay_hits

# -- LRU ----------------------------------------------------------------------------------------


def test_lru_evicts_the_least_recently_used():
    lru = LRU(n_layer=1, n_expert=8, capacity=2)
    # 1 2 | 1 hit | 3 evicts 2 | 2 evicts 1 | 1 evicts 3
    assert one_layer(lru, [[1], [2], [1], [3], [2], [1]]) == [0, 0, 1, 0, 0, 0]
    assert lru.resident(0) == {1, 2}


def test_lru_keeps_all_experts_of_the_current_token():
    lru = LRU(n_layer=1, n_expert=8, capacity=3)
    assert one_layer(lru, [[1, 2], [3], [1, 4]]) == [0, 0, 1]
    # 4 came in and 2 (last used before 3) left, not 1 (used right now).
    assert lru.resident(0) == {1, 3, 4}


def test_layers_are_separate_caches():
    lru = LRU(n_layer=2, n_expert=8, capacity=1)
    lru.access(0, [5])
    assert lru.access(1, [5]) == 0
    assert lru.access(0, [5]) == 1
    assert lru.resident(0) == {5} and lru.resident(1) == {5}


def test_counters_and_reset():
    lru = LRU(n_layer=1, n_expert=8, capacity=2)
    one_layer(lru, [[1, 2], [1, 3]])
    assert (lru.accesses, lru.hits, lru.loads) == (4, 1, 3)
    lru.reset()
    assert (lru.accesses, lru.hits, lru.loads) == (0, 0, 0)
    assert lru.resident(0) == set()


# -- LFU and LFRU ---------------------------------------------------------------------------------

FREQ_STREAM = [[1], [1], [2], [3], [2], [3]]


def test_lfu_evicts_the_least_frequently_used():
    lfu = LFU(n_layer=1, n_expert=8, capacity=2)
    # 3 evicts 2 (1 use) not 1 (2 uses); 2 comes back evicting 3; then 3 (1 use) vs 1 (2) vs 2 (2 uses):
    # a tie between 1 and 2 goes to recency, so 1 (older) leaves.
    assert one_layer(lfu, FREQ_STREAM) == [0, 1, 0, 0, 0, 0]
    assert lfu.resident(0) == {2, 3}


def test_lru_on_the_same_stream_differs():
    lru = LRU(n_layer=1, n_expert=8, capacity=2)
    assert one_layer(lru, FREQ_STREAM) == [0, 1, 0, 0, 1, 1]
    assert lru.resident(0) == {2, 3}


def test_lfru_with_a_short_half_life_is_lru():
    # Halving twice per token, the latest use outweighs all earlier ones together (1 > 1/4 + 1/16 + ...).
    # One expert per token, so no two experts are ever used at the same time (a tie either may break its
    # own way).
    stream = random_stream(300, n_layer=3, n_expert=12, k=1, seed=4)
    assert replay_hits(LFRU(3, 12, 5, 0.5), stream) == replay_hits(LRU(3, 12, 5), stream)


def test_lfru_with_an_endless_half_life_counts_like_lfu():
    stream = random_stream(300, n_layer=3, n_expert=12, k=3, seed=4)
    lfru, lfu = LFRU(3, 12, 5, 1e9), LFU(3, 12, 5)
    hits_lfru, hits_lfu = replay_hits(lfru, stream), replay_hits(lfu, stream)
    counts = np.zeros((3, 12))
    for layer in range(3):
        np.add.at(counts[layer], stream[:, layer].ravel(), 1)
    np.testing.assert_allclose(lfru._decayed(np.arange(3)), counts, rtol=1e-5)
    # Equal counts are broken by recency in both, but LFRU weighs all past uses, LFU only the last one.
    assert abs(hits_lfru - hits_lfu) <= 0.02 * hits_lfu


def test_lfru_scores_are_decayed_counts():
    h = 2.0
    lfru = LFRU(n_layer=1, n_expert=4, capacity=4, half_life=h)
    one_layer(lfru, [[0], [0], [1], [2]])  # at time 4: expert 0 used at 1 and 2, expert 1 at 3, expert 2 at 4
    expected = [2 ** (-3 / h) + 2 ** (-2 / h), 2 ** (-1 / h), 1.0, 0.0]
    np.testing.assert_allclose(lfru._decayed(np.array([0]))[0], expected)


def test_lfru_between_lru_and_lfu():
    # 1 used four times, then 2, then 3 arrives: LRU evicts 1 (older), LFRU with a short memory still
    # values 1's four recent uses (score 1.28) over 2's one (0.71) and evicts 2.
    accesses = [[1], [1], [1], [1], [2], [3]]
    lfru = LFRU(n_layer=1, n_expert=8, capacity=2, half_life=2.0)
    one_layer(lfru, accesses)
    lru = LRU(n_layer=1, n_expert=8, capacity=2)
    one_layer(lru, accesses)
    assert lfru.resident(0) == {1, 3}
    assert lru.resident(0) == {2, 3}


def reference_lfru_hits(stream: np.ndarray, capacity: int, half_life: float) -> int:
    """LFRU written the slow obvious way: decay every score each token."""
    n_layer, n_expert = stream.shape[1], int(stream.max()) + 1
    score = np.zeros((n_layer, n_expert))
    resident = np.zeros((n_layer, n_expert), dtype=bool)
    hits = 0
    for token in stream:
        score *= 2 ** (-1 / half_life)
        for layer, ex in enumerate(token):
            hits += int(resident[layer, ex].sum())
            score[layer, ex] += 1
            candidates = resident[layer].copy()
            candidates[ex] = True
            priority = np.where(candidates, score[layer], -np.inf)
            priority[ex] = np.inf
            keep = np.argsort(-priority, kind="stable")[:capacity]
            resident[layer] = False
            resident[layer, keep] = True
            resident[layer] &= candidates
    return hits


def test_lfru_matches_the_obvious_implementation_over_long_streams():
    # 3000 tokens at a half-life of 4 forces the score renormalisation several times.
    stream = random_stream(3000, n_layer=2, n_expert=12, k=3, seed=1)
    lfru = LFRU(2, 12, 5, half_life=4.0)
    for token in stream:
        lfru.access_token(token)
    # Ties among exactly equal scores may fall either way; they are rare with decayed scores.
    assert abs(lfru.hits - reference_lfru_hits(stream, 5, 4.0)) <= 3


# -- the domain-prior hybrid ----------------------------------------------------------------------


@pytest.mark.parametrize("domain", ["unknown", None])
def test_hybrid_without_a_prior_for_the_domain_is_lfru(domain):
    stream = random_stream(400, n_layer=3, n_expert=12, k=3, seed=2)
    prior = {"known": np.full((3, 12), 1 / 12) + np.eye(12)[:3]}
    hybrid = DomainPriorHybrid(3, 12, 5, np.full((3, 12), 1 / 12), prior, half_life=8.0, prior_weight=3.0)
    hybrid.on_domain(domain)
    assert replay_hits(hybrid, stream) == replay_hits(LFRU(3, 12, 5, 8.0), stream)


def test_hybrid_prior_keeps_the_domains_experts():
    prior = {"code": np.array([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])}
    hybrid = DomainPriorHybrid(1, 6, 2, None, prior, half_life=4.0, prior_weight=1.0, top_k=1)
    hybrid.on_domain("code")
    one_layer(hybrid, [[5], [1], [2]])
    # LRU would hold {1, 2}; the code prior keeps 5, which a code request will likely use again.
    assert hybrid.resident(0) == {5, 2}
    assert hybrid.access(0, [5]) == 1


def test_hybrid_fill_loads_the_prior_then_the_online_part_takes_over():
    prior = {"a": np.array([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0]]), "b": np.array([[0.0, 0.0, 0.0, 0.0, 0.5, 0.5]])}
    hybrid = DomainPriorHybrid(1, 6, 2, None, prior, half_life=2.0, prior_weight=0.0, fill_weight=4.0, top_k=1)
    hybrid.on_domain("a")
    assert hybrid.resident(0) == {0, 1}
    assert hybrid.loads == 2
    assert hybrid.access(0, [0]) == 1
    hybrid.on_domain("b")  # boosts of 4 x 0.5 x 2 / ln 2 = 5.8 outrank expert 0 (its decayed boost + 1 use = 5.1)
    assert hybrid.resident(0) == {4, 5}
    assert hybrid.loads == 4
    one_layer(hybrid, [[2], [3]])
    assert len(hybrid.resident(0) & {4, 5}) == 1  # the prior still holds the other slot
    # The boost decays: experts the request keeps using win every slot back.
    one_layer(hybrid, [[2], [3]] * 4)
    assert hybrid.resident(0) == {2, 3}
    hybrid.on_domain("b")  # same domain: no refill
    assert hybrid.resident(0) == {2, 3}


def test_hybrid_set_priors_rejects_a_bad_shape():
    hybrid = DomainPriorHybrid(2, 4, 2)
    with pytest.raises(PolicyError, match="shape"):
        hybrid.set_priors(None, {"x": np.zeros((2, 5))})


# -- cross-layer prefetch -------------------------------------------------------------------------


def chain_transitions(n_expert: int, mapping: dict[int, int]) -> np.ndarray:
    """A two-layer table: expert a at layer 0 is followed by mapping[a] at layer 1."""
    table = np.zeros((1, n_expert, n_expert))
    for a, b in mapping.items():
        table[0, a, b] = 1.0
    return table


def test_prefetch_loads_the_next_layers_predicted_experts():
    policy = CrossLayerPrefetch(LRU(2, 4, 1), chain_transitions(4, {0: 2, 1: 3}), n_predict=1)
    assert policy.access(0, [0]) == 0
    assert policy.resident(1) == {2}  # loaded ahead of layer 1
    assert policy.access(1, [2]) == 1
    assert policy.access(0, [1]) == 0
    assert policy.access(1, [2]) == 0  # predicted 3, wrong
    s = policy.stats
    assert (s.predicted, s.correct, s.actual) == (2, 1, 2)
    assert (s.loads, s.used, s.wasted) == (2, 1, 1)
    assert s.precision == s.recall == 0.5
    # Misses: 0, 1 and 2 at the end; plus two prefetch loads.
    assert policy.loads == 3 + 2


def test_a_wrong_prefetch_is_the_first_to_leave():
    inner = LRU(2, 8, 3)
    policy = CrossLayerPrefetch(inner, chain_transitions(8, {0: 7}), n_predict=1)
    for e in (1, 2, 3):
        policy.access(1, [e])
    policy.access(0, [0])  # prefetches 7 into layer 1, evicting 1 (the oldest)
    assert policy.resident(1) == {2, 3, 7}
    policy.access(1, [4])  # 7 was not used: it leaves before 2 and 3 do
    assert policy.resident(1) == {2, 3, 4}


def test_prefetch_token_at_a_time_equals_layer_by_layer():
    stream = random_stream(200, n_layer=4, n_expert=10, k=2, seed=3)
    profile = fit_profile(stream[:100], ["x"] * 100, 10)
    by_token = CrossLayerPrefetch(LRU(4, 10, 4), profile.transitions)
    by_layer = CrossLayerPrefetch(LRU(4, 10, 4), profile.transitions)
    hits_token = sum(int(by_token.access_token(stream[t]).sum()) for t in range(100, 200))
    assert hits_token == replay_hits(by_layer, stream[100:])
    assert by_token.stats == by_layer.stats
    assert by_token.loads == by_layer.loads


# -- the registry ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_profile():
    stream = random_stream(60, n_layer=3, n_expert=8, k=2, seed=5)
    return stream, fit_profile(stream, ["a"] * 30 + ["b"] * 30, 8)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_is_made_by_name_and_follows_the_interface(name, small_profile):
    stream, profile = small_profile
    policy = make_policy(name, 3, 8, 3, **profile.as_kwargs())
    assert isinstance(policy, ExpertCachePolicy)
    assert policy.name == name
    policy.on_domain("a")
    total = replay_hits(policy, stream)
    assert 0 <= total <= stream.size
    for layer in range(3):
        assert len(policy.resident(layer)) <= 3
    policy.reset()
    assert all(policy.resident(layer) <= set(range(8)) for layer in range(3))


def test_unknown_policy_and_missing_profile_are_clear_errors():
    with pytest.raises(PolicyError, match="unknown cache policy 'mru'"):
        make_policy("mru", 2, 8, 2)
    with pytest.raises(PolicyError, match="transitions"):
        make_policy("xlayer_prefetch", 2, 8, 2)
    for offline in ("belady", "static_global", "static_domain"):  # the study's, not the product's
        with pytest.raises(PolicyError, match="unknown cache policy"):
            make_policy(offline, 2, 8, 2)


def test_the_default_runs_without_a_profile():
    # The cache-manager starts before it has learned any table.
    from moe_l2_cache.policy import DEFAULT_POLICY

    policy = make_policy(DEFAULT_POLICY, 2, 8, 2)
    policy.on_domain("codegen")
    assert one_layer(policy, [[1, 2], [1, 3]]) == [0, 1]


def test_bad_accesses_are_rejected():
    lru = LRU(2, 8, 2)
    with pytest.raises(PolicyError):
        lru.access(2, [1])
    with pytest.raises(PolicyError):
        lru.access(0, [8])


def test_update_priors_reaches_the_hybrid_alone_or_under_prefetch():
    from moe_l2_cache.policy import RoutingProfile, update_priors

    profile = RoutingProfile(np.full((2, 4), 0.25), {"code": np.array([[0.0, 0.0, 0.0, 1.0]] * 2)})
    for name in ("hybrid", "hybrid_prefetch"):
        policy = make_policy(name, 2, 4, 1, transitions=np.zeros((1, 4, 4)), fill_weight=1.0, top_k=1)
        assert update_priors(policy, profile)
        policy.on_domain("code")
        assert policy.resident(0) == {3}
    assert not update_priors(make_policy("lru", 2, 4, 1), profile)


def test_hybrid_set_priors_takes_what_the_cache_manager_hands_it():
    # The pool calls policy.set_priors(global_freq, domain_freq) with a profile_from_counts result.
    from moe_l2_cache.policy import profile_from_counts

    profile = profile_from_counts({"math": {"0": {"2": 5}}}, n_layer=1, n_expert=4, top_k=1)
    policy = make_policy("hybrid", 1, 4, 1, fill_weight=1.0, top_k=1)
    policy.set_priors(profile.global_freq, profile.domain_freq)
    policy.on_domain("math")
    assert policy.resident(0) == {2}
