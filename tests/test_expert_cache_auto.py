"""`--moe-cache-bytes auto` (patch 0020): a device budget split between whole layers of experts on the
device and the expert cache for the others, decided before the model loads.

Which device, and why it proves the claim: the **RPC device** (tests/conftest.py) is a device to the
scheduler like a GPU, with a dry run, a buffer type and copies of its own. Both sides run ggml-cpu's
kernels, so every placement must give the greedy tokens of the experts-in-host-memory, cache-off run
exactly: a layer put on the device and also cached, or a cache over the wrong layers, changes them.

The choice itself is checked against `bench/placement_model.py`'s `engine_auto_split`, the same
arithmetic in Python, fed the inputs the engine logs (budget, shape, one miss's measured copy, the
round trip) and the same hit curve (the shipped one, which every launcher passes as
--moe-cache-hit-curve): the engine and the model the project reasons with must agree on every budget.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from moe_l2_llama.command_line import llama_server_command
from moe_l2_llama.settings import LlamaSettings
from moe_l2_placement.hit_curve import DEFAULT_HIT_CURVE, HitCurveError, parse_hit_curve, read_hit_curve
from tests.benches import load_bench
from tests.conftest import RpcDevice, VulkanDevice
from tests.test_expert_cache import EXPERT_BYTES, N_MOE, N_PREDICT, SHAPE, cache_off_reference, serve_on
from tests.test_vulkan import Model, greedy, serve
from tests.test_vulkan import models as models  # the module's fixture
from tests.test_vulkan import settings as base_settings

pm = load_bench("placement_model")

pytestmark = [pytest.mark.llama]

INPUTS = re.compile(
    r"expert cache auto: budget (\d+) bytes \(.*\) for (\d+) MoE layers of (\d+) experts of (\d+) bytes, (\d+) used; "
    r"a miss ([\d.]+) ms \(copy [\d.]+ GB/s from (\w+) memory\), a round trip ([\d.]+) ms"
)
SPLIT = re.compile(r"expert cache auto: (\d+) of (\d+) MoE layers on the device \([\d.]+ MiB\), a cache of (\d+) of")
FITS = re.compile(r"expert cache auto: every expert fits: all (\d+) MoE layers on the device")
CPU_ONLY = re.compile(r"expert cache auto: the budget holds fewer than the \d+ experts .*: (\d+) of (\d+) MoE layers")
CURVE = re.compile(
    r"expert cache auto: hit rates of a curve of (\d+) points \(--moe-cache-hit-curve\): "
    r"([\d.]+) at a quarter of the experts, ([\d.]+) at half"
)
LAYER = SHAPE.n_expert * EXPERT_BYTES


@dataclass(frozen=True)
class Chosen:
    """What the engine logged: its inputs, and the layers on the device and the slots it chose."""

    budget: int
    t_miss_s: float
    t_rt_s: float
    n_dev: int
    n_slot: int

    def python(self) -> pm.EngineSplit:
        return pm.engine_auto_split(
            N_MOE, SHAPE.n_expert, SHAPE.n_expert_used, EXPERT_BYTES, self.budget, self.t_rt_s, self.t_miss_s
        )


def chosen(log: str) -> Chosen:
    curve = CURVE.search(log)
    assert curve, f"no 'expert cache auto: hit rates' line naming the curve in the log:\n{log[-3000:]}"
    shipped = read_hit_curve(DEFAULT_HIT_CURVE)
    assert int(curve[1]) == len(shipped.points)
    assert (float(curve[2]), float(curve[3])) == (round(shipped.hit(0.25), 4), round(shipped.hit(0.5), 4))
    found = INPUTS.search(log)
    assert found, f"no 'expert cache auto: budget' line in the log:\n{log[-3000:]}"
    budget, n_layer, n_expert, expert_bytes, n_used = (int(found[i]) for i in range(1, 6))
    assert (n_layer, n_expert, expert_bytes, n_used) == (N_MOE, SHAPE.n_expert, EXPERT_BYTES, SHAPE.n_expert_used)
    t_miss, t_rt = float(found[6]) / 1e3, float(found[8]) / 1e3
    if m := SPLIT.search(log):
        return Chosen(budget, t_miss, t_rt, int(m[1]), int(m[3]))
    if m := FITS.search(log):
        return Chosen(budget, t_miss, t_rt, int(m[1]), 0)
    m = CPU_ONLY.search(log)
    assert m, f"no 'expert cache auto:' choice in the log:\n{log[-3000:]}"
    return Chosen(budget, t_miss, t_rt, int(m[1]), 0)


def device_model_buffer(log: str, device: str) -> float:
    """The weights the loader put on the device, in bytes (its `model buffer size` line, in MiB)."""
    found = re.findall(rf"load_tensors: +{re.escape(device)} model buffer size = +([\d.]+) MiB", log)
    assert found, f"no model buffer on {device} in the log"
    return float(found[-1]) * 2**20


def auto(budget: str) -> LlamaSettings:
    """compose's GPU settings with this budget: --cpu-moe, which auto replaces with its own placement, and
    --fit off, so that the placement is auto's alone."""
    return base_settings(gpu_layers=99, fit="off", extra_args="--cpu-moe -lv 4", expert_cache_bytes=budget)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("budget", "n_dev", "n_slot"),
    [
        (str(int(0.9 * N_MOE * LAYER)), 2, 44),  # 90%: two layers whole, the third cached in the rest
        (str(int(0.34 * N_MOE * LAYER)), 0, 21),  # a third: the cache alone, over every layer
        (str(5 * N_MOE * EXPERT_BYTES), 0, 0),  # under top-k slots a layer: every expert on the CPU
    ],
    ids=["90pct-layers-and-cache", "34pct-cache-alone", "under-top-k-cpu"],
)
def test_auto_places_as_the_model_chooses_and_the_tokens_are_the_cache_off_run_s(
    rpc_device: RpcDevice, models: dict[str, Model], tmp_path: Path, budget: str, n_dev: int, n_slot: int
) -> None:
    """The engine's choice equals engine_auto_split's on the inputs it logged (and, for these budgets,
    the split the model gives for any miss cost from 10 us to 10 ms); the cache covers exactly the
    layers left in host memory, the first ones; the greedy tokens are the cache-off run's."""
    model = models["ds-v2-lite"]
    expected = cache_off_reference(rpc_device, model, tmp_path)
    with serve_on(rpc_device, model.path, auto(f"auto:{budget}"), {}, tmp_path) as (client, log_path):
        got = greedy(client, N_PREDICT)
        cache = client.get("/moe/cache")
    log = log_path.read_text()
    c = chosen(log)
    assert c.budget == int(budget)
    assert (c.n_dev, c.n_slot) == (n_dev, n_slot), log[-2000:]
    py = c.python()
    assert (py.n_dev, py.n_slot) == (c.n_dev, c.n_slot), f"engine {c}, Python {py}"
    assert "override(s) of expert tensors (--cpu-moe, --n-cpu-moe, -ot) replaced" in log
    rest = N_MOE - n_dev
    on_device = device_model_buffer(log, rpc_device.device)
    assert n_dev * LAYER <= on_device < (n_dev + 2) * LAYER, f"{on_device} bytes of weights on the device"
    if n_slot:
        assert cache.status_code == 200, cache.text
        body = cache.json()
        first_moe = SHAPE.n_dense_lead
        assert body["layers"] == list(range(first_moe, first_moe + rest)), body
        assert body["n_slot"] == n_slot
    else:
        assert cache.status_code == 501, cache.text  # no cache: whole layers, the others on the CPU
    assert got == expected


@pytest.mark.slow
def test_auto_with_a_budget_every_expert_fits_puts_them_all_on_the_device_and_says_so(
    rpc_device: RpcDevice, models: dict[str, Model], tmp_path: Path
) -> None:
    """`auto` alone: the budget is what the dry run finds free on the device (the RPC server's RAM, GBs),
    far more than the 3 MoE layers: every expert on the device, no cache, one line saying so."""
    model = models["ds-v2-lite"]
    expected = cache_off_reference(rpc_device, model, tmp_path)
    with serve_on(rpc_device, model.path, auto("auto"), {}, tmp_path) as (client, log_path):
        got = greedy(client, N_PREDICT)
        cache = client.get("/moe/cache")
    log = log_path.read_text()
    assert f"expert cache auto: every expert fits: all {N_MOE} MoE layers on the device" in log
    c = chosen(log)
    assert c.budget >= N_MOE * LAYER and c.n_dev == N_MOE
    assert cache.status_code == 501
    assert got == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("auto:0", "--moe-cache-bytes auto:0: a budget of 0 (use 0 to turn the cache off)"),
        ("auto:lots", "expected a size such as 4G, 512M or a number of bytes, got 'lots'"),
        ("auto:120%", "expected a share of the free device memory from 0% (off) to 100%, such as 70%, got '120%'"),
    ],
)
def test_a_bad_auto_budget_is_refused_in_one_line(llama_binary: Path, tmp_path: Path, value: str, message: str) -> None:
    """The argument parser's errors, from the real binary (any build parses the flag)."""
    cmd = llama_server_command(llama_binary, tmp_path / "none.gguf", base_settings(gpu_layers=0))
    cmd += ["--moe-cache-bytes", value]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("# share hit\n0.5 0.6\n0.25 0.7\n", "line 3: shares must increase and hit rates not decrease"),
        ("0.25 0.7\n0.5 0.6\n", "line 2: shares must increase and hit rates not decrease"),
        ("0.5 nan\n1 1\n", "line 1: not two numbers"),
        ("0.5 0.6 0.7\n1 1\n", "line 1: not two numbers"),
        ("0.5 1.2\n1 1\n", "line 1: a share in (0, 1] and a hit rate in [0, 1] expected"),
        ("# only one\n0.5 0.6\n", "fewer than two points"),
    ],
    ids=["shares-decrease", "hits-decrease", "nan", "three-numbers", "hit-over-1", "one-point"],
)
def test_a_bad_hit_curve_is_refused_in_one_line_by_the_engine_and_the_python_reader(
    llama_binary: Path, tmp_path: Path, text: str, message: str
) -> None:
    """--moe-cache-hit-curve's file is read when the flags are (any build parses it): a bad one stops the
    server at once, naming the line, before a model is read. The Python reader (what the flywheel writes
    with, what the placement model reads) refuses the same file: the two read one format."""
    path = tmp_path / "curve.txt"
    path.write_text(text)
    cmd = llama_server_command(llama_binary, tmp_path / "none.gguf", base_settings(gpu_layers=0))
    proc = subprocess.run([*cmd, "--moe-cache-hit-curve", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"--moe-cache-hit-curve {path}: {message}" in proc.stdout + proc.stderr
    with pytest.raises(HitCurveError):
        parse_hit_curve(text, str(path))


def test_a_missing_hit_curve_is_refused_in_one_line(llama_binary: Path, tmp_path: Path) -> None:
    cmd = llama_server_command(llama_binary, tmp_path / "none.gguf", base_settings(gpu_layers=0))
    missing = tmp_path / "no-such-curve.txt"
    proc = subprocess.run([*cmd, "--moe-cache-hit-curve", str(missing)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"--moe-cache-hit-curve {missing}: cannot be read" in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.vulkan
@pytest.mark.rpc_twin(
    "tests/test_expert_cache_auto.py::"
    "test_auto_places_as_the_model_chooses_and_the_tokens_are_the_cache_off_run_s[90pct-layers-and-cache]"
)
def test_auto_on_llvmpipe_layers_and_cache_give_the_cache_off_tokens(
    vulkan_device: VulkanDevice, models: dict[str, Model], tmp_path: Path
) -> None:
    """The 90% split on a GPU backend's buffers, queues and kernels (ggml-vulkan on llvmpipe): two layers
    whole on the device, the third behind the cache, its misses split with the CPU; the greedy tokens
    are the cache-off run's of the same device (whose experts ggml-vulkan computes from its copies)."""
    model = models["ds-v2-lite"]
    expected = cache_off_reference(vulkan_device, model, tmp_path)
    budget = str(int(0.9 * N_MOE * LAYER))
    # llvmpipe reports a device of 2 GiB: without --fit-target's 1 GiB margin the 840 MB budget fits beside the rest
    s = auto(f"auto:{budget}")
    s = s.model_copy(update={"extra_args": f"{s.extra_args} --fit-target 0"})
    with serve_on(vulkan_device, model.path, s, {}, tmp_path) as (client, log_path):
        got = greedy(client, N_PREDICT)
        body = client.get("/moe/cache").json()
    log = log_path.read_text()
    c = chosen(log)
    py = c.python()
    assert (c.n_dev, c.n_slot) == (py.n_dev, py.n_slot) == (2, 44), log[-2000:]
    assert body["layers"] == [SHAPE.n_dense_lead] and body["n_slot"] == 44
    assert 2 * LAYER <= device_model_buffer(log, vulkan_device.device) < 4 * LAYER
    assert got == expected


def test_auto_on_a_cpu_build_serves_without_a_cache_and_says_why(
    llama_binary: Path, demo_model: Path, tmp_path: Path
) -> None:
    """No GPU device: auto leaves the experts where they are and the server serves, with one warning."""
    s = base_settings(expert_cache_bytes="auto")
    with serve(llama_binary, demo_model, s, {}, tmp_path) as (client, log_path):
        assert client.get("/health").json() == {"status": "ok"}
        assert client.get("/moe/cache").status_code == 501
    assert "expert cache auto: no GPU device: the experts stay where they are, no cache" in log_path.read_text()
