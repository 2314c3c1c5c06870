"""The expert cache in llama-server (patches 0004, 0009-0019 and 0026-0032, `--moe-cache-bytes`), on a device.

Which device, and why it proves the claim (docs/test-bed.md, "The RPC device"):
- Every test runs on the **RPC device**: the RPC build's llama-server with `--rpc` to one
  ggml-rpc-server (CPU backend) for the session. llama.cpp's scheduler treats it as a GPU: the layers
  of `-ngl 99` go there, `--cpu-moe` keeps the experts in host memory, the cache's slabs are allocated
  in its memory, the expert ids are remapped to slots and the misses copied there, over the socket, as
  they would be over PCIe; its device has events, so the prefetch gets its second backend (patch 0015)
  as on a GPU. So the cache's remap, slots, policy, preloads, prefetch and counters run their real
  code, and a token that differs from the cache-off run on the same device is a fault of the cache.
  The device computes with the CPU backend's kernels: no Mesa fault is in the way (lavapipe faults on
  some machines, tests/llvmpipe_probe.py), and it is the same on every CI machine.
- `test_64_tokens_under_the_esft_trace_equal_the_cache_off[vulkan]` runs on **llvmpipe** as well: the
  slots, copies and events are then a GPU backend's own (ggml-vulkan's buffers and queues). Its 25-token
  prompt and one-row decode steps are clear of lavapipe's fault, the batches the probe checks.
- `test_a_cpu_build_refuses_the_cache` and the flag parser's tests run the CPU build: no device at all.

The reduced `ds-v2-lite` shape (3 MoE layers of 64 experts, top-6, Q4_K/Q4_0 experts) runs with its
experts in host memory (`--cpu-moe`) and the cache on the device:
- greedy tokens equal the same build's with the cache off (`--cpu-moe` alone) at 7 slots per layer
  (one above top-k), 16 (a quarter) and 64 (all), with either policy, and with two concurrent
  requests. The reference is the same build and device with the cache off: on Vulkan the device's
  attention and dense layers round differently from the CPU build (measured 2026-12-02: the two builds
  part after 4 greedy tokens on this random-weight model), so only the cache is compared;
- the engine's counters equal the Python replay of its own access log (moe_l2_cache.policy.replay),
  exactly, for `lru` and the default;
- with the flywheel's routing profile (POST /moe/cache/profile: per-domain priors and cross-layer
  transitions fitted on the ESFT trace, which the server replays as its routing), the default policy
  prefetches; tokens still equal the cache off, and the engine's hits, loads and prefetches equal the
  replay given the same tables, across a domain switch;
- a hot set (POST /moe/hot-set, a domain switch) pre-loads its experts before the next micro-batch,
  the first n_slot - top-k of each cached layer in the set's order; the engine's counts, preloads
  included, equal the replay of its log, and the tokens equal the cache off;
- a budget given as a share of the free device memory (`--moe-cache-bytes N%`) takes that share of what
  the device reports and holds the slots those bytes hold;
- budgets that cannot work are one clear line: below top-k or on a CPU build refuses to start, a
  model with every expert on the device runs without the cache.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

from moe_l2_cache.policy.profile import fit_profile
from moe_l2_cache.policy.replay import DomainTables, read_access_log, replay_accesses
from moe_l2_contracts.admin import ADMIN_TOKEN_HEADER
from moe_l2_contracts.schemas.llama import ExpertCacheProfile, ExpertCacheProfileResult, ExpertCacheShape, decode_f32
from moe_l2_gguf.model_shapes import get_shape, sizes, tensor_plan
from moe_l2_llama.command_line import llama_server_command, llama_server_env
from moe_l2_llama.route_trace import from_esft_npz, write_route_trace
from moe_l2_llama.settings import LlamaSettings
from moe_l2_llama.vulkan_env import device_env
from moe_l2_ops.doctor import check_expert_cache
from moe_l2_ops.stats import OpsSettings, expert_cache_summary, parse_metrics, render_expert_cache
from tests.conftest import ON_RPC_AND_LLVMPIPE, EngineDevice, RpcDevice
from tests.observability.test_observability import DASHBOARD, metric_names, needs_expert_cache, query_panels
from tests.test_route_trace import ESFT_NPZ
from tests.test_vulkan import DS_LAYERS, DS_VOCAB, PROMPTS, Model, greedy, greedy_one, serve
from tests.test_vulkan import models as models  # the module's fixture
from tests.test_vulkan import settings as base_settings

pytestmark = [pytest.mark.llama, pytest.mark.slow]


SHAPE = get_shape("ds-v2-lite").reduced(DS_LAYERS, DS_VOCAB)
N_MOE = DS_LAYERS - SHAPE.n_dense_lead
EXPERT_BYTES = sizes(SHAPE).expert_bytes  # gate + up + down of one expert: one slot


@contextmanager
def serve_on(
    device: EngineDevice, model: Path, s: LlamaSettings, env: dict[str, str], logs: Path
) -> Iterator[tuple[httpx.Client, Path]]:
    """llama-server of the device's build, placed on the device."""
    with serve(device.binary, model, device.on_device(s), env, logs) as served:
        yield served


def budget(slots: int) -> str:
    return str(slots * EXPERT_BYTES * N_MOE)


# the two buffers of a prompt's copies one expert tensor ahead (patch 0021): twice the largest expert tensor
AHEAD_BYTES = 2 * max(t.nbytes for t in tensor_plan(SHAPE) if t.role == "expert")


def with_prompt_ahead(s: LlamaSettings, slots: int) -> LlamaSettings:
    """The cache of `slots` slots with the copies ahead forced on: their buffers come out of the bytes, so the
    budget is the slots' and the buffers' (and a MiB for a device's padding of them, under one more slot)."""
    return s.model_copy(
        update={
            "expert_cache_bytes": str(int(budget(slots)) + AHEAD_BYTES + 2**20),
            "extra_args": f"{s.extra_args} --moe-cache-prompt-ahead on",
        }
    )


def cache_settings(slots: int, policy: str = "default", parallel: int = 1) -> LlamaSettings:
    s = base_settings(gpu_layers=99, extra_args="--cpu-moe -lv 4")
    return s.model_copy(
        update={"expert_cache_bytes": budget(slots), "expert_cache_policy": policy, "parallel": parallel}
    )


def metric(client: httpx.Client, name: str) -> int:
    text = client.get("/metrics").text
    found = re.search(rf"^llamacpp:{name} (\d+)$", text, re.M)
    assert found, f"{name} missing from /metrics"
    return int(found[1])


N_PREDICT = 8
_cache_off: dict[tuple[str, str], list[list[int]]] = {}


def cache_off_reference(device: EngineDevice, model: Model, logs: Path) -> list[list[int]]:
    """The device's greedy tokens with the experts in host memory and no cache, once per device and model:
    the RPC device's and llvmpipe's kernels round differently, and a reference of the one compared with
    the other's cache flipped a near-tie (2026-12-07: the llvmpipe `auto` test after the RPC ones)."""
    key = (device.device, model.name)
    if key not in _cache_off:
        s = base_settings(gpu_layers=99, extra_args="--cpu-moe -lv 4")
        with serve_on(device, model.path, s, {}, logs) as (client, _):
            _cache_off[key] = greedy(client, N_PREDICT)
    return _cache_off[key]


@pytest.mark.parametrize(
    ("slots", "policy"),
    [(SHAPE.n_expert_used + 1, "default"), (SHAPE.n_expert_used + 1, "lru"), (16, "default"), (64, "default")],
    ids=["top-k+1-default", "top-k+1-lru", "quarter-default", "all-default"],
)
def test_greedy_tokens_equal_the_cache_off(
    rpc_device: RpcDevice, models: dict[str, Model], slots: int, policy: str, tmp_path: Path
) -> None:
    model = models["ds-v2-lite"]
    expected = cache_off_reference(rpc_device, model, tmp_path)
    with serve_on(rpc_device, model.path, cache_settings(slots, policy), {}, tmp_path) as (client, log_path):
        got = greedy(client, N_PREDICT)
        hits, accesses, loads = (metric(client, f"moe_cache_{m}_total") for m in ("hits", "accesses", "loads"))
        log_text = log_path.read_text(errors="replace")
    rpc_device.assert_holds_the_model(log_text)
    assert f"expert cache: {slots} of {SHAPE.n_expert} experts per layer" in log_text
    assert got == expected
    assert accesses > 0 and loads > 0 and loads == accesses - hits
    if slots == SHAPE.n_expert:
        assert loads <= SHAPE.n_expert * N_MOE  # all fit: each expert is loaded at most once


@pytest.mark.parametrize("policy", ["lru", "default"])
def test_the_engine_counts_what_the_python_policy_replays(
    rpc_device: RpcDevice, models: dict[str, Model], policy: str, tmp_path: Path
) -> None:
    model = models["ds-v2-lite"]
    log = tmp_path / "access.log"
    slots = 16
    env = {"LLAMA_ARG_MOE_CACHE_LOG": str(log)}
    with serve_on(rpc_device, model.path, cache_settings(slots, policy), env, tmp_path) as (client, _):
        greedy(client, 12)
        engine = {m: metric(client, f"moe_cache_{m}_total") for m in ("accesses", "hits", "loads", "bypass")}
    accesses = read_access_log(log)
    assert {a.layer for a in accesses} == set(range(N_MOE))
    replay = replay_accesses(accesses, policy, N_MOE, SHAPE.n_expert, slots, SHAPE.n_expert_used)
    assert replay.accesses > 100 and 0 < replay.hits < replay.accesses
    assert engine == {"accesses": replay.accesses, "hits": replay.hits, "loads": replay.loads, "bypass": replay.bypass}


@pytest.mark.parametrize("policy", ["lru", "default"])
def test_a_hot_set_preloads_the_cache_as_the_replay_does(
    rpc_device: RpcDevice, models: dict[str, Model], policy: str, tmp_path: Path
) -> None:
    model = models["ds-v2-lite"]
    expected = cache_off_reference(rpc_device, model, tmp_path)
    log = tmp_path / "access.log"
    slots = 16
    s = cache_settings(slots, policy).model_copy(update={"admin_token": TOKEN})
    # per MoE layer 12 experts, most used first: the cache takes the first 16 - 6 and keeps its 6 best
    hot = list(range(63, 51, -1))
    moe_layers = range(SHAPE.n_dense_lead, DS_LAYERS)
    with serve_on(rpc_device, model.path, s, {"LLAMA_ARG_MOE_CACHE_LOG": str(log)}, tmp_path) as (client, _):
        first = greedy_one(client, PROMPTS[0], N_PREDICT)
        assert metric(client, "moe_cache_preload_total") == 0
        resp = client.post(
            "/moe/hot-set",
            json={"domain": "math", "layers": {str(il): hot for il in moe_layers}},
            headers={ADMIN_TOKEN_HEADER: TOKEN},
        )
        assert resp.status_code == 200, resp.text
        second = greedy_one(client, PROMPTS[1], N_PREDICT)
        names = ("accesses", "hits", "loads", "bypass", "preload")
        engine = {m: metric(client, f"moe_cache_{m}_total") for m in names}
        summary = expert_cache_summary(parse_metrics(client.get("/metrics").text))
    assert [first, second] == expected  # a preload changes what is resident, never the tokens
    assert summary is not None and summary["preload"] == engine["preload"]
    assert f", pre-loaded {engine['preload']} on domain switches" in render_expert_cache(summary)
    accesses = read_access_log(log)
    preloads = [a for a in accesses if a.preload]
    taken = tuple(hot[: slots - SHAPE.n_expert_used])
    assert [(a.layer, a.experts) for a in preloads] == [(li, taken) for li in range(N_MOE)]
    replay = replay_accesses(accesses, policy, N_MOE, SHAPE.n_expert, slots, SHAPE.n_expert_used)
    assert replay.preload > 0
    assert engine == {m: getattr(replay, m) for m in names}


def test_two_concurrent_requests_get_the_tokens_they_get_alone(
    rpc_device: RpcDevice, models: dict[str, Model], tmp_path: Path
) -> None:
    model = models["ds-v2-lite"]
    expected = cache_off_reference(rpc_device, model, tmp_path)
    with serve_on(rpc_device, model.path, cache_settings(SHAPE.n_expert_used + 2, parallel=2), {}, tmp_path) as (
        client,
        _,
    ):
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda prompt: greedy_one(client, prompt, N_PREDICT), PROMPTS))
    assert got == expected


TOKEN = "test-admin-token"


def post_profile(client: httpx.Client, profile: ExpertCacheProfile, token: str = TOKEN) -> httpx.Response:
    return client.post("/moe/cache/profile", json=profile.model_dump(), headers={ADMIN_TOKEN_HEADER: token})


_esft_cache_off: dict[str, list[int]] = {}


@pytest.mark.skipif(not ESFT_NPZ.is_file(), reason=f"the ESFT routing data is not at {ESFT_NPZ}")
@ON_RPC_AND_LLVMPIPE
@pytest.mark.parametrize("ahead", [False, True], ids=["", "prompt-ahead"])
def test_64_tokens_under_the_esft_trace_equal_the_cache_off(
    device: EngineDevice, models: dict[str, Model], ahead: bool, tmp_path: Path
) -> None:
    """The routing DeepSeek-V2-Lite had on an ESFT prompt (LLAMA_MOE_ROUTE_TRACE), 64 greedy tokens, a
    quarter of the experts in the cache with the default policy prefetching by a profile fitted on
    other sequences of the same task: the tokens equal the cache-off run's. On both devices: on
    llvmpipe the slots, copies and the second backend's events are ggml-vulkan's own (a GPU backend's
    buffers and queues), with a 25-token prompt and one-row decode steps, clear of lavapipe's fault.
    With the prompt's copies one expert tensor ahead forced on (patch 0021), on that second backend too."""
    model = models["ds-v2-lite"]
    law = from_esft_npz(ESFT_NPZ, tasks=["law"], seqs=slice(0, 30), layers=N_MOE)
    trace = tmp_path / "law.trace"
    write_route_trace(law, trace)
    first = int(law.offsets[2])  # the sequence the request replays (0, or 1 after a warm-up) is not fitted on
    fitted = fit_profile(law.ids[first:], ["logic"] * (law.n_token - first), SHAPE.n_expert)
    env = {"LLAMA_MOE_ROUTE_TRACE": str(trace)}
    headers = {"X-MoE-Domain": "logic"}
    n_tokens = 64

    if device.device not in _esft_cache_off:  # once per device for both variants: llvmpipe takes minutes
        off = base_settings(gpu_layers=99, extra_args="--cpu-moe -lv 4")
        with serve_on(device, model.path, off, env, tmp_path) as (client, _):
            _esft_cache_off[device.device] = greedy_one(client, PROMPTS[1], n_tokens, headers)
    expected = _esft_cache_off[device.device]

    on = cache_settings(16).model_copy(update={"admin_token": TOKEN})
    if ahead:
        on = with_prompt_ahead(on, 16)
    with serve_on(device, model.path, on, env, tmp_path) as (client, log_path):
        log_text = log_path.read_text()
        device.assert_holds_the_model(log_text)
        assert copy_stream_line(device) in log_text  # the prefetch's copies run on a second backend
        assert metric(client, "moe_cache_slots") == 16
        body = ExpertCacheProfile.from_tables(
            "logic", freq=fitted.domain_freq["logic"], transitions=fitted.domain_transitions["logic"]
        )
        assert post_profile(client, body).status_code == 200
        got = greedy_one(client, PROMPTS[1], n_tokens, headers)
        loads, prefetched = metric(client, "moe_cache_loads_total"), metric(client, "moe_cache_prefetch_total")
        ahead_bytes = metric(client, "moe_cache_ahead_bytes_total")
    assert got == expected
    assert loads > 0 and prefetched > 0
    assert (ahead_bytes > 0) == ahead


def domain_counters(client: httpx.Client) -> dict[str, tuple[int, int]]:
    """domain -> (accesses, hits) of the cache's per-domain counters."""
    samples = parse_metrics(client.get("/metrics").text)
    hits = {labels["domain"]: v for labels, v in samples["llamacpp:moe_cache_domain_hits_total"]}
    return {labels["domain"]: (int(v), int(hits[labels["domain"]])) for labels, v in
            samples["llamacpp:moe_cache_domain_accesses_total"]}  # fmt: skip


TWO_DOMAINS = ("logic", "translate")


def two_domain_profiles() -> list[ExpertCacheProfile]:
    """A profile per domain of TWO_DOMAINS, fitted on two ESFT tasks (law, translation) cut to the model's layers."""
    law = from_esft_npz(ESFT_NPZ, tasks=["law"], seqs=slice(0, 20), layers=N_MOE)
    translation = from_esft_npz(ESFT_NPZ, tasks=["translation"], seqs=slice(0, 20), layers=N_MOE)
    fitted = fit_profile(
        np.concatenate([law.ids, translation.ids]),
        ["logic"] * law.n_token + ["translate"] * translation.n_token,
        SHAPE.n_expert,
    )
    return [
        ExpertCacheProfile.from_tables(d, freq=fitted.domain_freq[d], transitions=fitted.domain_transitions[d])
        for d in TWO_DOMAINS
    ]


def both_at_once(client: httpx.Client, lengths: tuple[int, int]) -> list[list[int]]:
    """PROMPTS[0] and PROMPTS[1] at once, tagged with TWO_DOMAINS[0] and [1]: their greedy tokens."""
    with ThreadPoolExecutor(2) as pool:
        return list(
            pool.map(lambda i: greedy_one(client, PROMPTS[i], lengths[i], {"X-MoE-Domain": TWO_DOMAINS[i]}), [0, 1])
        )


@pytest.mark.skipif(not ESFT_NPZ.is_file(), reason=f"the ESFT routing data is not at {ESFT_NPZ}")
def test_two_concurrent_requests_of_two_domains_with_prefetch_get_the_tokens_they_get_alone(
    rpc_device: RpcDevice, models: dict[str, Model], tmp_path: Path
) -> None:
    """-np 2, a request of each domain at once, each domain with its own prior and transitions (fitted on
    two ESFT tasks, cut to the model's layers): the cache prefetches and switches tables between
    micro-batches, and the tokens are still the cache-off ones. Each domain's counters charge it the
    experts its own tokens used: the accesses of each are what the same request counts alone."""
    model = models["ds-v2-lite"]
    # A micro-batch of both requests is of no domain: no prior, no transitions, no prefetch. Whether the two
    # ever decode apart depends on when each arrives (CI once had them in step all the way: 0 prefetches),
    # so the second asks for more tokens and decodes its last ones alone, whatever the timing.
    lengths = (N_PREDICT, 3 * N_PREDICT)
    off = base_settings(gpu_layers=99, extra_args="--cpu-moe -lv 4")
    with serve_on(rpc_device, model.path, off, {}, tmp_path) as (client, _):
        expected = [greedy_one(client, PROMPTS[i], lengths[i]) for i in (0, 1)]
    bodies = two_domain_profiles()
    domains = list(TWO_DOMAINS)

    on = cache_settings(SHAPE.n_expert_used + 2, parallel=2).model_copy(update={"admin_token": TOKEN})
    with serve_on(rpc_device, model.path, on, {}, tmp_path) as (client, _):
        assert all(post_profile(client, body).status_code == 200 for body in bodies)
        got = both_at_once(client, lengths)
        prefetched = metric(client, "moe_cache_prefetch_total")
    assert got == expected
    assert prefetched > 0

    # Attribution: the requests together, then each alone. A domain's accesses do not depend on what is
    # resident, so each is charged the same both times, when (1) every expert fits (a micro-batch over the
    # slots is left to the default copy and counted nowhere) and (2) the routing is the same: the model's
    # own router picks differently when its matmuls run for two tokens instead of one (measured: 187/279
    # accesses together against 189/231 alone), so every request replays one ESFT sequence; and (3) each
    # request's rows fall into the same micro-batches: with a KV stream per slot the server splits a batch
    # of two sequences into micro-batches of equal rows per sequence, so a prompt that arrives while the
    # other request decodes runs in pieces (measured: translate charged 273 instead of 239, 1 run in 6),
    # hence -kvu, one stream, where a prompt stays one micro-batch. Alone, a domain's counters are the
    # totals' increments.
    one_sequence = tmp_path / "one.trace"
    write_route_trace(from_esft_npz(ESFT_NPZ, tasks=["law"], seqs=slice(0, 1), layers=N_MOE), one_sequence)
    every = cache_settings(SHAPE.n_expert, parallel=2).model_copy(
        update={"admin_token": TOKEN, "extra_args": "--cpu-moe -lv 4 -kvu"}
    )
    with serve_on(rpc_device, model.path, every, {"LLAMA_MOE_ROUTE_TRACE": str(one_sequence)}, tmp_path) as (
        client,
        _,
    ):
        assert all(post_profile(client, body).status_code == 200 for body in bodies)
        before = domain_counters(client)
        assert set(before) == {"untagged"}  # the server's warm-up
        both_at_once(client, (N_PREDICT, N_PREDICT))
        together = domain_counters(client)
        assert all(0 < together[d][1] <= together[d][0] for d in domains)
        alone: dict[str, int] = {}
        for i, domain in enumerate(domains):
            start = domain_counters(client)[domain]
            accesses, hits = metric(client, "moe_cache_accesses_total"), metric(client, "moe_cache_hits_total")
            greedy_one(client, PROMPTS[i], N_PREDICT, {"X-MoE-Domain": domain})
            end = domain_counters(client)[domain]
            own = (metric(client, "moe_cache_accesses_total") - accesses, metric(client, "moe_cache_hits_total") - hits)
            assert (end[0] - start[0], end[1] - start[1]) == own
            alone[domain] = own[0]
    assert {d: together[d][0] for d in domains} == alone


@pytest.mark.skipif(not ESFT_NPZ.is_file(), reason=f"the ESFT routing data is not at {ESFT_NPZ}")
def test_the_flywheel_profile_drives_prefetch_exactly_as_the_python_policy(
    rpc_device: RpcDevice, models: dict[str, Model], tmp_path: Path
) -> None:
    model = models["ds-v2-lite"]
    # two ESFT tasks, a few sequences each, cut to the model's 3 MoE layers: the server replays them as its
    # routing, request r taking sequence r, so the routing has the real model's cross-layer structure
    law = from_esft_npz(ESFT_NPZ, tasks=["law"], seqs=slice(0, 3), layers=N_MOE)
    translation = from_esft_npz(ESFT_NPZ, tasks=["translation"], seqs=slice(0, 3), layers=N_MOE)
    # tagged with two of the server's domains (LLAMA_ARG_MOE_DOMAINS is the closed default set)
    fitted = fit_profile(
        np.concatenate([law.ids, translation.ids]),
        ["logic"] * law.n_token + ["translate"] * translation.n_token,
        SHAPE.n_expert,
    )
    assert fitted.transitions is not None
    trace = tmp_path / "esft.trace"
    write_route_trace(
        type(law)(
            ids=np.concatenate([law.ids, translation.ids]),
            offsets=np.concatenate([law.offsets, law.offsets[-1] + translation.offsets[1:]]).astype(np.int32),
            n_expert=law.n_expert,
        ),
        trace,
    )
    bodies = [
        ExpertCacheProfile.from_tables(None, transitions=fitted.transitions),
        ExpertCacheProfile.from_tables(
            "logic", freq=fitted.domain_freq["logic"], transitions=fitted.domain_transitions["logic"]
        ),
        ExpertCacheProfile.from_tables("translate", freq=fitted.domain_freq["translate"]),
    ]
    env = {"LLAMA_MOE_ROUTE_TRACE": str(trace)}
    # the requests, in trace order: law's three sequences, then translation's, each with its domain
    requests = [(PROMPTS[i % 2], "logic") for i in range(3)] + [(PROMPTS[i % 2], "translate") for i in range(3)]

    off = base_settings(gpu_layers=99, extra_args="--cpu-moe -lv 4")
    with serve_on(rpc_device, model.path, off, env, tmp_path) as (client, _):
        expected = [greedy_one(client, p, N_PREDICT, {"X-MoE-Domain": d}) for p, d in requests]

    slots = 16
    log = tmp_path / "access.log"
    on = cache_settings(slots).model_copy(update={"admin_token": TOKEN})
    with serve_on(rpc_device, model.path, on, {**env, "LLAMA_ARG_MOE_CACHE_LOG": str(log)}, tmp_path) as (client, _):
        # bad bodies are 400s that say what is wrong, a wrong token a 401; nothing is applied
        wrong = ExpertCacheProfile.from_tables(None, transitions=fitted.transitions[:1])
        resp = post_profile(client, wrong)
        assert resp.status_code == 400 and "the cache needs 2 layer pairs x 64 x 64 experts" in resp.text
        assert post_profile(client, ExpertCacheProfile(domain="_x")).status_code == 400
        assert post_profile(client, bodies[0], token="wrong").status_code == 401
        for body in bodies:
            resp = post_profile(client, body)
            assert resp.status_code == 200, resp.text
            result = ExpertCacheProfileResult.model_validate(resp.json())
            assert (result.n_layer, result.n_expert) == (N_MOE, SHAPE.n_expert)
        # GET /moe/cache: the model layers the tables are for, the domains that have tables; doctor says so
        shape = ExpertCacheShape.model_validate(client.get("/moe/cache").json())
        assert (shape.layers, shape.n_slot, shape.profile) == ([1, 2, 3], slots, ["untagged", "logic", "translate"])
        doctor = check_expert_cache(OpsSettings(llama_url=str(client.base_url)))
        assert doctor is not None and doctor.status == "pass"
        assert doctor.detail.startswith(f"{slots} of 64 experts per layer for 3 layers (1-3)")
        assert doctor.detail.endswith("priors for 3 domains")
        got = [greedy_one(client, p, N_PREDICT, {"X-MoE-Domain": d}) for p, d in requests]
        names = ("accesses", "hits", "loads", "prefetch", "prefetch_used")
        engine = {m: metric(client, f"moe_cache_{m}_total") for m in names}
        samples = parse_metrics(client.get("/metrics").text)
    assert got == expected

    # what `moe-l2 stats` and the dashboard's cache panels read is there, and adds up
    summary = expert_cache_summary(samples)
    assert summary is not None and summary["slots"] == slots and summary["layers"] == N_MOE
    assert summary["hit_rate"] == round(engine["hits"] / engine["accesses"], 4)
    assert summary["h2d_bytes_per_token"] and summary["h2d_bytes_per_token"] > 0
    # one request at a time: every micro-batch is of one domain, so the domains' counters add up to the totals
    by_domain = {
        name: {labels["domain"]: int(v) for labels, v in samples[f"llamacpp:moe_cache_domain_{name}_total"]}
        for name in ("accesses", "hits", "prefetch", "prefetch_used", "h2d_bytes")
    }
    assert set(by_domain["accesses"]) == {"untagged", "logic", "translate"}  # untagged: the server's warm-up
    assert (sum(by_domain["accesses"].values()), sum(by_domain["hits"].values())) == (
        engine["accesses"],
        engine["hits"],
    )
    assert sum(by_domain["prefetch"].values()) == engine["prefetch"]
    assert sum(by_domain["prefetch_used"].values()) == engine["prefetch_used"]
    assert by_domain["h2d_bytes"] == {
        d: (by_domain["accesses"][d] - by_domain["hits"][d] + by_domain["prefetch"][d]) * shape.slot_bytes
        for d in by_domain["accesses"]
    }
    assert set(summary["hit_rate_by_domain"]) == {"untagged", "logic", "translate"}
    assert summary["h2d_bytes_by_domain"] == by_domain["h2d_bytes"]
    rendered = render_expert_cache(summary)
    assert "(per domain: logic " in rendered and " copied, translate " in rendered
    panels = [p for p in query_panels(DASHBOARD) if needs_expert_cache(p)]
    panel_names = {n for p in panels for t in p["targets"] for n in metric_names(t["expr"])}
    assert panel_names and panel_names <= set(samples)

    accesses = read_access_log(log)
    assert {a.domain for a in accesses} == {None, "logic", "translate"}  # None: the server's warm-up
    profile = {
        b.domain: DomainTables(
            freq=decode_f32(b.freq, (N_MOE, SHAPE.n_expert)),
            transitions=decode_f32(b.transitions, (N_MOE - 1, SHAPE.n_expert, SHAPE.n_expert)),
        )
        for b in bodies
    }
    replay = replay_accesses(accesses, "default", N_MOE, SHAPE.n_expert, slots, SHAPE.n_expert_used, profile)
    assert replay.prefetch > 0 and replay.prefetch_used > 0
    assert engine == {
        "accesses": replay.accesses,
        "hits": replay.hits,
        "loads": replay.loads,
        "prefetch": replay.prefetch,
        "prefetch_used": replay.prefetch_used,
    }
    # each domain's prefetches, made with its own tables (translate has none: the tables of no domain serve
    # it), and their use, as the replay charges them
    engine_by_domain = {
        None if d == "untagged" else d: (p, by_domain["prefetch_used"][d])
        for d, p in by_domain["prefetch"].items()
        if p or by_domain["prefetch_used"][d]
    }
    assert engine_by_domain == replay.prefetch_by_domain
    assert "logic" in engine_by_domain


def test_the_profile_endpoint_says_when_the_cache_is_off(
    rpc_device: RpcDevice, models: dict[str, Model], tmp_path: Path
) -> None:
    off = base_settings(gpu_layers=99, extra_args="--cpu-moe").model_copy(update={"admin_token": TOKEN})
    with serve_on(rpc_device, models["ds-v2-lite"].path, off, {}, tmp_path) as (client, _):
        resp = post_profile(client, ExpertCacheProfile(domain="logic"))
        shape = client.get("/moe/cache")
        doctor = check_expert_cache(OpsSettings(llama_url=str(client.base_url)))
    assert resp.status_code == 501
    assert "the expert cache is off" in resp.json()["error"]["message"]
    assert shape.status_code == 501 and "the expert cache is off" in shape.json()["error"]["message"]
    assert doctor is not None and doctor.status == "warn" and doctor.detail.startswith("off: ")


def run_until_ready_or_exit(cmd: list[str], env: dict[str, str], timeout: float = 240) -> tuple[int | None, str]:
    """Starts llama-server; returns (exit code, log) once it exits, or (None, log) once it serves."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "server is listening" in line or "model loaded" in line:
                return None, "".join(lines)
        return proc.wait(timeout=timeout), "".join(lines)
    finally:
        proc.kill()
        proc.wait()


def start(binary: Path, model: Path, s: LlamaSettings, extra: dict[str, str] | None = None) -> tuple[int | None, str]:
    env = {**os.environ, **llama_server_env(s), **device_env(binary), **(extra or {})}
    return run_until_ready_or_exit(llama_server_command(binary, model, s), env)


def start_on(
    device: EngineDevice, model: Path, s: LlamaSettings, extra: dict[str, str] | None = None
) -> tuple[int | None, str]:
    return start(device.binary, model, device.on_device(s), extra)


def copy_stream_line(device: EngineDevice) -> str:
    return f"expert cache: prefetch copies on a second {device.device} backend, overlapping compute"


@pytest.mark.parametrize(
    ("policy", "env", "line"),
    [("default", {}, "second"),
     ("default", {"LLAMA_ARG_MOE_CACHE_COPY_STREAM": "0"}, "expert cache: prefetch copies on the compute queue"),
     ("hybrid", {}, None)],
)  # fmt: skip
def test_the_log_says_where_the_prefetch_copies_go(
    rpc_device: RpcDevice, models: dict[str, Model], policy: str, env: dict[str, str], line: str | None
) -> None:
    """ggml-rpc's device has events, so the prefetch gets its second backend there as on a GPU."""
    line = copy_stream_line(rpc_device) if line == "second" else line
    code, log = start_on(rpc_device, models["ds-v2-lite"].path, cache_settings(16, policy), env)
    assert code is None, log[-2000:]
    said = [s for s in log.splitlines() if "prefetch copies" in s]
    if line is None:  # no prefetch: no second backend, nothing to say
        assert said == [], said
    else:
        assert len(said) == 1 and line in said[0], log[-2000:]


def test_a_budget_below_top_k_refuses_to_start_with_one_line(rpc_device: RpcDevice, models: dict[str, Model]) -> None:
    code, log = start_on(rpc_device, models["ds-v2-lite"].path, cache_settings(SHAPE.n_expert_used - 1))
    assert code not in (None, 0), log[-2000:]
    # one line of refusal, after the placement's line (the expert overrides narrowed to the weights)
    lines = [line for line in log.splitlines() if "expert cache:" in line and "override(s)" not in line]
    assert len(lines) == 1, log[-2000:]
    needed = SHAPE.n_expert_used * EXPERT_BYTES * N_MOE
    assert f"fewer than the {SHAPE.n_expert_used} experts a token uses: at least {needed} bytes" in lines[0]


def test_experts_all_on_the_device_run_without_the_cache(rpc_device: RpcDevice, models: dict[str, Model]) -> None:
    s = cache_settings(16).model_copy(update={"extra_args": "-lv 4"})  # no --cpu-moe
    code, log = start_on(rpc_device, models["ds-v2-lite"].path, s)
    assert code is None, log[-2000:]
    assert "expert cache off: no expert weights are in host memory" in log


def test_a_cpu_build_refuses_the_cache(llama_binary: Path, models: dict[str, Model]) -> None:
    code, log = start(llama_binary, models["ds-v2-lite"].path, cache_settings(16))
    assert code not in (None, 0), log[-2000:]
    assert "expert cache: no GPU device to hold it" in log


def share_line(log: str) -> tuple[float, float, str, float]:
    """(share %, free MiB, device, cache MiB) of the line a --moe-cache-bytes N% start logs."""
    found = re.search(r"expert cache: ([\d.]+)% of the ([\d.]+) MiB free on (\S+): ([\d.]+) MiB", log)
    assert found, log[-3000:]
    return float(found[1]), float(found[2]), found[3], float(found[4])


def slots_of(log: str) -> int:
    found = re.search(rf"expert cache: (\d+) of {SHAPE.n_expert} experts per layer", log)
    assert found, log[-3000:]
    return int(found[1])


def test_a_share_of_the_free_device_memory_sizes_the_cache(rpc_device: RpcDevice, models: dict[str, Model]) -> None:
    """--moe-cache-bytes N%: the share of the device memory the weights and the KV cache leave free, read
    from the device when the context is created; the slots are what those bytes hold."""
    path = models["ds-v2-lite"].path
    code, log = start_on(rpc_device, path, cache_settings(16).model_copy(update={"expert_cache_bytes": "100%"}))
    assert code is None, log[-2000:]
    pct, free_mib, device, mib = share_line(log)
    assert (pct, device) == (100, rpc_device.device) and free_mib > 0 and abs(mib - free_mib) < 0.01
    assert slots_of(log) == SHAPE.n_expert  # more than every expert needs: all of them, and no more

    per_slot = EXPERT_BYTES * N_MOE  # one slot in each cached layer
    share = 100 * 16.5 * per_slot / (free_mib * 2**20)  # about 16 slots, at what the device had free just now
    about_16 = cache_settings(16).model_copy(update={"expert_cache_bytes": f"{share:.6f}%"})
    code, log = start_on(rpc_device, path, about_16)
    assert code is None, log[-2000:]
    _, _, _, mib = share_line(log)
    assert slots_of(log) in {int((mib + d) * 2**20 // per_slot) for d in (-0.005, 0.005)}  # MiB to 2 decimals
    assert 8 <= slots_of(log) <= 24, "the device's free memory moved by more than half between two starts"


def test_a_share_too_small_for_top_k_refuses_to_start(rpc_device: RpcDevice, models: dict[str, Model]) -> None:
    s = cache_settings(16).model_copy(update={"expert_cache_bytes": "0.0001%"})
    code, log = start_on(rpc_device, models["ds-v2-lite"].path, s)
    assert code not in (None, 0), log[-2000:]
    share_line(log)
    assert f"fewer than the {SHAPE.n_expert_used} experts a token uses" in log


@pytest.mark.parametrize(
    ("size", "message"),
    [
        ("lots", "expected a size such as 4G, 512M or a number of bytes, got 'lots'"),
        ("4 lots", "unknown size suffix"),
        ("150%", "expected a share of the free device memory from 0% (off) to 100%, such as 70%, got '150%'"),
        ("x%", "expected a share of the free device memory"),
    ],
)
def test_the_cache_size_is_checked_by_the_flag_parser(
    llama_binary: Path, models: dict[str, Model], size: str, message: str
) -> None:
    s = base_settings()
    cmd = [*llama_server_command(llama_binary, models["ds-v2-lite"].path, s), "--moe-cache-bytes", size]
    code, log = run_until_ready_or_exit(cmd, {})
    assert code not in (None, 0)
    assert message in log
