"""The replay of llama-server's expert-cache access log (moe_l2_cache.policy.replay), and the rules the
engine's port relies on: ties keep the lower expert id, and LFRU's decay is C's pow()."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moe_l2_cache.policy import make_policy
from moe_l2_cache.policy.base import PolicyError, top_c_mask
from moe_l2_cache.policy.online import pow2
from moe_l2_cache.policy.profile import fit_profile
from moe_l2_cache.policy.replay import Access, DomainTables, read_access_log, replay_accesses
from tests.policy.streams import random_stream


def test_ties_keep_the_lower_expert_id():
    priority = np.array([[1.0, 3.0, 1.0, 1.0, 3.0, 0.0]])
    keep = top_c_mask(priority, 3, np.ones_like(priority, dtype=bool))
    assert np.flatnonzero(keep[0]).tolist() == [0, 1, 4]


def test_lru_evicts_the_lower_id_last_among_equally_old_experts():
    lru = make_policy("lru", 1, 8, 3)
    lru.access(0, [5, 6, 7])  # all three last used at the same time
    lru.access(0, [1])  # one of them must leave: the highest id
    assert lru.resident(0) == {1, 5, 6}


def test_pow2_is_c_pow():
    x = np.array([0.0, 0.125, 1.0, 7.875, -3.5, 64.0])
    assert pow2(x).tolist() == [2.0 ** float(v) for v in x]
    assert pow2(x.reshape(2, 3)).shape == (2, 3)


def test_the_log_is_read_and_bypassed_accesses_are_skipped(tmp_path: Path):
    log = tmp_path / "access.log"
    log.write_text("1 0 0 - 1 2\n1 1 1 - 0 1 2 3 4\n2 0 0 code 2 3\n")
    accesses = read_access_log(log)
    assert accesses[1] == Access(ubatch=1, layer=1, bypass=True, experts=(0, 1, 2, 3, 4))
    assert [a.domain for a in accesses] == [None, None, "code"]
    counts = replay_accesses(accesses, "lru", n_layer=2, n_expert=8, capacity=2, top_k=2)
    assert (counts.accesses, counts.hits, counts.loads, counts.bypass) == (4, 1, 3, 1)
    assert counts.misses == 3
    assert counts.hit_rate == pytest.approx(0.25)


@pytest.mark.parametrize("policy", ["lru", "hybrid", "default"])
def test_a_bypass_counts_its_resident_experts_and_leaves_residency_alone(tmp_path: Path, policy: str):
    """Patch 0017: a micro-batch over the slots takes its resident experts from their slots. The replay
    counts them as the engine does (bypass_hits), and the bypass changes nothing after it."""
    log = tmp_path / "access.log"
    # layer 0 holds {1, 2}; the prompt uses 1, 2, 3, 5 (two resident); then 1 and 2 hit again
    log.write_text("1 0 0 - 1 2\n2 0 1 - 1 2 3 5\n3 0 1 - 0 4 6 7\n4 0 0 - 1 2\n")
    counts = replay_accesses(read_access_log(log), policy, n_layer=1, n_expert=8, capacity=2, top_k=2)
    assert (counts.bypass, counts.bypass_hits) == (2, 2)
    assert (counts.accesses, counts.hits, counts.loads) == (4, 2, 2)


def test_a_preload_brings_its_experts_in_as_a_prefetch_and_keeps_the_recent_ones(tmp_path: Path):
    log = tmp_path / "access.log"
    # 4 slots: 1 2 3 then 4 are used; a preload of 7 and 6 evicts two of the least recently used 1 2 3 (used
    # together: ties keep the lower id, so 2 and 3 leave); the most recent (4) stays
    log.write_text("1 0 0 - 1 2 3\n2 0 0 - 4\n3 0 P - 7 6\n3 0 0 - 4 6\n4 0 P - 4 5\n")
    accesses = read_access_log(log)
    assert accesses[2] == Access(ubatch=3, layer=0, bypass=False, experts=(7, 6), preload=True)
    counts = replay_accesses(accesses, "lru", n_layer=1, n_expert=8, capacity=4, top_k=1)
    # accesses 1 2 3 | 4 | 4 6 (both resident after the preload: 2 hits); preloads 7 6, then only 5 (4 is in)
    assert (counts.accesses, counts.hits, counts.loads, counts.preload) == (6, 2, 4, 3)
    lru = make_policy("lru", 1, 8, 4)
    for experts in ([1, 2, 3], [4]):
        lru.access(0, experts)
    assert lru.preload(0, [7, 6]) == 2 and lru.resident(0) == {1, 4, 6, 7}


@pytest.mark.parametrize(
    "line", ["1 0 0 -", "1 0 2 - 3", "a b c d e", "1 -1 0 - 3", "1 0 0 - x", "1 0 P -", "1 x P - 3"]
)
def test_a_malformed_line_is_named(tmp_path: Path, line: str):
    log = tmp_path / "access.log"
    log.write_text(f"1 0 0 - 1\n{line}\n")
    with pytest.raises(PolicyError, match=r"access\.log:2"):
        read_access_log(log)


def test_unknown_engine_policy_and_a_layer_outside_the_cache_are_errors():
    with pytest.raises(PolicyError, match="unknown engine policy"):
        replay_accesses([], "lfu", 1, 8, 2, 2)
    with pytest.raises(PolicyError, match="layer 3"):
        replay_accesses([Access(1, 3, False, (1,))], "lru", 2, 8, 2, 1)


@pytest.mark.parametrize("policy", ["lru", "hybrid", "default"])
def test_replay_of_a_token_stream_equals_the_policy_fed_directly(policy: str):
    stream = random_stream(300, 3, 16, 4, seed=7)
    accesses = [
        Access(t, layer, False, tuple(sorted(stream[t, layer].tolist()))) for t in range(300) for layer in range(3)
    ]
    counts = replay_accesses(accesses, policy, n_layer=3, n_expert=16, capacity=6, top_k=4)
    direct = make_policy({"default": "hybrid_threshold_prefetch"}.get(policy, policy), 3, 16, 6, top_k=4)
    hits = sum(direct.access(a.layer, a.experts) for a in accesses)
    assert (counts.hits, counts.loads) == (hits, direct.loads)  # type: ignore[attr-defined]
    assert counts.accesses == 300 * 3 * 4


def routed_stream(n_tokens: int, seed: int, n_layer: int = 3, n_expert: int = 16, k: int = 4) -> np.ndarray:
    """[token, layer, k]: most tokens follow one of a few fixed routes through the layers (a route's
    experts at layer l predict its experts at l+1), the others are random."""
    rng = np.random.default_rng(seed)
    routes = np.array([[rng.choice(n_expert, size=k, replace=False) for _ in range(n_layer)] for _ in range(3)])
    out = np.empty((n_tokens, n_layer, k), dtype=np.int64)
    for t in range(n_tokens):
        if rng.random() < 0.8:
            out[t] = routes[rng.integers(len(routes))]
        else:
            out[t] = [rng.choice(n_expert, size=k, replace=False) for _ in range(n_layer)]
    return out


def test_replay_with_a_profile_prefetches_and_switches_domain_where_the_log_does():
    # two domains of different routes through the layers: their transition tables differ and clear the
    # prefetch's threshold
    a, b = routed_stream(200, seed=1), routed_stream(200, seed=2)
    fitted = fit_profile(np.concatenate([a, b]), ["a"] * 200 + ["b"] * 200, 16)
    assert fitted.transitions is not None
    profile = {
        None: DomainTables(transitions=fitted.transitions),
        "a": DomainTables(freq=fitted.domain_freq["a"], transitions=fitted.domain_transitions["a"]),
        "b": DomainTables(freq=fitted.domain_freq["b"]),  # no table of its own: the one of no domain
    }
    stream, domains = np.concatenate([a[:60], b[:60], a[60:100]]), ["a"] * 60 + ["b"] * 60 + ["a"] * 40
    accesses = [
        Access(t, layer, False, tuple(sorted(stream[t, layer].tolist())), domains[t])
        for t in range(len(stream))
        for layer in range(3)
    ]
    counts = replay_accesses(accesses, "default", n_layer=3, n_expert=16, capacity=6, top_k=4, profile=profile)

    direct = make_policy(
        "hybrid_threshold_prefetch",
        3,
        16,
        6,
        top_k=4,
        domain_freq={"a": fitted.domain_freq["a"], "b": fitted.domain_freq["b"]},
        transitions=fitted.transitions,
        domain_transitions={"a": fitted.domain_transitions["a"]},
    )
    hits = 0
    # a token's prefetch fills the layer the same token accesses next: all of it is the token's domain's
    per_domain: dict[str | None, list[int]] = {}
    for t, domain in enumerate(domains):
        direct.on_domain(domain)
        before = (direct.stats.loads, direct.stats.used)  # type: ignore[attr-defined]
        hits += sum(direct.access(layer, sorted(stream[t, layer].tolist())) for layer in range(3))
        mine = per_domain.setdefault(domain, [0, 0])
        mine[0] += direct.stats.loads - before[0]  # type: ignore[attr-defined]
        mine[1] += direct.stats.used - before[1]  # type: ignore[attr-defined]
    assert counts.hits == hits
    assert counts.prefetch_by_domain == {d: (p, u) for d, (p, u) in per_domain.items() if p or u}
    assert sum(p for p, _ in counts.prefetch_by_domain.values()) == counts.prefetch
    assert (counts.loads, counts.prefetch, counts.prefetch_used) == (
        direct.inner.loads,  # type: ignore[attr-defined]
        direct.stats.loads,  # type: ignore[attr-defined]
        direct.stats.used,  # type: ignore[attr-defined]
    )
    assert counts.prefetch > 0 and 0 < counts.prefetch_used <= counts.prefetch
    # and the profile matters: without it nothing is prefetched and the hits differ
    plain = replay_accesses(accesses, "default", n_layer=3, n_expert=16, capacity=6, top_k=4)
    assert plain.prefetch == 0 and plain.hits != counts.hits
