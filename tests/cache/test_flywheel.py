"""The flywheel's arithmetic against a real Redis: deltas, decay, the bounded buffer, exactly-once flushes,
hot-set choice and router maps. llama's /moe/routing is played by a transport that serves snapshots
of the contract (schemas.llama.RoutingSnapshot), so every count is known exactly."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from moe_l2_cache.buffer import Batch, CountBuffer
from moe_l2_cache.flywheel import Flywheel
from moe_l2_cache.hotset import router_map_text, select_hot_set, sum_tables
from moe_l2_cache.redis_keys import GLOBAL_DOMAIN, RedisKeys
from moe_l2_contracts.admin import ADMIN_TOKEN_HEADER
from moe_l2_contracts.domains import UNTAGGED
from moe_l2_gguf.index import ExpertIndex, load_index

from .conftest import RedisServer

# The domains these tests use, as the service's accepted set (the taxonomy's names in production).
ACCEPTED = frozenset({"math", "code", "a", "b", "x", "y", UNTAGGED})
LLAMA_ADMIN = {ADMIN_TOKEN_HEADER: "llama-admin-token"}


def snapshot(index: ExpertIndex, domains: dict[str, dict[int, dict[int, int]]], tokens: dict[str, int]) -> dict:
    return {
        "model": "test",
        "enabled": True,
        "n_layer": index.n_layer,
        "n_expert": index.n_expert,
        "n_expert_used": index.n_expert_used,
        "tokens": sum(tokens.values()),
        "tokens_by_domain": tokens,
        "domains": {
            d: {str(layer): {str(e): n for e, n in experts.items()} for layer, experts in layers.items()}
            for d, layers in domains.items()
        },
    }


class FakeRouting:
    """Serves queued snapshots on GET /moe/routing?reset=1 (an empty one when the queue is empty)."""

    def __init__(self, index: ExpertIndex) -> None:
        self.index = index
        self.queue: list[dict] = []
        self.status = 200

    def handler(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/moe/routing" and request.url.params.get("reset") == "1"
        # a reset is an admin call of llama's: the flywheel sends the admin token
        if request.headers.get(ADMIN_TOKEN_HEADER) != LLAMA_ADMIN[ADMIN_TOKEN_HEADER]:
            return httpx.Response(401, json={"error": {"message": "admin token required"}})
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "telemetry disabled"}})
        body = self.queue.pop(0) if self.queue else snapshot(self.index, {}, {})
        return httpx.Response(200, json=body)


@pytest.fixture
def index(demo_model: Path) -> ExpertIndex:
    return load_index(demo_model)


def make(index: ExpertIndex, server: RedisServer, **kwargs: float) -> tuple[Flywheel, FakeRouting, Callable[[], Redis]]:
    fake = FakeRouting(index)
    llama = httpx.AsyncClient(base_url="http://llama", transport=httpx.MockTransport(fake.handler))
    redis = Redis(port=server.port, decode_responses=True, socket_timeout=2, socket_connect_timeout=2)
    buffer = CountBuffer(int(kwargs.pop("max_cells", 1_000_000)))
    flywheel = Flywheel(
        index,
        RedisKeys(index.model_id),
        redis,
        llama,
        buffer,
        hotset_bytes=int(kwargs.pop("hotset_bytes", 10**9)),
        accepted=ACCEPTED,
        admin_headers=LLAMA_ADMIN,
        **kwargs,  # type: ignore[arg-type]
    )
    return flywheel, fake, lambda: redis


def table(server: RedisServer, index: ExpertIndex, domain: str, layer: int) -> dict[int, float]:
    with server.client() as r:
        return {int(e): float(c) for e, c in r.hgetall(RedisKeys(index.model_id).routing(domain, layer)).items()}


def test_deltas_add_up_and_decay_follows_new_traffic(index: ExpertIndex, redis_server: RedisServer) -> None:
    async def run() -> None:
        flywheel, fake, _ = make(index, redis_server, decay=0.5, decay_tokens=1000)
        fake.queue.append(snapshot(index, {"math": {0: {1: 100, 2: 50}}}, {"math": 1000}))
        assert (await flywheel.pull()).flushed
        assert table(redis_server, index, "math", 0) == {1: 100.0, 2: 50.0}
        # 1000 new math tokens: old counts keep half their weight, then the delta is added
        fake.queue.append(snapshot(index, {"math": {0: {2: 100, 3: 10}}, "code": {0: {7: 5}}}, {"math": 1000}))
        await flywheel.pull()
        assert table(redis_server, index, "math", 0) == {1: 50.0, 2: 125.0, 3: 10.0}
        assert table(redis_server, index, "code", 0) == {7: 5.0}  # no code tokens: nothing decays
        # a domain without new traffic keeps its table
        fake.queue.append(snapshot(index, {"code": {0: {7: 1}}}, {"code": 10}))
        await flywheel.pull()
        assert table(redis_server, index, "math", 0) == {1: 50.0, 2: 125.0, 3: 10.0}
        with redis_server.client() as r:
            assert r.hgetall(RedisKeys(index.model_id).tokens) == {"math": "2000", "code": "10"}
            assert r.smembers(RedisKeys(index.model_id).domains) == {"math", "code"}

    asyncio.run(run())


def test_redis_down_buffers_within_a_bound_and_drops_whole_snapshots(
    index: ExpertIndex, redis_server: RedisServer
) -> None:
    async def run() -> None:
        flywheel, fake, _ = make(index, redis_server, max_cells=5)
        await flywheel.audit_if_due()  # as at the service's start, while Redis was up
        redis_server.kill9()
        fake.queue.append(snapshot(index, {"a": {0: {1: 3, 2: 4}}}, {"a": 2}))
        # the first batch failed to write: it waits, "uncertain", beside the counts that come after it
        fake.queue.append(snapshot(index, {"a": {0: {1: 1}, 1: {5: 2}}}, {"a": 1}))  # 2 + 2 cells: fits
        fake.queue.append(snapshot(index, {"b": {0: {1: 1, 2: 1, 3: 1}}}, {"b": 1}))  # 3 more: over the bound
        for _ in range(3):
            body = await flywheel.pull()
            assert body.ok and not body.flushed
        stats = flywheel.stats()
        assert stats.redis_ok is False and stats.redis_errors >= 3
        assert stats.buffered_cells == 4 and stats.buffered_activations == 10
        assert stats.dropped_snapshots == 1 and stats.dropped_activations == 3

        redis_server.start()
        assert (await flywheel.pull()).flushed
        assert table(redis_server, index, "a", 0) == {1: 4.0, 2: 4.0}
        assert table(redis_server, index, "a", 1) == {5: 2.0}
        assert flywheel.stats().buffered_cells == 0 and flywheel.stats().redis_ok

    asyncio.run(run())


def test_a_batch_whose_write_may_have_landed_is_never_counted_twice(
    index: ExpertIndex, redis_server: RedisServer
) -> None:
    async def run() -> None:
        flywheel, fake, redis = make(index, redis_server)
        keys = RedisKeys(index.model_id)
        # the transaction went through but its reply was lost: the batch is "uncertain" and its marker exists
        landed = Batch()
        landed.merge({("a", 0, 1): 7}, {"a": 7})
        await flywheel._write(landed)
        flywheel.buffer.failed(landed)
        # ... and one that never reached Redis
        lost = Batch()
        lost.merge({("a", 0, 2): 3}, {"a": 3})
        fake.queue.append(snapshot(index, {"a": {0: {3: 1}}}, {"a": 1}))
        await flywheel.pull()
        assert table(redis_server, index, "a", 0) == {1: 7.0, 3: 1.0}

        flywheel.buffer.failed(lost)
        await flywheel.flush()
        assert table(redis_server, index, "a", 0) == {1: 7.0, 2: 3.0, 3: 1.0}
        assert await redis().hget(keys.tokens, "a") == "11"

    asyncio.run(run())


def test_pull_errors_are_reported_not_raised(index: ExpertIndex, redis_server: RedisServer) -> None:
    async def run() -> None:
        flywheel, fake, _ = make(index, redis_server)
        fake.status = 501
        body = await flywheel.pull()
        assert not body.ok and "501" in (body.error or "")
        fake.status = 200
        other = snapshot(index, {}, {})
        other["n_expert"] = 64
        fake.queue.append(other)
        body = await flywheel.pull()
        assert not body.ok and "MOE_L2_MODEL_PATH" in (body.error or "")
        assert flywheel.stats().pull_errors == 2

    asyncio.run(run())


def test_failing_pulls_are_logged_once_per_reason(
    index: ExpertIndex, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # a wrong admin token makes every pull a 401: the flywheel collects nothing, and the log must say so
    async def run() -> None:
        flywheel, _, _ = make(index, redis_server)
        flywheel.admin_headers = {ADMIN_TOKEN_HEADER: "wrong"}
        for _ in range(3):
            assert not (await flywheel.pull()).ok
        flywheel.admin_headers = LLAMA_ADMIN
        assert (await flywheel.pull()).ok

    with caplog.at_level("INFO", logger="moe_l2_cache"):
        asyncio.run(run())
    failed = [r for r in caplog.records if "routing pull failed" in r.getMessage()]
    assert len(failed) == 1 and "401" in failed[0].getMessage() and failed[0].levelname == "WARNING"
    assert [r.getMessage() for r in caplog.records if "work again" in r.getMessage()] == ["routing pulls work again"]


def test_hot_sets_are_stored_and_follow_the_budget(index: ExpertIndex, redis_server: RedisServer) -> None:
    size = index.max_expert_bytes

    async def run() -> None:
        flywheel, fake, _ = make(index, redis_server, hotset_bytes=3 * size)
        changed: list[set[str]] = []

        async def listener(domains: set[str]) -> None:
            changed.append(domains)

        flywheel.on_hot_sets_changed(listener)
        fake.queue.append(
            snapshot(
                index,
                {"x": {0: {4: 90, 5: 10}, 1: {6: 40, 7: 40, 8: 20}}, "y": {0: {9: 500}}},
                {"x": 100, "y": 5},
            )
        )
        await flywheel.pull()
        hot = await flywheel.hot_set("x")
        assert hot is not None
        # by share of the layer: 4 (0.9), then 6 and 7 (0.4 each); 8 (0.2) and 5 (0.1) do not fit
        assert hot.layers == {"0": [4], "1": [6, 7]}
        assert hot.n_experts == 3 and hot.bytes == 3 * size
        assert hot.coverage == pytest.approx((90 + 80) / 200)
        assert changed == [{"x", "y"}]
        with redis_server.client() as r:
            stored = json.loads(r.get(RedisKeys(index.model_id).hotset("x")))
        assert stored["layers"] == hot.layers

        glob = await flywheel.hot_set(GLOBAL_DOMAIN)
        assert glob is not None and glob.layers == {"0": [9], "1": [6, 7]}  # 9 takes 500 of layer 0's 600
        assert await flywheel.hot_set("nobody") is None

        # same counts again: the hot set does not change, no listener call
        fake.queue.append(snapshot(index, {"x": {0: {4: 9, 5: 1}, 1: {6: 4, 7: 4, 8: 2}}}, {"x": 10}))
        await flywheel.pull()
        assert changed == [{"x", "y"}]

    asyncio.run(run())


def test_select_hot_set_and_router_map_format() -> None:
    counts = {0: {1: 10.0, 2: 30.0, 3: 0.0}, 2: {5: 1.0}}
    # share per byte: (0, 2) 0.75/100, then (2, 5) 1.0/300, then (0, 1) 0.25/100, which no longer fits
    choice = select_hot_set(counts, {0: 100, 2: 300}, budget_bytes=400)
    assert choice.layers == {0: [2], 2: [5]} and choice.bytes == 400
    assert choice.coverage == pytest.approx(31 / 41)
    choice = select_hot_set(counts, {0: 100, 2: 300}, budget_bytes=1000)
    assert choice.layers == {0: [2, 1], 2: [5]} and choice.bytes == 500 and choice.coverage == 1.0
    assert select_hot_set({}, {0: 1}, 10).layers == {}
    assert router_map_text({2: [5], 0: [2, 1], 1: []}) == "# EXPERT_TOTAL 3\n0 2 1\n2 5\n"
    assert sum_tables([{0: {1: 1.0}}, {0: {1: 2.0, 2: 1.0}}]) == {0: {1: 3.0, 2: 1.0}}


def test_count_buffer_bounds_and_resolution() -> None:
    buf = CountBuffer(max_cells=2)
    assert buf.add({("a", 0, 1): 1}, {"a": 1})
    assert not buf.add({("a", 0, 2): 1, ("a", 0, 3): 1}, {"a": 1})
    assert buf.add({("a", 0, 1): 2, ("a", 0, 2): 5}, {"a": 2})
    assert buf.cells == 2 and buf.activations == 8 and buf.dropped_activations == 2
    batch = buf.take()
    assert batch is not None and buf.take() is None
    buf.failed(batch)
    assert buf.cells == 2  # the uncertain batch still counts against the bound
    assert not buf.add({("b", 0, 0): 1}, {})
    buf.resolve(applied=False)
    assert buf.current.counts == {("a", 0, 1): 3, ("a", 0, 2): 5} and buf.current.tokens == {"a": 3}
    batch = buf.take()
    assert batch is not None
    buf.failed(batch)
    buf.resolve(applied=True)
    assert buf.cells == 0 and buf.take() is None


def test_snapshot_domains_outside_the_accepted_set_never_reach_redis(
    index: ExpertIndex, redis_server: RedisServer
) -> None:
    """llama counts whatever tag a request carries (a patched llama refuses reserved and unknown ones,
    an older one does not): the flywheel stores only accepted domains and the model's experts."""

    async def run() -> None:
        flywheel, fake, _ = make(index, redis_server)
        body = snapshot(
            index,
            {
                "math": {0: {1: 5}},
                UNTAGGED: {1: {2: 3}},
                GLOBAL_DOMAIN: {0: {7: 9}},
                "_x": {0: {8: 9}},
                "stranger": {0: {9: 9}},
            },
            {"math": 5, UNTAGGED: 3, GLOBAL_DOMAIN: 9, "_x": 9, "stranger": 9},
        )
        body["domains"]["math"]["zz"] = {"1": 4}  # not a layer
        body["domains"]["math"]["99"] = {"1": 4}  # a layer the model does not have
        body["domains"]["math"]["2"] = {"x": 4, "99": 4, "3": 6}  # two experts it does not have, one it has
        fake.queue.append(body)
        pulled = await flywheel.pull()
        assert pulled.ok and pulled.flushed and pulled.domains == sorted(["math", UNTAGGED])
        assert pulled.activations == 5 + 3 + 6
        with redis_server.client() as r:
            base = RedisKeys(index.model_id).base
            assert r.smembers(f"{base}:domains") == {"math", UNTAGGED}
            assert r.hgetall(f"{base}:tokens") == {"math": "5", UNTAGGED: "3"}
            assert sorted(r.scan_iter(f"{base}:routing:*")) == sorted(
                f"{base}:routing:{d}:{layer}" for d, layer in (("math", 0), ("math", 2), (UNTAGGED, 1))
            )
        assert flywheel.stats().skipped == {"snapshot_cell": 4, "snapshot_domain": 3}
        glob = await flywheel.hot_set(GLOBAL_DOMAIN)
        assert glob is not None and glob.layers == {"0": [1], "1": [2], "2": [3]}

    asyncio.run(run())


def test_the_global_table_never_sums_itself_and_garbage_values_do_not_stop_flushes(
    index: ExpertIndex, redis_server: RedisServer
) -> None:
    async def run() -> None:
        flywheel, fake, _ = make(index, redis_server)
        keys = RedisKeys(index.model_id)
        with redis_server.client() as r:
            r.sadd(keys.domains, GLOBAL_DOMAIN, "math", "_x", "nosuch")
            r.hset(keys.routing("math", 0), mapping={"1": "2", "banana": "3", "2": "-1", "3": "nan"})
            r.hset(keys.routing(GLOBAL_DOMAIN, 0), mapping={"5": "100"})
        assert await flywheel.table(GLOBAL_DOMAIN) == {0: {1: 2.0}}  # before: RecursionError
        assert await flywheel.known_domains() == {"math"}
        assert flywheel.stats().skipped == {"domain": 3, "routing_field": 3}
        await flywheel.table(GLOBAL_DOMAIN)  # the same entries again are not counted again
        assert flywheel.stats().skipped == {"domain": 3, "routing_field": 3}

        # writing over values that are not counts replaces them, and the flush goes through
        with redis_server.client() as r:
            r.hset(keys.tokens, mapping={"math": "lots"})
        fake.queue.append(snapshot(index, {"math": {0: {2: 4, 3: 5}}}, {"math": 3}))
        assert (await flywheel.pull()).flushed
        assert (await flywheel.table("math"))[0] == {1: 2.0, 2: 4.0, 3: 5.0}
        with redis_server.client() as r:
            assert r.hget(keys.tokens, "math") == "3"
            assert r.hget(keys.routing("math", 0), "banana") == "3"  # not a cell it writes: left alone

    asyncio.run(run())
