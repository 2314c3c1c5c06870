"""Learned transitions (moe_l2_cache.transitions): llama's per-domain expert-pair counts (patch 0032) through
the flywheel into Redis and out as the expert cache's prefetch tables. Against a real Redis; llama's
/moe/routing is played by test_flywheel's transport, so every count is known. The oracle of the whole
path is the policy study's own fit: counts of a per-token trace, pulled, stored and read back, give
exactly `fit_profile`'s transitions."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from moe_l2_cache.keyspace import audit
from moe_l2_cache.policy.profile import fit_profile, transition_counts
from moe_l2_cache.redis_keys import RedisKeys
from moe_l2_cache.skips import SkipCounter
from moe_l2_cache.transitions import cache_transitions, pair_layers, parse_field
from moe_l2_contracts.domains import UNTAGGED
from moe_l2_gguf.index import ExpertIndex

from .conftest import RedisServer
from .test_flywheel import index as index  # the module's fixture
from .test_flywheel import make, snapshot


def with_transitions(body: dict, domain: str, blocks: dict[int, np.ndarray]) -> dict:
    """Adds a domain's pair counts to a snapshot, as llama sends them (base64 of little-endian uint32)."""
    layers = sorted(blocks)
    raw = np.stack([blocks[layer] for layer in layers]).astype("<u4").tobytes()
    body.setdefault("transitions", {})[domain] = {"pairs": layers, "counts": base64.b64encode(raw).decode()}
    return body


def trace(index: ExpertIndex, n_token: int, seed: int) -> np.ndarray:
    """experts[token, layer, slot]: top-k distinct experts per token and layer, skewed towards a few."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(index.n_expert, 0.3), size=index.n_layer)
    ids = np.empty((n_token, index.n_layer, index.n_expert_used), dtype=np.int64)
    for t in range(n_token):
        for layer in range(index.n_layer):
            ids[t, layer] = rng.choice(index.n_expert, index.n_expert_used, replace=False, p=weights[layer])
    return ids


def blocks_of(ids: np.ndarray, n_expert: int) -> dict[int, np.ndarray]:
    counts = transition_counts(ids, n_expert)
    return {layer: counts[layer] for layer in range(counts.shape[0]) if counts[layer].any()}


def test_the_stored_counts_give_the_studys_fit_exactly(index: ExpertIndex, redis_server: RedisServer) -> None:
    assert pair_layers(index.layers) == list(range(index.n_layer - 1))  # the demo model: every layer routes

    async def run() -> None:
        flywheel, fake, _ = make(index, redis_server, decay=0.5, decay_tokens=100)
        ids = trace(index, 300, seed=1)
        # two pulls of two halves, each with a few tokens of another domain: the stored counts add up
        for half in (ids[:120], ids[120:]):
            body = snapshot(index, {"math": {0: {1: 1}}}, {"math": len(half)})
            body = with_transitions(body, "math", blocks_of(half, index.n_expert))
            body = with_transitions(body, "code", blocks_of(half[:5], index.n_expert))
            fake.queue.append(body)
            assert (await flywheel.pull()).flushed
        counts = await flywheel.transition_counts("math")
        assert sorted(counts) == pair_layers(index.layers)
        for layer, block in counts.items():
            assert np.array_equal(block, transition_counts(ids, index.n_expert)[layer])  # not decayed
        table = cache_transitions(counts, index.moe_layers, index.n_expert_used, index.moe_layers)
        fitted = fit_profile(ids, ["math"] * len(ids), index.n_expert).transitions
        assert table is not None and fitted is not None
        assert np.array_equal(table, fitted)
        assert np.allclose(table.sum(axis=2)[table.sum(axis=2) > 0], index.n_expert_used)  # rows sum to k
        assert flywheel.stats().transitions_pulled == int(transition_counts(ids, index.n_expert).sum()) + sum(
            int(transition_counts(h[:5], index.n_expert).sum()) for h in (ids[:120], ids[120:])
        )
        assert await flywheel.transition_counts("stranger") == {}  # not an accepted domain

    asyncio.run(run())


def test_a_table_covers_only_cached_layers_with_no_moe_layer_between() -> None:
    block = np.zeros((4, 4))
    block[0, 1], block[0, 2], block[3, 3] = 3, 1, 2
    counts = {1: block, 2: block * 2}
    moe = [1, 2, 3, 4]
    # cached layers 1, 2 and 4: the pair (1, 2) has a table; MoE layer 3 (on the device) is between 2 and 4
    table = cache_transitions(counts, [1, 2, 4], top_k=2, moe_layers=moe)
    assert table is not None and table.shape == (2, 4, 4)
    assert table[0][0].tolist() == [0.0, 1.5, 0.5, 0.0] and table[0][3].tolist() == [0.0, 0.0, 0.0, 2.0]
    assert not table[1].any()
    assert cache_transitions(counts, [2, 4], top_k=2, moe_layers=moe) is None  # no pair of next layers: no table
    assert cache_transitions(counts, [1], top_k=2, moe_layers=moe) is None  # one layer: nothing to predict
    assert cache_transitions({}, [1, 2], top_k=2, moe_layers=moe) is None


def test_interleaved_moe_pairs_each_moe_layer_with_the_next_one() -> None:
    """llama4 routes at every second layer: pair l is (l, l+2), counted by llama (patch 0032) and kept (D6:
    only (l, l+1) was, so an interleaved model had no transitions)."""
    block = np.zeros((4, 4))
    block[1, 2] = 4
    moe = [1, 3, 5]
    assert pair_layers(moe) == [1, 3]
    table = cache_transitions({1: block, 3: block}, moe, top_k=1, moe_layers=moe)
    assert table is not None and table.shape == (2, 4, 4) and table[0][1][2] == table[1][1][2] == 1.0


@pytest.mark.parametrize(
    ("text", "pair"), [("3:5", (3, 5)), ("0:0", (0, 0)), ("8:1", None), ("1:8", None), ("x:1", None), ("1", None),
                       ("1:2:3", None), ("-1:2", None), ("²:1", None)],
)  # fmt: skip
def test_a_field_names_two_experts_of_the_model(text: str, pair: tuple[int, int] | None) -> None:
    assert parse_field(text, n_expert=8) == pair


def test_what_does_not_fit_is_skipped_and_counted(index: ExpertIndex, redis_server: RedisServer) -> None:
    async def run() -> None:
        flywheel, fake, _ = make(index, redis_server)
        keys = RedisKeys(index.model_id)
        good = np.zeros((index.n_expert, index.n_expert), dtype=np.int64)
        good[1, 2] = 7
        body = snapshot(index, {}, {"math": 1})
        body = with_transitions(body, "math", {0: good})
        body = with_transitions(body, "_x", {0: good})  # reserved
        body = with_transitions(body, "stranger", {0: good})  # unknown
        body = with_transitions(body, "code", {index.n_layer - 1: good})  # no layer after the last
        body["transitions"][UNTAGGED] = {"pairs": [0], "counts": base64.b64encode(b"\0" * 12).decode()}  # too short
        fake.queue.append(body)
        assert (await flywheel.pull()).flushed
        assert flywheel.stats().skipped == {"snapshot_cell": 2, "snapshot_domain": 2}
        with redis_server.client() as r:
            assert sorted(r.scan_iter(f"{keys.base}:transitions:*")) == [keys.transitions("math", 0)]
            assert r.hgetall(keys.transitions("math", 0)) == {"1:2": "7"}
            # garbage in Redis is skipped on reading, not trusted
            r.hset(keys.transitions("math", 0), mapping={"banana": "1", "1:99": "1", "2:3": "-4", "3:4": "nan"})
        counts = await flywheel.transition_counts("math")
        assert list(counts) == [0] and counts[0][1, 2] == 7 and counts[0].sum() == 7
        assert flywheel.stats().skipped["transitions_field"] == 4

        # a key of the wrong type is moved aside; one of a layer pair the model does not route is left alone
        with redis_server.client() as r:
            r.set(keys.transitions("math", 1), "not a hash")
            r.hset(keys.transitions("math", index.n_layer - 1), mapping={"1:2": "1"})
        skips = SkipCounter()
        moved = await audit(
            flywheel.redis, keys, accepted=flywheel.accepted, layer_ok=index.layers.__contains__, skips=skips
        )
        assert moved == 1 and skips.counts == {"transitions_key": 1, "wrong_type": 1}

    asyncio.run(run())
