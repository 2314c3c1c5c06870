"""The cache-manager feeds llama's expert cache (moe_l2_cache.engine_cache): the flywheel's tables become
each domain's prior, one row per layer the cache holds, and come back after llama loses them; the
transitions llama counts (patch 0032) come back as the tables its prefetch predicts with.

End to end on real parts: llama-server with the expert cache on the reduced ds-v2-lite shape, placed
with --n-cpu-moe so that the cache holds only some MoE layers; real Redis; the cache-manager as a
process, pulling llama's routing counts and pushing the priors.

The two end-to-end tests run on the RPC device (the RPC build with `--rpc` to the session's
ggml-rpc-server, tests/conftest.py): what they claim is that the tables reach the cache of the layers it
holds and drive its prefetch, which is the cache's own code on any device; the RPC device places layers
and slots as a GPU does and is free of lavapipe's fault (tests/llvmpipe_probe.py), so they run on every
CI machine. The feeder's wait without a cache runs against the CPU build, which has no cache."""

from __future__ import annotations

import http.server
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

from moe_l2_cache.engine_cache import domain_prior
from moe_l2_contracts.schemas.llama import ExpertCacheProfile, ExpertCacheShape
from moe_l2_llama.command_line import counts_transitions
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.stats import parse_metrics
from tests.test_expert_cache import EXPERT_BYTES, SHAPE, metric, serve_on
from tests.test_vulkan import PROMPTS, Model, greedy_one
from tests.test_vulkan import models as models  # the module's fixture
from tests.test_vulkan import settings as base_settings
from tests.waiting import wait_until

from ..conftest import ADMIN_HEADERS, LlamaServer, RpcDevice
from .conftest import CacheManager, RedisServer


def test_a_prior_is_each_experts_share_of_its_layers_activations() -> None:
    table = {1: {0: 3.0, 2: 1.0, 99: 5.0, 3: -1.0}, 2: {}, 5: {1: 2.0}}
    freq = domain_prior(table, [1, 2], n_expert=4)
    assert freq is not None and freq.shape == (2, 4)
    assert freq[0].tolist() == [0.75, 0.0, 0.25, 0.0]  # expert 99 is not the model's, -1 is no count
    assert freq[1].tolist() == [0.25] * 4  # no counts: no preference
    assert np.allclose(freq.sum(axis=1), 1.0)
    assert domain_prior({5: {1: 2.0}}, [1, 2], n_expert=4) is None  # nothing in the cached layers


def sample(manager: CacheManager, name: str) -> float:
    samples = parse_metrics(manager.client.get("/metrics").text)
    assert f"moe_l2_cache_{name}" in samples, f"moe_l2_cache_{name} missing from /metrics"
    return sum(v for _, v in samples[f"moe_l2_cache_{name}"])


def wait_for(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


@contextmanager
def counting_forwarder(upstream: str) -> Iterator[tuple[str, Counter[tuple[str, str]]]]:
    """An HTTP forwarder to `upstream` that counts what passes by (method, path): its URL and the counts.
    Put between a service and llama, it shows what the service asks and how often."""
    counts: Counter[tuple[str, str]] = Counter()
    client = httpx.Client(base_url=upstream, timeout=30)
    hop_by_hop = {"host", "connection", "content-length", "transfer-encoding", "content-encoding"}

    class Forward(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            counts[self.command, self.path.split("?", 1)[0]] += 1
            headers = {k: v for k, v in self.headers.items() if k.lower() not in hop_by_hop}
            resp = client.request(self.command, self.path, content=body, headers=headers)
            self.send_response(resp.status_code)
            for key, value in resp.headers.items():
                if key.lower() not in hop_by_hop:
                    self.send_header(key, value)
            self.send_header("content-length", str(len(resp.content)))
            self.end_headers()
            self.wfile.write(resp.content)

        do_GET = do_POST = do_DELETE = forward

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", counts
    finally:
        server.shutdown()
        server.server_close()
        client.close()


def two_layer_cache() -> LlamaSettings:
    """--n-cpu-moe 3 of 4 layers: layer 0 is dense, so the cache holds MoE layers 1 and 2, not 3."""
    s = base_settings(gpu_layers=99, n_cpu_moe=3, extra_args="-lv 4")
    return s.model_copy(update={"expert_cache_bytes": str(16 * EXPERT_BYTES * 2), "telemetry": True})


def start_feeder(
    start_cache_manager: Callable[..., CacheManager], model: Path, llama: httpx.Client, redis: RedisServer, **env: str
) -> CacheManager:
    """The cache-manager pulling llama's counts and pushing its tables twice a second, counts not decayed."""
    return start_cache_manager(
        MOE_L2_MODEL_PATH=str(model),
        MOE_L2_LLAMA_URL=str(llama.base_url),
        MOE_L2_REDIS_URL=redis.url,
        MOE_L2_CACHE_PULL_INTERVAL_S="0.5",
        MOE_L2_CACHE_ENGINE_PROFILE_INTERVAL_S="0.5",
        MOE_L2_CACHE_DECAY="1",
        **env,
    )


def cache_shape(client: httpx.Client) -> ExpertCacheShape:
    resp = client.get("/moe/cache")
    assert resp.status_code == 200, resp.text
    return ExpertCacheShape.model_validate(resp.json())


@pytest.mark.llama
@pytest.mark.slow
def test_the_flywheel_tables_reach_the_cache_of_the_layers_it_holds(
    rpc_device: RpcDevice,
    models: dict[str, Model],
    redis_server: RedisServer,
    start_cache_manager: Callable[..., CacheManager],
    tmp_path: Path,
) -> None:
    model = models["ds-v2-lite"]
    with serve_on(rpc_device, model.path, two_layer_cache(), {}, tmp_path) as (client, _):
        shape = cache_shape(client)
        assert (shape.layers, shape.n_slot, shape.n_expert, shape.profile) == ([1, 2], 16, SHAPE.n_expert, [])
        assert shape.slot_bytes == EXPERT_BYTES and shape.device_bytes >= 16 * 2 * EXPERT_BYTES

        manager = start_feeder(start_cache_manager, model.path, client, redis_server)
        for i, domain in enumerate(["codegen", "codegen", "translate"]):
            greedy_one(client, PROMPTS[i % 2], 4, {"X-MoE-Domain": domain})
        wait_for(lambda: cache_shape(client).profile == ["codegen", "translate"], "both domains' priors in llama")
        assert sample(manager, "engine_cache_layers") == 2
        assert sample(manager, "engine_profile_pushes_total") >= 2
        assert sample(manager, "engine_profile_errors_total") == 0

        # llama loses a domain's tables (as after a restart): the feeder sends them again within an interval
        removed = client.post(
            "/moe/cache/profile", json=ExpertCacheProfile(domain="codegen").model_dump(), headers=ADMIN_HEADERS
        )
        assert removed.status_code == 200, removed.text
        assert (removed.json()["freq"], removed.json()["transitions"]) == (False, False)
        pushes = sample(manager, "engine_profile_pushes_total")
        wait_for(lambda: sample(manager, "engine_profile_pushes_total") >= pushes + 2, "another round of pushes")
        assert cache_shape(client).profile == ["codegen", "translate"]

        # Redis down: rounds fail with one log line and no traceback, llama keeps its priors; back up, they go on
        redis_server.stop()
        wait_for(lambda: sample(manager, "engine_profile_errors_total") >= 2, "rounds failing without Redis")
        assert cache_shape(client).profile == ["codegen", "translate"]
        redis_server.start()
        pushes = sample(manager, "engine_profile_pushes_total")
        wait_for(lambda: sample(manager, "engine_profile_pushes_total") >= pushes + 2, "pushes after Redis is back")
    log = manager.log.read_text()
    assert log.count("Redis unreachable, the priors are not updated") == 1
    assert "Traceback" not in log


@pytest.mark.llama
@pytest.mark.slow
def test_learned_transitions_reach_the_cache_and_drive_its_prefetch(
    rpc_device: RpcDevice,
    models: dict[str, Model],
    redis_server: RedisServer,
    start_cache_manager: Callable[..., CacheManager],
    tmp_path: Path,
) -> None:
    model = models["ds-v2-lite"]
    # the cache holds MoE layers 1 and 2 (adjacent): its table of transitions is the pair (1, 2)
    s = two_layer_cache()
    assert counts_transitions(s)  # on with the cache, unless MOE_L2_LLAMA_TRANSITIONS says otherwise
    codegen = {"X-MoE-Domain": "codegen"}
    with serve_on(rpc_device, model.path, s, {}, tmp_path) as (client, _):
        # without tables the default policy has nothing to predict with: no prefetch
        alone = greedy_one(client, PROMPTS[1], 8, codegen)
        assert metric(client, "moe_cache_prefetch_total") == 0
        manager = start_feeder(
            start_cache_manager, model.path, client, redis_server, MOE_L2_CACHE_ENGINE_TRANSITIONS_MIN_TOKENS="40"
        )
        wait_for(lambda: sample(manager, "engine_profile_pushes_total") >= 1, "the first request's prior pushed")
        assert sample(manager, "flywheel_tokens_total") < 40
        assert sample(manager, "engine_profile_transition_pushes_total") == 0  # too few tokens to fit a table
        for i in range(3):
            greedy_one(client, PROMPTS[i % 2], 8, codegen)
        wait_for(lambda: sample(manager, "engine_profile_transition_pushes_total") >= 1, "learned transitions pushed")
        assert sample(manager, "flywheel_transitions_total") > 0

        prefetched, used = metric(client, "moe_cache_prefetch_total"), metric(client, "moe_cache_prefetch_used_total")
        again = greedy_one(client, PROMPTS[1], 8, codegen)
        # the learned table predicts layer 2 from layer 1, and some of its guesses are used
        assert metric(client, "moe_cache_prefetch_total") > prefetched
        assert metric(client, "moe_cache_prefetch_used_total") > used
        assert again == alone  # prefetching changes what is copied when, never the tokens
    assert "Traceback" not in manager.log.read_text()


@pytest.mark.llama
def test_without_the_cache_the_feeder_waits_quietly(
    cache_llama: LlamaServer,
    demo_model: Path,
    redis_server: RedisServer,
    start_cache_manager: Callable[..., CacheManager],
) -> None:
    assert cache_llama.client.get("/moe/cache").status_code == 501  # the CPU build: no expert cache
    # the feeder's rounds are what it asks llama: one GET /moe/cache each, counted on the way
    with counting_forwarder(cache_llama.url) as (llama_url, asked):
        manager = start_cache_manager(
            MOE_L2_MODEL_PATH=str(demo_model),
            MOE_L2_LLAMA_URL=llama_url,
            MOE_L2_REDIS_URL=redis_server.url,
            MOE_L2_CACHE_PULL_INTERVAL_S="0",
            MOE_L2_CACHE_ENGINE_PROFILE_INTERVAL_S="0.2",
        )
        wait_until(lambda: asked["GET", "/moe/cache"] >= 4, 30, "four rounds of the feeder (a GET /moe/cache each)")
        rounds = asked["GET", "/moe/cache"]
        pushes, errors = sample(manager, "engine_profile_pushes_total"), sample(manager, "engine_profile_errors_total")
        assert (pushes, errors) == (0, 0), f"after {rounds} rounds"
        assert sample(manager, "engine_cache_layers") == 0
        assert not asked["POST", "/moe/cache/profile"], "a prior was sent to a llama without the cache"
        log = manager.log.read_text()
        assert log.count("llama runs without the expert cache") == 1, f"said once in {rounds} rounds, not every round"
