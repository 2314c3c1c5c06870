"""The expert cache in llama-server (patches 0007-0009, `--moe-cache-bytes`), on the software GPU.

The reduced `ds-v2-lite` shape (3 MoE layers of 64 experts, top-6, Q4_K/Q4_0 experts) runs with its
experts in host memory (`--cpu-moe`) and the cache on llvmpipe's Vulkan device:
- greedy tokens equal the same build's with the cache off (`--cpu-moe` alone) at 7 slots per layer
  (one above top-k), 16 (a quarter) and 64 (all), with either policy, and with two concurrent
  requests. The reference is the Vulkan build, not the CPU one: on this random-weight model the two
  builds part after 4 greedy tokens (measured 2026-12-02: the device's attention and dense layers
  round differently), while every Vulkan placement, the cache included, gives the same 8;
- the engine's counters equal the Python replay of its own access log (moe_l2_cache.policy.replay),
  exactly, for `lru` and the default;
- budgets that cannot work are one clear line: below top-k or on a CPU build refuses to start, a
  model with every expert on the device runs without the cache.
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from moe_l2_cache.policy.replay import read_access_log, replay_accesses
from moe_l2_common.model_shapes import get_shape, sizes
from moe_l2_llama.settings import LlamaSettings, device_env, llama_server_command, llama_server_env
from tests.test_vulkan import DS_LAYERS, DS_VOCAB, PROMPTS, Model, assert_on_llvmpipe, greedy, greedy_one, serve
from tests.test_vulkan import models as models  # the module's fixture
from tests.test_vulkan import settings as base_settings

pytestmark = [pytest.mark.llama, pytest.mark.vulkan, pytest.mark.slow]

SHAPE = get_shape("ds-v2-lite").reduced(DS_LAYERS, DS_VOCAB)
N_MOE = DS_LAYERS - SHAPE.n_dense_lead
EXPERT_BYTES = sizes(SHAPE).expert_bytes  # gate + up + down of one expert: one slot


def budget(slots: int) -> str:
    return str(slots * EXPERT_BYTES * N_MOE)


def cache_settings(slots: int, policy: str = "default", parallel: int = 1) -> LlamaSettings:
    s = base_settings(gpu_layers=99, llama_extra_args="--cpu-moe -lv 4")
    return s.model_copy(
        update={"expert_cache_bytes": budget(slots), "expert_cache_policy": policy, "parallel": parallel}
    )


def metric(client: httpx.Client, name: str) -> int:
    text = client.get("/metrics").text
    found = re.search(rf"^llamacpp:{name} (\d+)$", text, re.M)
    assert found, f"{name} missing from /metrics"
    return int(found[1])


N_PREDICT = 8
_cache_off: dict[str, list[list[int]]] = {}


def cache_off_reference(vulkan_binary: Path, model: Model, logs: Path) -> list[list[int]]:
    """The Vulkan build's greedy tokens with the experts in host memory and no cache, once."""
    if model.name not in _cache_off:
        s = base_settings(gpu_layers=99, llama_extra_args="--cpu-moe -lv 4")
        with serve(vulkan_binary, model.path, s, {}, logs) as (client, _):
            _cache_off[model.name] = greedy(client, N_PREDICT)
    return _cache_off[model.name]


@pytest.mark.parametrize(
    ("slots", "policy"),
    [(SHAPE.n_expert_used + 1, "default"), (SHAPE.n_expert_used + 1, "lru"), (16, "default"), (64, "default")],
    ids=["top-k+1-default", "top-k+1-lru", "quarter-default", "all-default"],
)
def test_greedy_tokens_equal_the_cache_off(
    vulkan_binary: Path, models: dict[str, Model], slots: int, policy: str, tmp_path: Path
) -> None:
    model = models["ds-v2-lite"]
    expected = cache_off_reference(vulkan_binary, model, tmp_path)
    with serve(vulkan_binary, model.path, cache_settings(slots, policy), {}, tmp_path) as (client, log_path):
        got = greedy(client, N_PREDICT)
        hits, accesses, loads = (metric(client, f"moe_cache_{m}_total") for m in ("hits", "accesses", "loads"))
        log_text = log_path.read_text(errors="replace")
    assert_on_llvmpipe(log_text)
    assert f"expert cache: {slots} of {SHAPE.n_expert} experts per layer" in log_text
    assert got == expected
    assert accesses > 0 and loads > 0 and loads == accesses - hits
    if slots == SHAPE.n_expert:
        assert loads <= SHAPE.n_expert * N_MOE  # all fit: each expert is loaded at most once


@pytest.mark.parametrize("policy", ["lru", "default"])
def test_the_engine_counts_what_the_python_policy_replays(
    vulkan_binary: Path, models: dict[str, Model], policy: str, tmp_path: Path
) -> None:
    model = models["ds-v2-lite"]
    log = tmp_path / "access.log"
    slots = 16
    env = {"LLAMA_MOE_CACHE_LOG": str(log)}
    with serve(vulkan_binary, model.path, cache_settings(slots, policy), env, tmp_path) as (client, _):
        greedy(client, 12)
        engine = {m: metric(client, f"moe_cache_{m}_total") for m in ("accesses", "hits", "loads", "bypass")}
    accesses = read_access_log(log)
    assert {a.layer for a in accesses} == set(range(N_MOE))
    replay = replay_accesses(accesses, policy, N_MOE, SHAPE.n_expert, slots, SHAPE.n_expert_used)
    assert replay.accesses > 100 and 0 < replay.hits < replay.accesses
    assert engine == {"accesses": replay.accesses, "hits": replay.hits, "loads": replay.loads, "bypass": replay.bypass}


def test_two_concurrent_requests_get_the_tokens_they_get_alone(
    vulkan_binary: Path, models: dict[str, Model], tmp_path: Path
) -> None:
    model = models["ds-v2-lite"]
    expected = cache_off_reference(vulkan_binary, model, tmp_path)
    with serve(vulkan_binary, model.path, cache_settings(SHAPE.n_expert_used + 2, parallel=2), {}, tmp_path) as (
        client,
        _,
    ):
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda prompt: greedy_one(client, prompt, N_PREDICT), PROMPTS))
    assert got == expected


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


def start(binary: Path, model: Path, s: LlamaSettings) -> tuple[int | None, str]:
    import os

    env = {**os.environ, **llama_server_env(s), **device_env(binary)}
    return run_until_ready_or_exit(llama_server_command(binary, model, s), env)


def test_a_budget_below_top_k_refuses_to_start_with_one_line(vulkan_binary: Path, models: dict[str, Model]) -> None:
    code, log = start(vulkan_binary, models["ds-v2-lite"].path, cache_settings(SHAPE.n_expert_used - 1))
    assert code not in (None, 0), log[-2000:]
    lines = [line for line in log.splitlines() if "expert cache:" in line]
    assert len(lines) == 1, log[-2000:]
    needed = SHAPE.n_expert_used * EXPERT_BYTES * N_MOE
    assert f"fewer than the {SHAPE.n_expert_used} experts a token uses: at least {needed} bytes" in lines[0]


def test_experts_all_on_the_device_run_without_the_cache(vulkan_binary: Path, models: dict[str, Model]) -> None:
    s = cache_settings(16).model_copy(update={"llama_extra_args": "-lv 4"})  # no --cpu-moe
    code, log = start(vulkan_binary, models["ds-v2-lite"].path, s)
    assert code is None, log[-2000:]
    assert "expert cache off: no expert weights are in host memory" in log


def test_a_cpu_build_refuses_the_cache(llama_binary: Path, models: dict[str, Model]) -> None:
    code, log = start(llama_binary, models["ds-v2-lite"].path, cache_settings(16))
    assert code not in (None, 0), log[-2000:]
    assert "expert cache: no GPU device to hold it" in log


@pytest.mark.parametrize(
    ("size", "message"),
    [("lots", "expected a size such as 4G, 512M or a number of bytes, got 'lots'"), ("4 lots", "unknown size suffix")],
)
def test_the_cache_size_is_checked_by_the_flag_parser(
    llama_binary: Path, models: dict[str, Model], size: str, message: str
) -> None:
    s = base_settings()
    cmd = [*llama_server_command(llama_binary, models["ds-v2-lite"].path, s), "--moe-cache-bytes", size]
    code, log = run_until_ready_or_exit(cmd, {})
    assert code not in (None, 0)
    assert message in log
