"""The cache-manager end to end: the real patched llama-server on the demo model, real Redis, the service
as a real process. The demo model's planted router is the ground truth the hot sets are held to."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from moe_l2_contracts.domains import DEFAULT_DOMAINS
from moe_l2_gguf.index import load_index

from ..conftest import ADMIN_HEADERS, LlamaServer
from .conftest import CacheManager, RedisServer
from .traffic import chat, domain_prompt, llama_metrics, metric, serve_mix

pytestmark = pytest.mark.llama


@pytest.fixture
def manager(
    cache_llama: LlamaServer,
    demo_model: Path,
    redis_server: RedisServer,
    start_cache_manager: Callable[..., CacheManager],
) -> CacheManager:
    cache_llama.routing(reset=True)  # counts of earlier tests are not this test's traffic
    expert_bytes = load_index(demo_model).max_expert_bytes
    return start_cache_manager(
        MOE_L2_MODEL_PATH=str(demo_model),
        MOE_L2_LLAMA_URL=cache_llama.url,
        MOE_L2_REDIS_URL=redis_server.url,
        MOE_L2_CACHE_PULL_INTERVAL_S="0",  # pulls on demand only: the tests decide when
        MOE_L2_CACHE_DWELL_S="0",
        MOE_L2_CACHE_DECAY="1",
        MOE_L2_CACHE_HOTSET_BYTES=str(6 * 8 * expert_bytes),  # as many experts as the planted ones (6 per layer)
        MOE_L2_CACHE_POOL_BYTES=str(8 * 8 * expert_bytes),
    )


def pull(manager: CacheManager) -> dict:
    resp = manager.client.post("/v1/pull", headers=ADMIN_HEADERS)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["ok"], body
    return body


def hot_set(manager: CacheManager, domain: str) -> dict:
    resp = manager.client.get(f"/v1/hotset/{domain}")
    assert resp.status_code == 200, resp.text
    return resp.json()


def hint(manager: CacheManager, domain: str) -> dict:
    resp = manager.client.post("/v1/hint", json={"domain": domain})
    assert resp.status_code == 200, resp.text
    return resp.json()


def planted_coverage(planted: dict, domain: str, layers: dict[str, list[int]]) -> float:
    truth = planted["domains"][domain]["experts"]
    inside = sum(len(set(ids) & set(layers.get(layer, []))) for layer, ids in truth.items())
    return inside / sum(len(ids) for ids in truth.values())


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} did not happen within {timeout_s}s")


def test_hot_sets_hold_the_planted_experts_and_a_switch_pushes_them(
    manager: CacheManager, cache_llama: LlamaServer, planted: dict, redis_server: RedisServer, demo_model: Path
) -> None:
    assert manager.client.post("/v1/pull").status_code == 401  # admin call without the token
    serve_mix(cache_llama.url, planted, per_domain=3)
    body = pull(manager)
    assert body["flushed"] and set(body["domains"]) == set(DEFAULT_DOMAINS)

    figures = {}
    model_id = load_index(demo_model).model_id
    with redis_server.client() as r:
        for domain in DEFAULT_DOMAINS:
            hot = hot_set(manager, domain)
            assert hot["n_experts"] == 48 and hot["bytes"] <= hot["budget_bytes"]
            figures[domain] = planted_coverage(planted, domain, hot["layers"])
            stored = json.loads(r.get(f"moe:{model_id}:hotset:{domain}"))
            assert stored["layers"] == hot["layers"]
            assert r.hgetall(f"moe:{model_id}:routing:{domain}:0")
    print("\nplanted experts inside each domain's hot set:", json.dumps(figures))
    for domain, coverage in figures.items():
        assert coverage >= 0.9, f"{domain}: only {coverage:.0%} of its planted experts in its hot set ({figures})"

    text = manager.client.get("/v1/hotset/math", params={"format": "text"}).text.splitlines()
    assert text[0] == "# EXPERT_TOTAL 48"
    assert [int(line.split()[0]) for line in text[1:]] == list(range(8))

    # a switch pushes the domain's hot set to llama
    for domain in ("math", "codegen"):
        answer = hint(manager, domain)
        assert answer["switched"] and answer["active_domain"] == domain, answer
        at_llama = cache_llama.client.get("/moe/hot-set").json()
        assert at_llama["domain"] == domain
        assert at_llama["layers"] == {k: sorted(v) for k, v in hot_set(manager, domain)["layers"].items()}
    assert hint(manager, "codegen")["switched"] is False
    stats = manager.stats()
    assert stats["hints"]["switches"] == 2 and stats["hints"]["pushes"] == 2

    # ... and re-pins the pool: the hot set's pages are locked and resident, within the budget
    def pinned() -> bool:
        pool = manager.stats()["pool"]
        return pool["pinned_experts"] > 0 and pool["locked_bytes"] == pool["pinned_bytes"]

    wait_for(pinned, "pinning codegen's hot set")
    pool = manager.stats()["pool"]
    assert pool["lock_mode"] == "mlock"
    assert pool["tracked_bytes"] <= pool["budget_bytes"]
    assert pool["resident_bytes"] == pool["tracked_bytes"]
    metrics = manager.client.get("/metrics").text
    assert "moe_l2_cache_hotset_switches_total 2.0" in metrics
    locked = [line.split()[1] for line in metrics.splitlines() if line.startswith("moe_l2_cache_pool_locked_bytes ")]
    assert [float(v) for v in locked] == [pool["locked_bytes"]]


def test_a_domain_hot_set_beats_a_global_hot_set_of_the_same_size(
    manager: CacheManager, cache_llama: LlamaServer, planted: dict
) -> None:
    serve_mix(cache_llama.url, planted, per_domain=3)
    pull(manager)
    global_hot = hot_set(manager, "_global")

    def hit_rate(domain: str) -> float:
        before = llama_metrics(cache_llama.url)
        chat(cache_llama.url, domain_prompt(planted, domain, seed=777), domain, max_tokens=16)
        after = llama_metrics(cache_llama.url)
        hits = metric(after, "moe_hot_hits_total", domain) - metric(before, "moe_hot_hits_total", domain)
        misses = metric(after, "moe_hot_misses_total", domain) - metric(before, "moe_hot_misses_total", domain)
        return hits / (hits + misses)

    figures = {}
    for domain in DEFAULT_DOMAINS:
        assert hint(manager, domain)["switched"]
        assert global_hot["n_experts"] >= hot_set(manager, domain)["n_experts"]
        own = hit_rate(domain)
        # the global hot set, posted under the domain's own name (llama refuses reserved names)
        resp = cache_llama.client.post(
            "/moe/hot-set", json={"domain": domain, "layers": global_hot["layers"]}, headers=ADMIN_HEADERS
        )
        assert resp.status_code == 200, resp.text
        shared = hit_rate(domain)
        figures[domain] = {"domain_hot_set": round(own, 3), "global_hot_set": round(shared, 3)}
    print("\nllama's hit rate per domain, its own hot set vs the global one:", json.dumps(figures))
    for domain, f in figures.items():
        assert f["domain_hot_set"] > f["global_hot_set"], (domain, figures)


def test_redis_killed_mid_run_buffers_counts_and_flushes_them_after(
    manager: CacheManager, cache_llama: LlamaServer, planted: dict, redis_server: RedisServer, demo_model: Path
) -> None:
    domains = ("codegen", "math", "translate")
    model_id = load_index(demo_model).model_id
    k = planted["n_expert_used"]
    before = llama_metrics(cache_llama.url)

    serve_mix(cache_llama.url, planted, per_domain=1, seed=1, domains=domains)
    assert pull(manager)["flushed"]

    redis_server.kill9()
    for seed in (2, 3):
        serve_mix(cache_llama.url, planted, per_domain=1, seed=seed, domains=domains)
        body = pull(manager)
        assert body["flushed"] is False and body["buffered_cells"] > 0
    stats = manager.stats()
    assert stats["flywheel"]["redis_ok"] is False
    assert stats["flywheel"]["buffered_activations"] > 0
    assert stats["flywheel"]["dropped_activations"] == 0
    assert hint(manager, "math")["accepted"]  # still serving
    assert manager.client.get("/healthz").status_code == 200

    redis_server.start()  # same port, same AOF
    body = pull(manager)
    assert body["flushed"] and body["buffered_cells"] == 0
    after = llama_metrics(cache_llama.url)

    with redis_server.client() as r:
        tokens = r.hgetall(f"moe:{model_id}:tokens")
        for domain in domains:
            reported = metric(after, "moe_routed_tokens_total", domain) - metric(
                before, "moe_routed_tokens_total", domain
            )
            assert int(tokens[domain]) == reported, (domain, tokens, reported)
            for layer in range(planted["n_layer"] - 1):  # the last layer only sees output rows
                counts = r.hgetall(f"moe:{model_id}:routing:{domain}:{layer}")
                assert sum(float(c) for c in counts.values()) == reported * k, (domain, layer)
        total = sum(
            float(c)
            for domain in domains
            for layer in range(planted["n_layer"])
            for c in r.hgetall(f"moe:{model_id}:routing:{domain}:{layer}").values()
        )
    assert total == manager.stats()["flywheel"]["activations_pulled"]


def test_restarting_the_cache_manager_keeps_tables_and_active_domain(
    manager: CacheManager, cache_llama: LlamaServer, planted: dict
) -> None:
    serve_mix(cache_llama.url, planted, per_domain=2)
    pull(manager)
    assert hint(manager, "logic")["switched"]
    hot_sets = {d: hot_set(manager, d)["layers"] for d in DEFAULT_DOMAINS}
    cache_llama.client.post("/moe/hot-set", json={"domain": "general_qa", "layers": {}}, headers=ADMIN_HEADERS)

    # uvicorn re-raises the SIGTERM it handled once shut down, so the status says SIGTERM; the log says how
    assert manager.stop() in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in manager.log.read_text()
    manager.start()
    for domain, layers in hot_sets.items():
        assert hot_set(manager, domain)["layers"] == layers
    stats = manager.stats()
    assert stats["hints"]["active_domain"] == "logic"
    assert set(stats["flywheel"]["domains"]) >= set(DEFAULT_DOMAINS)
    # the restored active domain's hot set went back to llama
    assert cache_llama.client.get("/moe/hot-set").json()["domain"] == "logic"
    fresh = manager.client.get("/v1/hotset/logic", params={"fresh": "1"}).json()
    assert fresh["layers"] == hot_sets["logic"]  # recomputed from the tables Redis kept


def test_index_endpoints(manager: CacheManager, demo_model: Path) -> None:
    summary = manager.client.get("/v1/index").json()
    index = load_index(demo_model)
    assert summary["model_id"] == index.model_id and summary["n_expert"] == 32
    ranges = manager.client.get("/v1/index/3/7").json()["ranges"]
    assert [(r["offset"], r["length"]) for r in ranges] == [(r.offset, r.length) for r in index.expert_ranges(3, 7)]
    assert manager.client.get("/v1/index/3/99").status_code == 404
    assert manager.client.get("/v1/hotset/nosuchdomain").status_code == 404
    unauth = httpx.post(f"{manager.client.base_url}/v1/pool/evict", headers={"X-MoE-Admin-Token": "wrong"})
    assert unauth.status_code == 401
