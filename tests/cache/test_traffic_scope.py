"""Hot-set scope `traffic`: the hot set of a replica's recent mix of domains (real Redis; llama's
hot-set endpoint played by a transport that records every post; the demo model's planted router
as the oracle).

The tables are filled as llama's telemetry would fill them on the planted model: each domain's
tokens go to its planted experts of every layer, plus a little mass on a few other experts (the
selector must tell them apart), and the domains routed very different numbers of tokens (a mix must
weigh a domain by its share of the hints, not by its token count).

Replay figure (test_affinity_routing_pays_in_the_traffic_scope, printed by `pytest -s`): a replica
whose requests come from 4 of the 8 domains (the first four) vs all 8, uniformly at random, 4
requests/s for 300 s, dwell 10 s, half-life 60 s; a request's coverage is the share of its domain's
planted experts (all layers) inside the hot set llama holds when it arrives, averaged over requests.
Budgets are given in experts per layer: the default one (MOE_L2_CACHE_HOTSET_BYTES = the 8 GiB pool)
holds the whole 6 MiB demo model, where every case covers 1.0.

    budget (of 32 per layer)    6      12     16     24
    traffic, 4 domains          0.39   0.63   0.80   0.98
    traffic, 8 domains          0.24   0.49   0.65   0.81
    domain,  4 domains          0.36   0.44   0.44   0.44
    domain,  8 domains          0.21   0.30   0.30   0.30

Serving 4 domains instead of 8 gains 14-17 points of coverage in the traffic scope: that is what
expert-affinity routing buys a replica. The domain scope holds one domain's experts at a time (6
planted and a few strays per layer, whatever the budget), so it gains less and stops at 0.44.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from redis.asyncio import Redis

from moe_l2_cache.buffer import CountBuffer
from moe_l2_cache.flywheel import Flywheel
from moe_l2_cache.hints import HintController
from moe_l2_cache.redis_keys import RedisKeys
from moe_l2_cache.settings import CacheSettings
from moe_l2_cache.traffic import TRAFFIC_DOMAIN, TrafficHintController
from moe_l2_contracts.admin import ADMIN_TOKEN_HEADER
from moe_l2_contracts.domains import DEFAULT_DOMAINS, UNTAGGED
from moe_l2_gguf.index import ExpertIndex, load_index
from moe_l2_ops.supervisor import free_port

from .conftest import CacheManager, RedisServer
from .test_flywheel import LLAMA_ADMIN, snapshot
from .test_hints import Clock

ACCEPTED = frozenset(DEFAULT_DOMAINS) | {UNTAGGED}
Planted = dict[str, dict[int, set[int]]]  # domain -> layer -> planted experts


class RecordingLlama:
    """llama's POST /moe/hot-set: records each body with the (fake) clock time it came at."""

    def __init__(self, index: ExpertIndex, clock: Clock) -> None:
        self.index = index
        self.clock = clock
        self.routing: list[dict] = []
        self.posted: list[dict] = []
        self.posted_at: list[float] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/moe/routing":
            return httpx.Response(200, json=self.routing.pop(0) if self.routing else snapshot(self.index, {}, {}))
        if request.url.path == "/moe/hot-set" and request.method == "POST":
            assert request.headers.get(ADMIN_TOKEN_HEADER) == LLAMA_ADMIN[ADMIN_TOKEN_HEADER]
            self.posted.append(json.loads(request.content))
            self.posted_at.append(self.clock.now)
            return httpx.Response(200, json={"version": len(self.posted)})
        return httpx.Response(404)

    def held(self) -> dict[int, set[int]]:
        """The experts llama holds now: those of the last hot set posted."""
        last = self.posted[-1]["layers"] if self.posted else {}
        return {int(layer): set(ids) for layer, ids in last.items()}


@pytest.fixture(scope="module")
def index(demo_model: Path) -> ExpertIndex:
    return load_index(demo_model)


@pytest.fixture(scope="module")
def truth(planted: dict) -> Planted:
    return {
        d: {int(layer): set(ids) for layer, ids in planted["domains"][d]["experts"].items()} for d in DEFAULT_DOMAINS
    }


def planted_snapshot(index: ExpertIndex, truth: Planted, seed: int = 0) -> dict:
    """One pull's counts, as llama would count them on the planted model: a domain's tokens at each
    layer go to its planted experts (top-4 of 6, so ~4/6 of them each), 2% to three other experts."""
    rng = np.random.default_rng(seed)
    counts: dict[str, dict[int, dict[int, int]]] = {}
    tokens: dict[str, int] = {}
    for i, domain in enumerate(DEFAULT_DOMAINS):
        n = 500 * (1 + 3 * i)  # 500 to 11000 tokens: the domains' volumes differ 22-fold
        tokens[domain] = n
        counts[domain] = {}
        for layer, experts in truth[domain].items():
            per = {e: int(n * 4 / 6 * rng.uniform(0.9, 1.1)) for e in experts}
            others = rng.choice(sorted(set(range(index.n_expert)) - experts), 3, replace=False)
            per |= {int(e): int(n * 0.02) for e in others}
            counts[domain][layer] = per
    return snapshot(index, counts, tokens)


async def make_controller(
    index: ExpertIndex,
    server: RedisServer,
    truth: Planted,
    *,
    per_layer: int,
    dwell_s: float,
    scope: str = "traffic",
    half_life_s: float = 60.0,
) -> tuple[HintController, RecordingLlama, Clock, Flywheel]:
    """A controller whose flywheel holds every domain's planted tables; the budget holds `per_layer`
    experts of every layer."""
    clock = Clock()
    fake = RecordingLlama(index, clock)
    llama = httpx.AsyncClient(base_url="http://llama", transport=httpx.MockTransport(fake.handler))
    redis = Redis(port=server.port, decode_responses=True, socket_timeout=2, socket_connect_timeout=2)
    keys = RedisKeys(index.model_id)
    budget = per_layer * sum(index.expert_bytes(layer) for layer in index.layers)
    flywheel = Flywheel(
        index,
        keys,
        redis,
        llama,
        CountBuffer(100_000),
        hotset_bytes=budget,
        accepted=ACCEPTED,
        admin_headers=LLAMA_ADMIN,
    )
    args: dict[str, Any] = {"dwell_s": dwell_s, "clock": clock}
    if scope == "traffic":
        hints: HintController = TrafficHintController(flywheel, llama, redis, keys, half_life_s=half_life_s, **args)
    else:
        hints = HintController(flywheel, llama, redis, keys, **args)
    fake.routing.append(planted_snapshot(index, truth))
    await flywheel.pull()
    return hints, fake, clock, flywheel


def coverage(held: dict[int, set[int]], experts: dict[int, set[int]]) -> float:
    """The share of a domain's planted experts (every layer) that llama holds."""
    total = sum(len(ids) for ids in experts.values())
    return sum(len(ids & held.get(layer, set())) for layer, ids in experts.items()) / total


async def send(hints: HintController, clock: Clock, domains: list[str], step_s: float = 1.0) -> None:
    for domain in domains:
        await hints.hint(domain)
        clock.now += step_s


def test_a_mix_of_two_domains_covers_both_in_proportion(
    index: ExpertIndex, redis_server: RedisServer, truth: Planted
) -> None:
    a, b = "codegen", "chinese_tech"  # 500 vs 11000 tokens in the tables

    async def run() -> None:
        # even hints, a budget of one domain's experts: both domains' experts, about half each
        hints, fake, clock, _ = await make_controller(index, redis_server, truth, per_layer=6, dwell_s=0)
        await send(hints, clock, [a, b] * 20)
        held = fake.held()
        assert fake.posted[-1]["domain"] == TRAFFIC_DOMAIN
        union = {layer: truth[a][layer] | truth[b][layer] for layer in truth[a]}
        assert coverage(union, {layer: ids for layer, ids in held.items()}) == 1.0  # no other expert
        cov_a, cov_b = coverage(held, truth[a]), coverage(held, truth[b])
        assert cov_a >= 0.4 and cov_b >= 0.4 and abs(cov_a - cov_b) <= 0.25, (cov_a, cov_b)
        mix = hints.stats().traffic
        assert mix is not None and set(mix) == {a, b} and abs(mix[a] - 0.5) < 0.05

        # three hints of b to one of a, room for 9 of 32 per layer: all of b's experts, part of a's
        hints, fake, clock, _ = await make_controller(index, redis_server, truth, per_layer=9, dwell_s=0)
        await send(hints, clock, [b, b, a, b] * 10)
        held = fake.held()
        cov_a, cov_b = coverage(held, truth[a]), coverage(held, truth[b])
        assert cov_b == 1.0 and 0.3 <= cov_a < 1.0, (cov_a, cov_b)
        mix = hints.stats().traffic
        assert mix is not None and abs(mix[b] - 0.75) < 0.05 and hints.stats().active_domain == b

    asyncio.run(run())


def test_one_domain_of_traffic_is_that_domains_hot_set(
    index: ExpertIndex, redis_server: RedisServer, truth: Planted
) -> None:
    async def run() -> None:
        hints, fake, clock, flywheel = await make_controller(index, redis_server, truth, per_layer=6, dwell_s=0)
        await send(hints, clock, ["math"] * 5)
        own = await flywheel.hot_set("math")
        assert own is not None
        assert fake.posted == [{"domain": "math", "layers": own.layers}]  # pushed once: it did not change
        assert coverage(fake.held(), truth["math"]) == 1.0
        stats = hints.stats()
        assert stats.scope == "traffic" and stats.traffic == {"math": 1.0} and stats.pushes == 1

    asyncio.run(run())


def test_an_old_domain_fades_from_the_mix(index: ExpertIndex, redis_server: RedisServer, truth: Planted) -> None:
    old, new = "debug", "translate"

    async def run() -> None:
        # room for both domains' experts: the old one's stay while its share is worth their bytes
        hints, fake, clock, _ = await make_controller(
            index, redis_server, truth, per_layer=12, dwell_s=0, half_life_s=10
        )
        await send(hints, clock, [old] * 20)
        assert coverage(fake.held(), truth[old]) == 1.0
        seen = []
        for _ in range(24):  # 120 s of the new domain only: 12 half-lives
            await send(hints, clock, [new] * 5)
            seen.append(coverage(fake.held(), truth[old]))
        mix = hints.stats().traffic
        assert mix == {new: 1.0}  # the old domain is forgotten
        assert fake.posted[-1]["domain"] == new and coverage(fake.held(), truth[new]) == 1.0
        # it faded: held while it weighed, then gone; never back
        assert seen[0] > seen[-1] and seen == sorted(seen, reverse=True), seen
        assert any(p["domain"] == TRAFFIC_DOMAIN for p in fake.posted)  # a mix on the way

    asyncio.run(run())


def test_the_dwell_bounds_the_push_rate(index: ExpertIndex, redis_server: RedisServer, truth: Planted) -> None:
    rng = random.Random(1)

    async def run() -> None:
        hints, fake, clock, flywheel = await make_controller(
            index, redis_server, truth, per_layer=6, dwell_s=10, half_life_s=20
        )
        # 200 s at 2 hints/s, the mix drifting from one set of 4 domains to another
        first, second = list(DEFAULT_DOMAINS[:4]), list(DEFAULT_DOMAINS[3:7])
        await send(hints, clock, [rng.choice(first) for _ in range(200)], step_s=0.5)
        await send(hints, clock, [rng.choice(second) for _ in range(200)], step_s=0.5)
        gaps = np.diff(fake.posted_at)
        assert len(fake.posted) <= 200 / 10 + 1 and (gaps >= 10).all(), fake.posted_at
        assert len(fake.posted) >= 2  # it followed the drift
        assert coverage(fake.held(), truth[DEFAULT_DOMAINS[6]]) > coverage(fake.held(), truth[DEFAULT_DOMAINS[0]])
        assert hints.stats().held_by_dwell > 0

        # new counts that change a mixed domain's hot set are pushed at once, within the dwell
        await hints.hint(second[0])  # the dwell is over: the mix is looked at now, and again in 10 s
        clock.now += 1
        pushes = len(fake.posted)
        moved = {layer: {e: 50_000 for e in range(4)} for layer in index.layers}
        fake.routing.append(snapshot(index, {DEFAULT_DOMAINS[5]: moved}, {DEFAULT_DOMAINS[5]: 50_000}))
        await flywheel.pull()
        assert len(fake.posted) == pushes + 1
        assert "dwell" in (await hints.hint(second[0])).reason  # a hint now would have been held
        assert all({0, 1, 2, 3} & set(ids) for ids in fake.posted[-1]["layers"].values())

    asyncio.run(run())


def test_the_default_scope_is_the_active_domain(
    index: ExpertIndex, redis_server: RedisServer, truth: Planted, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MOE_L2_CACHE_HOT_SET_SCOPE", raising=False)
    assert CacheSettings().hot_set_scope == "domain"
    monkeypatch.setenv("MOE_L2_CACHE_HOT_SET_SCOPE", "traffic")
    monkeypatch.setenv("MOE_L2_CACHE_TRAFFIC_HALF_LIFE_S", "30")
    settings = CacheSettings()
    assert (settings.hot_set_scope, settings.traffic_half_life_s) == ("traffic", 30)

    async def run() -> None:
        # the domain scope still switches: one domain's hot set at a time, named after it
        hints, fake, clock, flywheel = await make_controller(
            index, redis_server, truth, per_layer=6, dwell_s=0, scope="domain"
        )
        await send(hints, clock, ["math", "logic"] * 3)
        assert [p["domain"] for p in fake.posted] == ["math", "logic"] * 3
        own = await flywheel.hot_set("logic")
        assert own is not None and fake.posted[-1]["layers"] == own.layers
        stats = hints.stats()
        assert stats.scope == "domain" and stats.traffic is None and stats.active_domain == "logic"

    asyncio.run(run())


def test_the_process_reads_the_scope(
    demo_model: Path, redis_server: RedisServer, start_cache_manager: Callable[..., CacheManager]
) -> None:
    def start(**env: str) -> CacheManager:
        return start_cache_manager(
            MOE_L2_MODEL_PATH=str(demo_model),
            MOE_L2_LLAMA_URL=f"http://127.0.0.1:{free_port()}",  # nothing listens there: pushes fail, counted
            MOE_L2_REDIS_URL=redis_server.url,
            MOE_L2_CACHE_PULL_INTERVAL_S="0",
            MOE_L2_CACHE_POOL_BYTES=str(1 << 20),
            MOE_L2_CACHE_DWELL_S="0",
            **env,
        )

    def hint_all(manager: CacheManager) -> dict:
        for domain in ("math", "logic", "math"):
            assert manager.client.post("/v1/hint", json={"domain": domain}).json()["accepted"]
        return manager.stats()["hints"]

    default = hint_all(start())
    assert (default["scope"], default["traffic"], default["active_domain"]) == ("domain", None, "math")
    traffic = start(MOE_L2_CACHE_HOT_SET_SCOPE="traffic")
    hints = hint_all(traffic)
    assert hints["scope"] == "traffic" and hints["active_domain"] == "math"
    assert set(hints["traffic"]) == {"math", "logic"} and hints["traffic"]["math"] > 0.6
    assert 'moe_l2_cache_traffic_share{domain="logic"}' in traffic.client.get("/metrics").text


async def replay(
    index: ExpertIndex, server: RedisServer, truth: Planted, scope: str, served: list[str], per_layer: int
) -> float:
    """Mean coverage of a replica's requests (4/s for 300 s, uniform over `served`) by llama's hot set."""
    rng = random.Random(7)
    hints, fake, clock, _ = await make_controller(
        index, server, truth, per_layer=per_layer, dwell_s=10, scope=scope, half_life_s=60
    )
    covered = []
    for _ in range(1200):
        domain = rng.choice(served)
        await hints.hint(domain)  # the gateway's hint goes out before the request
        covered.append(coverage(fake.held(), truth[domain]))
        clock.now += 0.25
    return float(np.mean(covered))


def test_affinity_routing_pays_in_the_traffic_scope(
    index: ExpertIndex, redis_server: RedisServer, truth: Planted
) -> None:
    four, eight = list(DEFAULT_DOMAINS[:4]), list(DEFAULT_DOMAINS)

    async def run() -> dict[tuple[str, int, int], float]:
        out = {}
        for per_layer in (6, 12, 16, 24):
            for scope in ("traffic", "domain"):
                for served in (four, eight):
                    out[scope, len(served), per_layer] = await replay(
                        index, redis_server, truth, scope, served, per_layer
                    )
        return out

    figures = asyncio.run(run())
    for (scope, n, per_layer), value in sorted(figures.items()):
        print(f"{per_layer:2d}/32 per layer, scope {scope:7s}, {n} domains: coverage {value:.3f}")
    for per_layer in (6, 12, 16, 24):
        traffic_4, traffic_8 = figures["traffic", 4, per_layer], figures["traffic", 8, per_layer]
        assert traffic_4 >= traffic_8 + 0.1, figures  # what affinity routing buys
        assert traffic_4 > figures["domain", 4, per_layer], figures  # and what the scope buys
