"""Hints: the active domain, the dwell time, pushes to llama and re-pins of the pool (real Redis, real pool;
llama's endpoints played by a transport that records every hot set posted)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from moe_l2_cache.buffer import CountBuffer
from moe_l2_cache.flywheel import Flywheel
from moe_l2_cache.hints import HintController
from moe_l2_cache.redis_keys import RedisKeys
from moe_l2_cache.residency import ExpertPool
from moe_l2_contracts.admin import ADMIN_TOKEN_HEADER
from moe_l2_gguf.index import ExpertIndex, load_index

from .conftest import RedisServer
from .test_flywheel import ACCEPTED, LLAMA_ADMIN, snapshot


class FakeLlama:
    def __init__(self, index: ExpertIndex) -> None:
        self.index = index
        self.routing: list[dict] = []
        self.posted: list[dict] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/moe/routing":
            return httpx.Response(200, json=self.routing.pop(0) if self.routing else snapshot(self.index, {}, {}))
        if request.url.path == "/moe/hot-set" and request.method == "POST":
            assert request.headers.get(ADMIN_TOKEN_HEADER) == LLAMA_ADMIN[ADMIN_TOKEN_HEADER]  # an admin call
            body = json.loads(request.content)
            self.posted.append(body)
            return httpx.Response(200, json={**body, "version": len(self.posted), "n_experts": 0})
        return httpx.Response(404)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def index(demo_model: Path) -> ExpertIndex:
    return load_index(demo_model)


def setup(
    index: ExpertIndex, server: RedisServer, dwell_s: float, pool: ExpertPool | None = None
) -> tuple[HintController, FakeLlama, Clock, Flywheel]:
    fake = FakeLlama(index)
    llama = httpx.AsyncClient(base_url="http://llama", transport=httpx.MockTransport(fake.handler))
    redis = Redis(port=server.port, decode_responses=True, socket_timeout=2, socket_connect_timeout=2)
    keys = RedisKeys(index.model_id)
    size = index.max_expert_bytes
    flywheel = Flywheel(
        index,
        keys,
        redis,
        llama,
        CountBuffer(10_000),
        hotset_bytes=4 * size,
        accepted=ACCEPTED | {"new", "fresh"},
        pool=pool,
        admin_headers=LLAMA_ADMIN,
    )
    clock = Clock()
    hints = HintController(flywheel, llama, redis, keys, dwell_s=dwell_s, pool=pool, clock=clock)
    return hints, fake, clock, flywheel


def test_dwell_holds_the_active_domain_then_lets_go(index: ExpertIndex, redis_server: RedisServer) -> None:
    async def run() -> None:
        hints, fake, clock, flywheel = setup(index, redis_server, dwell_s=5)
        fake.routing.append(
            snapshot(index, {"a": {0: {1: 10, 2: 5}}, "b": {0: {7: 10}, 1: {8: 3}}}, {"a": 15, "b": 13})
        )
        await flywheel.pull()

        first = await hints.hint("a")
        assert first.switched and first.active_domain == "a"
        clock.now += 1
        held = await hints.hint("b")
        assert not held.switched and held.active_domain == "a" and "dwell" in held.reason
        clock.now += 1
        assert not (await hints.hint("b")).switched
        assert not (await hints.hint("a")).switched  # already active
        clock.now += 3
        late = await hints.hint("b")
        assert late.switched and late.active_domain == "b"

        assert [p["domain"] for p in fake.posted] == ["a", "b"]
        assert fake.posted[0]["layers"] == {"0": [1, 2]}
        assert fake.posted[1]["layers"] == {"0": [7], "1": [8]}
        stats = hints.stats()
        assert (stats.hints, stats.switches, stats.held_by_dwell, stats.pushes) == (5, 2, 2, 2)
        with redis_server.client() as r:
            assert r.hget(RedisKeys(index.model_id).active, "domain") == "b"

    asyncio.run(run())


def test_domain_without_table_gets_the_global_hot_set(index: ExpertIndex, redis_server: RedisServer) -> None:
    async def run() -> None:
        hints, fake, _, flywheel = setup(index, redis_server, dwell_s=0)
        nothing = await hints.hint("new")
        assert nothing.switched and "no routing counts" in nothing.reason and not fake.posted
        fake.routing.append(snapshot(index, {"a": {0: {3: 10}}}, {"a": 10}))
        await flywheel.pull()
        answer = await hints.hint("fresh")
        assert answer.switched and "global" in answer.reason
        assert fake.posted == [{"domain": "fresh", "layers": {"0": [3]}}]

    asyncio.run(run())


def test_new_counts_repush_and_repin_the_active_domain(index: ExpertIndex, redis_server: RedisServer) -> None:
    pool = ExpertPool(index, budget_bytes=4 * len(index.layers) * index.max_expert_bytes)

    async def run() -> None:
        hints, fake, _, flywheel = setup(index, redis_server, dwell_s=0, pool=pool)
        pinner = asyncio.create_task(hints.run_pinner())
        try:
            fake.routing.append(snapshot(index, {"a": {0: {1: 10}}}, {"a": 10}))
            await flywheel.pull()
            await hints.hint("a")
            await wait_until(lambda: pool.holds()["pinned"] == {(0, 1)})
            # traffic moves: expert 2 overtakes expert 1, the hot set changes, llama and the pool follow
            fake.routing.append(snapshot(index, {"a": {0: {2: 50}, 1: {4: 9}}}, {"a": 50}))
            await flywheel.pull()
            assert fake.posted[-1] == {"domain": "a", "layers": {"0": [2, 1], "1": [4]}}
            await wait_until(lambda: pool.holds()["pinned"] == {(0, 1), (0, 2), (1, 4)})
            assert hints.stats().switches == 1 and hints.stats().pushes == 2
            assert pool.holds()["locked"] == pool.holds()["pinned"]
            # the flywheel's tables became the policy's priors, when the policy takes priors
            prior_table = getattr(pool.policy, "prior_table", None)
            if prior_table is not None:
                assert int(prior_table("a")[0].argmax()) == 2 and int(prior_table("a")[1].argmax()) == 4
        finally:
            pinner.cancel()

    try:
        asyncio.run(run())
    finally:
        pool.close()


async def wait_until(check: Callable[[], bool], timeout_s: float = 30) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        if loop.time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


def test_hints_survive_redis_and_llama_outages(index: ExpertIndex, redis_server: RedisServer) -> None:
    async def run() -> None:
        fake = FakeLlama(index)
        down = httpx.AsyncClient(base_url="http://127.0.0.1:9", timeout=1)  # nothing listens on port 9
        redis = Redis(port=redis_server.port, decode_responses=True, socket_timeout=1, socket_connect_timeout=1)
        keys = RedisKeys(index.model_id)
        flywheel = Flywheel(index, keys, redis, down, CountBuffer(10), hotset_bytes=10**9, accepted=ACCEPTED)
        hints = HintController(flywheel, down, redis, keys, dwell_s=0)
        await redis.hset(keys.routing("a", 0), mapping={"1": 5})
        answer = await hints.hint("a")
        assert answer.switched and "not pushed" in answer.reason
        assert hints.stats().push_errors == 1
        redis_server.kill9()
        answer = await hints.hint("b")
        assert answer.switched and "Redis unreachable" in answer.reason
        assert not fake.posted

    asyncio.run(run())
