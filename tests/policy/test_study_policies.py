"""The offline study's baselines (bench/study_policies.py): Belady's optimum and the static hot sets."""

from __future__ import annotations

import itertools
from functools import cache

import numpy as np
import pytest

from moe_l2_cache.policy import LFRU, LFU, LRU, ExpertCachePolicy, PolicyError, fit_profile
from tests.benches import load_bench

from .streams import one_layer, random_stream, replay_hits

study = load_bench("study_policies")
Belady, StaticDomain, StaticGlobal, belady_hits = (
    study.Belady,
    study.StaticDomain,
    study.StaticGlobal,
    study.belady_hits,
)


# -- static sets ----------------------------------------------------------------------------------


def test_static_global_keeps_the_top_c_and_streams_misses():
    freq = np.array([[0.1, 0.5, 0.05, 0.3, 0.05]])
    static = StaticGlobal(n_layer=1, n_expert=5, capacity=2, global_freq=freq)
    assert static.resident(0) == {1, 3}
    assert one_layer(static, [[1, 2], [0, 3], [2], [1, 3]]) == [1, 1, 0, 2]
    assert static.resident(0) == {1, 3}  # misses are computed from a streamed copy, never kept
    assert static.loads == 3


def test_static_domain_swaps_sets_on_a_domain_switch():
    glob = np.array([[0.4, 0.3, 0.2, 0.1]])
    by_domain = {"a": np.array([[0.0, 0.1, 0.5, 0.4]]), "b": np.array([[0.5, 0.0, 0.0, 0.5]])}
    static = StaticDomain(1, 4, 2, glob, by_domain)
    assert static.resident(0) == {0, 1}  # before any request: the global set
    static.on_domain("a")
    assert static.resident(0) == {2, 3}
    assert static.loads == 2
    assert static.access(0, [2, 0]) == 1
    static.on_domain("b")
    assert static.resident(0) == {0, 3}
    assert static.loads == 2 + 1 + 1  # the fill of a, a miss, and expert 0 coming in for b
    static.on_domain("unknown")
    assert static.resident(0) == {0, 1}
    static.on_domain(None)
    assert static.resident(0) == {0, 1}


# -- Belady ---------------------------------------------------------------------------------------


def test_belady_textbook_example():
    # The classic reference string with 3 frames: the optimum misses 7 times (hits 5).
    seq = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]
    future = np.array(seq).reshape(-1, 1, 1)
    for bypass in (True, False):
        assert belady_hits(future, n_expert=6, capacity=3, bypass=bypass).sum() == 5


def test_belady_bypass_keeps_what_comes_back_sooner():
    future = np.array([1, 2, 1]).reshape(-1, 1, 1)
    assert belady_hits(future, 3, 1, bypass=True).sum() == 1  # 2 is never kept, 1 stays for its return
    assert belady_hits(future, 3, 1, bypass=False).sum() == 0  # demand paging must take 2 in


def brute_force_best(seq: list[tuple[int, ...]], capacity: int) -> int:
    """Most hits any policy can get on one layer (misses may be kept or not), by exhaustive search."""

    @cache
    def best(t: int, resident: frozenset[int]) -> int:
        if t == len(seq):
            return 0
        ex = set(seq[t])
        hits = len(ex & resident)
        pool = sorted(resident | ex)
        options = [frozenset(c) for n in range(min(capacity, len(pool)) + 1) for c in itertools.combinations(pool, n)]
        return hits + max(best(t + 1, keep) for keep in options)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 2])
def test_belady_is_optimal_and_bounds_the_online_policies(seed, k):
    stream = random_stream(12, n_layer=1, n_expert=5, k=k, seed=seed, hot=2, hot_share=0.5)
    capacity = 2
    optimum = brute_force_best([tuple(int(e) for e in stream[t, 0]) for t in range(len(stream))], capacity)
    assert belady_hits(stream, 5, capacity).sum() == optimum
    for online in (LRU(1, 5, capacity), LFU(1, 5, capacity), LFRU(1, 5, capacity, 4.0)):
        assert replay_hits(online, stream) <= optimum


def test_belady_refuses_another_stream():
    future = np.array([[[1]], [[2]]])
    policy = Belady(1, 4, 1, future)
    policy.access(0, [1])
    with pytest.raises(PolicyError, match="exactly the stream"):
        policy.access(0, [3])


# -- by name ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(study.STUDY_FACTORIES))
def test_study_policies_are_made_by_name(name):
    stream = random_stream(60, n_layer=3, n_expert=8, k=2, seed=5)
    profile = fit_profile(stream, ["a"] * 30 + ["b"] * 30, 8)
    policy = study.make_study_policy(name, 3, 8, 3, **profile.as_kwargs(), future=stream)
    assert isinstance(policy, ExpertCachePolicy) and policy.name == name
    policy.on_domain("a")
    assert 0 <= replay_hits(policy, stream) <= stream.size


def test_study_falls_back_on_the_products_policies_and_says_what_is_missing():
    assert study.make_study_policy("lru", 2, 8, 2).name == "lru"
    with pytest.raises(PolicyError, match="global_freq"):
        study.make_study_policy("static_global", 2, 8, 2)
    with pytest.raises(PolicyError, match="future"):
        study.make_study_policy("belady", 2, 8, 2)
