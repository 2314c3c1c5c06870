"""The expert cache's decode misses computed on the CPU while the device computes the hits (patches 0005
and 0019, `--moe-cache-cpu-misses`).

Which device, and why it proves the claim:
- The **RPC device** (tests/conftest.py) is a device to the scheduler, like a GPU: the graph reads a
  layer's input and ids to the host, the device computes its pairs on its slots, the CPU computes the
  misses' pairs from host memory (the others' ids -1), and the device adds the two with the CPU's pairs
  of its own zeroed. A pair computed twice, or by neither side, or a CPU pair on the wrong expert,
  changes the tokens against the cache-off run of the same device. Both sides run ggml's CPU kernels
  there, so the tolerance is zero: the greedy tokens are equal, not close.
- **llvmpipe** runs the 64-token ESFT test: the device side is ggml-vulkan's (a GPU backend's kernels,
  buffers, queues and events), the CPU side ggml-cpu's. Their float sums differ in order, which a
  split of the pairs between them allows; the greedy tokens still equal the cache-off run of the
  same device, whose experts ggml-vulkan computes from its copy of them.
- **Counters**: the misses the CPU computes are still admitted into slots as the policy decides (their
  copies on the copy backend, off the critical path), so the engine's accesses, hits and loads equal
  the Python replay of its own access log, exactly as without the CPU's share.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moe_l2_cache.policy.profile import fit_profile
from moe_l2_cache.policy.replay import read_access_log, replay_accesses
from moe_l2_contracts.schemas.llama import ExpertCacheProfile
from moe_l2_llama.command_line import llama_server_command
from moe_l2_llama.route_trace import from_esft_npz, write_route_trace
from moe_l2_llama.settings import LlamaSettings
from tests.conftest import ON_RPC_AND_LLVMPIPE, EngineDevice, RpcDevice
from tests.test_expert_cache import (
    N_MOE,
    N_PREDICT,
    SHAPE,
    TOKEN,
    both_at_once,
    cache_off_reference,
    cache_settings,
    metric,
    post_profile,
    run_until_ready_or_exit,
    serve_on,
    two_domain_profiles,
)
from tests.test_route_trace import ESFT_NPZ
from tests.test_vulkan import PROMPTS, Model, greedy, greedy_one
from tests.test_vulkan import models as models  # the module's fixture
from tests.test_vulkan import settings as base_settings

pytestmark = [pytest.mark.llama, pytest.mark.slow]

CPU_LINE = re.compile(r"expert cache: misses of micro-batches up to 16 tokens computed on the CPU \((\d+) threads\)")


def cpu_misses(slots: int, mode: str = "on", parallel: int = 1, threads: int = 2) -> LlamaSettings:
    s = cache_settings(slots, parallel=parallel)
    return s.model_copy(
        update={"extra_args": f"{s.extra_args} --moe-cache-cpu-misses {mode}", "threads": threads, "admin_token": TOKEN}
    )


@pytest.mark.parametrize("slots", [7, 14, 32])
def test_greedy_tokens_with_the_cpu_misses_equal_the_cache_off_and_the_counts_the_replay(
    rpc_device: RpcDevice, models: dict[str, Model], slots: int, tmp_path: Path
) -> None:
    """Every decode miss computed on the CPU, at 7, 14 and 32 of 64 slots: the tokens are the cache-off
    run's, and the residency is the replay's (the CPU's misses still enter the cache)."""
    model = models["ds-v2-lite"]
    expected = cache_off_reference(rpc_device, model, tmp_path)
    log = tmp_path / "access.log"
    with serve_on(rpc_device, model.path, cpu_misses(slots), {"LLAMA_ARG_MOE_CACHE_LOG": str(log)}, tmp_path) as (
        client,
        log_path,
    ):
        got = greedy(client, N_PREDICT)
        engine = {m: metric(client, f"moe_cache_{m}_total") for m in ("accesses", "hits", "loads", "bypass")}
        on_cpu = metric(client, "moe_cache_cpu_misses_total")
        log_text = log_path.read_text(errors="replace")
    assert CPU_LINE.search(log_text), log_text[-2000:]
    assert got == expected
    assert 0 < on_cpu <= engine["loads"]
    replay = replay_accesses(read_access_log(log), "default", N_MOE, SHAPE.n_expert, slots, SHAPE.n_expert_used)
    assert engine == {"accesses": replay.accesses, "hits": replay.hits, "loads": replay.loads, "bypass": replay.bypass}


def test_off_computes_no_miss_on_the_cpu(rpc_device: RpcDevice, models: dict[str, Model], tmp_path: Path) -> None:
    model = models["ds-v2-lite"]
    expected = cache_off_reference(rpc_device, model, tmp_path)
    with serve_on(rpc_device, model.path, cpu_misses(14, "off"), {}, tmp_path) as (client, log_path):
        got = greedy(client, N_PREDICT)
        on_cpu, loads = metric(client, "moe_cache_cpu_misses_total"), metric(client, "moe_cache_loads_total")
        log_text = log_path.read_text(errors="replace")
    assert got == expected
    assert on_cpu == 0 and loads > 0
    assert "computed on the CPU" not in log_text


def test_one_cpu_thread_still_computes_the_misses(
    rpc_device: RpcDevice, models: dict[str, Model], tmp_path: Path
) -> None:
    """Fewer threads than the miss path would like (-t 1): the CPU's nodes run on the one thread."""
    model = models["ds-v2-lite"]
    expected = cache_off_reference(rpc_device, model, tmp_path)
    with serve_on(rpc_device, model.path, cpu_misses(7, threads=1), {}, tmp_path) as (client, log_path):
        got = greedy(client, N_PREDICT)
        on_cpu = metric(client, "moe_cache_cpu_misses_total")
        found = CPU_LINE.search(log_path.read_text(errors="replace"))
    assert found and found[1] == "1"
    assert got == expected and on_cpu > 0


def test_every_expert_on_the_device_computes_none_on_the_cpu_and_says_so(
    rpc_device: RpcDevice, models: dict[str, Model], tmp_path: Path
) -> None:
    model = models["ds-v2-lite"]
    expected = cache_off_reference(rpc_device, model, tmp_path)
    with serve_on(rpc_device, model.path, cpu_misses(SHAPE.n_expert), {}, tmp_path) as (client, log_path):
        got = greedy(client, N_PREDICT)
        on_cpu = metric(client, "moe_cache_cpu_misses_total")
        log_text = log_path.read_text(errors="replace")
    assert got == expected and on_cpu == 0
    assert "every expert fits on the device: misses copied once, none computed on the CPU" in log_text


@pytest.mark.skipif(not ESFT_NPZ.is_file(), reason=f"the ESFT routing data is not at {ESFT_NPZ}")
def test_two_domains_at_once_with_the_cpu_misses_get_the_tokens_they_get_alone(
    rpc_device: RpcDevice, models: dict[str, Model], tmp_path: Path
) -> None:
    """-np 2, a request of each domain at once, each with its profile: decode's micro-batches of two rows
    (one per request) split their misses between the CPU and the device, row by row."""
    model = models["ds-v2-lite"]
    lengths = (N_PREDICT, 3 * N_PREDICT)
    off = base_settings(gpu_layers=99, extra_args="--cpu-moe -lv 4")
    with serve_on(rpc_device, model.path, off, {}, tmp_path) as (client, _):
        expected = [greedy_one(client, PROMPTS[i], lengths[i]) for i in (0, 1)]
    with serve_on(rpc_device, model.path, cpu_misses(14, parallel=2), {}, tmp_path) as (client, _):
        assert all(post_profile(client, body).status_code == 200 for body in two_domain_profiles())
        got = both_at_once(client, lengths)
        on_cpu = metric(client, "moe_cache_cpu_misses_total")
    assert got == expected
    assert on_cpu > 0


@pytest.mark.skipif(not ESFT_NPZ.is_file(), reason=f"the ESFT routing data is not at {ESFT_NPZ}")
@ON_RPC_AND_LLVMPIPE
def test_64_tokens_under_the_esft_trace_with_the_cpu_misses_equal_the_cache_off(
    device: EngineDevice, models: dict[str, Model], tmp_path: Path
) -> None:
    """DeepSeek-V2-Lite's routing on an ESFT prompt (LLAMA_MOE_ROUTE_TRACE), 64 greedy tokens, 16 slots
    and the default policy prefetching by a fitted profile, every decode miss on the CPU."""
    model = models["ds-v2-lite"]
    law = from_esft_npz(ESFT_NPZ, tasks=["law"], seqs=slice(0, 30), layers=N_MOE)
    trace = tmp_path / "law.trace"
    write_route_trace(law, trace)
    first = int(law.offsets[2])
    fitted = fit_profile(law.ids[first:], ["logic"] * (law.n_token - first), SHAPE.n_expert)
    env = {"LLAMA_MOE_ROUTE_TRACE": str(trace)}
    headers = {"X-MoE-Domain": "logic"}
    n_tokens = 64

    off = base_settings(gpu_layers=99, extra_args="--cpu-moe -lv 4")
    with serve_on(device, model.path, off, env, tmp_path) as (client, _):
        expected = greedy_one(client, PROMPTS[1], n_tokens, headers)

    with serve_on(device, model.path, cpu_misses(16), env, tmp_path) as (client, log_path):
        device.assert_holds_the_model(log_path.read_text())
        body = ExpertCacheProfile.from_tables(
            "logic", freq=fitted.domain_freq["logic"], transitions=fitted.domain_transitions["logic"]
        )
        assert post_profile(client, body).status_code == 200
        got = greedy_one(client, PROMPTS[1], n_tokens, headers)
        on_cpu, prefetched = metric(client, "moe_cache_cpu_misses_total"), metric(client, "moe_cache_prefetch_total")
    assert got == expected
    assert on_cpu > 0 and prefetched > 0


@pytest.mark.parametrize("value", ["sometimes", ""])
def test_the_mode_is_checked_by_the_flag_parser(llama_binary: Path, models: dict[str, Model], value: str) -> None:
    cmd = [
        *llama_server_command(llama_binary, models["ds-v2-lite"].path, base_settings()),
        "--moe-cache-cpu-misses",
        value,
    ]
    code, log = run_until_ready_or_exit(cmd, {})
    assert code not in (None, 0)
    assert "--moe-cache-cpu-misses" in log


# `(an expert: CPU 23.13 GB/s, copy 2.04 GB/s, measured now, best of 10 runs)`, or `kept from an earlier start`
RATES = re.compile(r"CPU ([\d.]+) GB/s, copy ([\d.]+) GB/s, (measured now|kept from an earlier start)")
COPIED_RATES = re.compile(
    r"misses copied, none computed on the CPU: it reads an expert at ([\d.]+) GB/s, the copy moves it at "
    r"([\d.]+) GB/s \((measured now[^)]*|kept from an earlier start)\)"
)


def auto_rates(device: RpcDevice, model: Path, rates: str, tmp_path: Path, name: str) -> tuple[str, str]:
    """One start with the CPU misses on auto and the rates kept in `rates`: (its line of rates, its log)."""
    s = cpu_misses(7, "auto")
    s = s.model_copy(update={"extra_args": f"{s.extra_args} --moe-cache-rates {rates}"})
    with serve_on(device, model, s, {}, tmp_path / name) as (_, log_path):
        log_text = log_path.read_text(errors="replace")
    found = RATES.search(log_text) or COPIED_RATES.search(log_text)
    assert found, log_text[-3000:]
    return found[0], log_text


def test_auto_decides_by_rates_kept_from_the_first_start(
    rpc_device: RpcDevice, models: dict[str, Model], tmp_path: Path
) -> None:
    """The first start measures the rates and keeps them; the next starts of the same command read them, so that
    auto chooses the same way every start (D9: measured at every start, one H200 read the CPU at 0.03 to 21.9
    GB/s in five starts of the same model, and auto computed misses on the CPU in one and copied them in the
    next). A kept rate is what decides: planted as a CPU slower than the copy, the misses are copied."""
    model = models["ds-v2-lite"].path
    rates = tmp_path / "rates.txt"
    first, log_text = auto_rates(rpc_device, model, str(rates), tmp_path, "first")
    assert "measured now" in first and f"the rates kept in {rates}" in log_text
    assert len(rates.read_text().splitlines()) == 1
    for n in (2, 3):
        again, log_text = auto_rates(rpc_device, model, str(rates), tmp_path, f"start-{n}")
        assert again == first.replace("measured now", "kept from an earlier start")
        assert "the rates kept in" not in log_text  # nothing measured, nothing written

    key, _, copy = rates.read_text().splitlines()[0].split("\t")
    rates.write_text(f"{key}\t{float(copy) / 100:.4f}\t{copy}\n")  # a CPU a hundred times slower than the copy
    planted, log_text = auto_rates(rpc_device, model, str(rates), tmp_path, "planted")
    assert "kept from an earlier start" in planted and "computed on the CPU (" not in log_text, planted


def test_rates_none_measures_at_every_start_and_keeps_nothing(
    rpc_device: RpcDevice, models: dict[str, Model], tmp_path: Path
) -> None:
    for n in (1, 2):
        line, log_text = auto_rates(rpc_device, models["ds-v2-lite"].path, "none", tmp_path, f"none-{n}")
        assert "measured now" in line and "the rates kept in" not in log_text


def test_an_empty_rates_file_is_refused_by_the_flag_parser(llama_binary: Path, models: dict[str, Model]) -> None:
    cmd = [*llama_server_command(llama_binary, models["ds-v2-lite"].path, base_settings()), "--moe-cache-rates", ""]
    code, log = run_until_ready_or_exit(cmd, {})
    assert code not in (None, 0)
    assert "--moe-cache-rates needs a file, or none" in log
