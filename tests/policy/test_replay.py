"""The replay of llama-server's expert-cache access log (moe_l2_cache.policy.replay), and the rules the
engine's port relies on: ties keep the lower expert id, and LFRU's decay is C's pow()."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moe_l2_cache.policy import make_policy
from moe_l2_cache.policy.base import PolicyError, top_c_mask
from moe_l2_cache.policy.online import pow2
from moe_l2_cache.policy.replay import Access, read_access_log, replay_accesses
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
    log.write_text("1 0 0 1 2\n1 1 1 0 1 2 3 4\n2 0 0 2 3\n")
    accesses = read_access_log(log)
    assert accesses[1] == Access(ubatch=1, layer=1, bypass=True, experts=(0, 1, 2, 3, 4))
    counts = replay_accesses(accesses, "lru", n_layer=2, n_expert=8, capacity=2, top_k=2)
    assert (counts.accesses, counts.hits, counts.loads, counts.bypass) == (4, 1, 3, 1)
    assert counts.misses == 3
    assert counts.hit_rate == pytest.approx(0.25)


@pytest.mark.parametrize("line", ["1 0 0", "1 0 2 3", "a b c d", "1 -1 0 3"])
def test_a_malformed_line_is_named(tmp_path: Path, line: str):
    log = tmp_path / "access.log"
    log.write_text(f"1 0 0 1\n{line}\n")
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
