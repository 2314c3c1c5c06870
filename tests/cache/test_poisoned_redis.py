"""What the cache-manager reads from Redis never stops it from starting (issue #11, item 2).

A request tagged `_global` once put `_global` into the Redis domain set; the global table summed
every domain, itself included, and recursed without end, so the cache-manager exited with status 3
at every start, because Redis keeps what it is given. Here Redis is poisoned with every kind of
entry the service cannot use (reserved and unknown domains, malformed routing hashes and hot sets,
keys of the wrong type, keys it does not know) and the real process is restarted on it: it starts,
serves, and counts what it skipped. Real llama-server, real Redis, the service as a real process.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from moe_l2_gguf.index import load_index

from ..conftest import ADMIN_HEADERS, LlamaServer
from .conftest import CacheManager, RedisServer
from .traffic import domain_prompt, serve_mix

pytestmark = pytest.mark.llama

SEEDED = ("math", "codegen")


@pytest.fixture
def base(demo_model: Path) -> str:
    return f"moe:{load_index(demo_model).model_id}"


def start(
    start_cache_manager: Callable[..., CacheManager], demo_model: Path, llama: LlamaServer, redis: RedisServer
) -> CacheManager:
    expert_bytes = load_index(demo_model).max_expert_bytes
    return start_cache_manager(
        MOE_L2_MODEL_PATH=str(demo_model),
        MOE_L2_LLAMA_URL=llama.url,
        MOE_L2_REDIS_URL=redis.url,
        MOE_L2_CACHE_PULL_INTERVAL_S="0",
        MOE_L2_CACHE_DWELL_S="0",
        MOE_L2_CACHE_DECAY="1",
        MOE_L2_CACHE_HOTSET_BYTES=str(6 * 8 * expert_bytes),
        MOE_L2_CACHE_POOL_BYTES=str(8 * 8 * expert_bytes),
    )


def pull(manager: CacheManager) -> dict:
    resp = manager.client.post("/v1/pull", headers=ADMIN_HEADERS)
    assert resp.status_code == 200, resp.text
    return resp.json()


def seeded_manager(
    start_cache_manager: Callable[..., CacheManager],
    demo_model: Path,
    llama: LlamaServer,
    redis: RedisServer,
    planted: dict,
) -> CacheManager:
    """A cache-manager whose Redis holds real tables of two domains; stopped, ready to be poisoned."""
    llama.routing(reset=True)
    manager = start(start_cache_manager, demo_model, llama, redis)
    serve_mix(llama.url, planted, per_domain=1, domains=SEEDED)
    body = pull(manager)
    assert body["ok"] and body["flushed"], body
    manager.stop()
    return manager


def skipped(manager: CacheManager) -> dict[str, int]:
    stats = manager.stats()
    assert stats["mode"] == "active", stats
    return stats["flywheel"]["skipped"]


def skipped_metric(manager: CacheManager, kind: str) -> float:
    text = manager.client.get("/metrics").text
    lines = [
        line for line in text.splitlines() if line.startswith(f'moe_l2_cache_skipped_entries_total{{kind="{kind}"}}')
    ]
    assert len(lines) == 1, text
    return float(lines[0].split()[-1])


def test_reserved_unknown_and_malformed_entries_are_skipped_at_start(
    cache_llama: LlamaServer,
    demo_model: Path,
    planted: dict,
    redis_server: RedisServer,
    start_cache_manager: Callable[..., CacheManager],
    base: str,
) -> None:
    manager = seeded_manager(start_cache_manager, demo_model, cache_llama, redis_server, planted)
    with redis_server.client() as r:
        stored = json.loads(r.get(f"{base}:hotset:codegen"))
        real0 = {int(e) for domain in SEEDED for e in r.hgetall(f"{base}:routing:{domain}:0")}
        # reserved, unknown and malformed domain names in the domain set, each with a table
        r.sadd(f"{base}:domains", "_global", "_x", "bad domain!", "nosuchdomain", "")
        r.hset(f"{base}:routing:_global:0", mapping={"7": "1000"})
        r.hset(f"{base}:routing:_x:0", mapping={"8": "1000"})
        r.hset(f"{base}:routing:nosuchdomain:0", mapping={"9": "1000"})
        # a known domain's table with fields that are not experts or not counts
        r.hset(
            f"{base}:routing:math:0",
            mapping={"abc": "3", "30": "notanumber", "999": "4", "-1": "2", "31": "nan", "29": "inf", "28": "-5"},
        )
        # routing hashes of layers the model does not have, or no layer at all
        r.hset(f"{base}:routing:math:99", mapping={"1": "5"})
        r.hset(f"{base}:routing:math:zz", mapping={"1": "5"})
        r.hset(f"{base}:tokens", mapping={"_global": "5", "_x": "7", "math": "lots"})
        # hot sets that do not parse, or name experts the model does not have
        r.set(f"{base}:hotset:math", "{not json")
        r.set(f"{base}:hotset:_global", "[1, 2")
        r.set(f"{base}:hotset:codegen", json.dumps({**stored, "layers": {"0": [999, 1], "77": [3]}}))
        r.hset(f"{base}:active", mapping={"domain": "_global", "since": "garbage"})
        r.set(f"{base}:garbage", "x")
        poisoned_tables = {k: r.hgetall(k) for k in (f"{base}:routing:_x:0", f"{base}:routing:nosuchdomain:0")}

    manager.start()  # before the fix: "cache-manager exited with 3" (RecursionError in the lifespan)
    assert manager.client.get("/healthz").status_code == 200

    counts = skipped(manager)
    for kind in ("domain", "routing_field", "routing_key", "hotset", "tokens_field", "unknown_key"):
        assert counts.get(kind, 0) > 0, (kind, counts)
        assert skipped_metric(manager, kind) == counts[kind]
    stats = manager.stats()
    assert stats["hints"]["active_domain"] is None  # "_global" is never restored as the active domain
    assert set(stats["flywheel"]["domains"]) == set(SEEDED)

    # hot sets: the known domains', recomputed where the stored one was unusable; none of the others
    hotsets = manager.client.get("/v1/hotsets")
    assert hotsets.status_code == 200, hotsets.text
    assert set(hotsets.json()) == set(SEEDED)
    for domain in SEEDED:
        layers = hotsets.json()[domain]["layers"]
        assert set(layers) <= {str(i) for i in range(8)}
        assert all(0 <= e < 32 for ids in layers.values() for e in ids), layers
    glob = manager.client.get("/v1/hotset/_global")
    assert glob.status_code == 200, glob.text
    for table in ("_x", "nosuchdomain"):
        assert manager.client.get(f"/v1/hotset/{table}").status_code == 404
    # the global table sums the known domains only: the poisoned tables' heavy experts 7, 8, 9 of
    # layer 0 are there only if the real traffic of the known domains put them there
    assert set(glob.json()["layers"].get("0", [])) <= real0

    # a hint pushes a valid hot set (not the stored one naming expert 999 and layer 77)
    answer = manager.client.post("/v1/hint", json={"domain": "codegen"})
    assert answer.status_code == 200 and answer.json()["switched"], answer.text
    at_llama = cache_llama.client.get("/moe/hot-set").json()
    assert at_llama["domain"] == "codegen"
    assert set(at_llama["layers"]) <= {str(i) for i in range(8)}
    assert all(0 <= e < 32 for ids in at_llama["layers"].values() for e in ids)

    # new traffic, tagged with domains the service does not know: none of them is written to Redis
    for tag in ("_y", "stranger"):
        resp = httpx.post(
            f"{cache_llama.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": domain_prompt(planted, "math")}], "max_tokens": 2},
            headers={"X-MoE-Domain": tag},
            timeout=120,
        )
        assert resp.status_code in (200, 400), resp.text
    serve_mix(cache_llama.url, planted, per_domain=1, seed=5, domains=("math",))
    body = pull(manager)
    assert body["ok"] and body["flushed"], body
    with redis_server.client() as r:
        assert not [k for k in r.scan_iter(f"{base}:*") if "_y" in k or "stranger" in k]
        members = r.smembers(f"{base}:domains")
        assert "_y" not in members and "stranger" not in members
        tokens = r.hgetall(f"{base}:tokens")
        assert "_y" not in tokens and "stranger" not in tokens and tokens["_x"] == "7"
        assert tokens["math"].isdigit()  # "lots" was replaced by a count
        for key, before in poisoned_tables.items():
            assert r.hgetall(key) == before  # never read into a table, never written
    assert manager.client.get("/healthz").status_code == 200


def test_keys_of_the_wrong_type_are_moved_aside_and_counting_goes_on(
    cache_llama: LlamaServer,
    demo_model: Path,
    planted: dict,
    redis_server: RedisServer,
    start_cache_manager: Callable[..., CacheManager],
    base: str,
) -> None:
    manager = seeded_manager(start_cache_manager, demo_model, cache_llama, redis_server, planted)
    wrong = {
        f"{base}:domains": "string",
        f"{base}:tokens": "list",
        f"{base}:active": "string",
        f"{base}:meta": "set",
        f"{base}:routing:math:0": "string",
        f"{base}:routing:codegen:3": "list",
        f"{base}:hotset:math": "hash",
    }
    with redis_server.client() as r:
        for key, kind in wrong.items():
            r.delete(key)
            if kind == "string":
                r.set(key, "garbage")
            elif kind == "list":
                r.rpush(key, "a", "b")
            elif kind == "set":
                r.sadd(key, "a")
            else:
                r.hset(key, mapping={"a": "b"})

    manager.start()
    assert manager.client.get("/healthz").status_code == 200
    counts = skipped(manager)
    assert counts.get("wrong_type", 0) >= len(wrong), counts
    assert skipped_metric(manager, "wrong_type") == counts["wrong_type"]
    assert manager.client.get("/v1/hotsets").status_code == 200
    assert manager.client.get("/v1/hotset/codegen").status_code == 200

    # the flywheel writes its tables again: counts of new traffic reach Redis
    serve_mix(cache_llama.url, planted, per_domain=1, seed=7, domains=SEEDED)
    body = pull(manager)
    assert body["ok"] and body["flushed"], body
    with redis_server.client() as r:
        assert r.type(f"{base}:domains") == "set" and r.smembers(f"{base}:domains") >= set(SEEDED)
        assert r.type(f"{base}:tokens") == "hash" and set(r.hgetall(f"{base}:tokens")) >= set(SEEDED)
        assert r.type(f"{base}:routing:math:0") == "hash" and r.hgetall(f"{base}:routing:math:0")
        assert r.type(f"{base}:meta") == "hash"
        # the unusable values were moved aside, not destroyed
        assert r.get(f"{base}:quarantine:routing:math:0") == "garbage"
    hot = manager.client.get("/v1/hotset/math")
    assert hot.status_code == 200, hot.text
    assert manager.stats()["flywheel"]["redis_ok"] is True
