"""`moe-l2 up` (what `make run` calls): the demo stack comes up, answers, and stops on Ctrl-C; the
admin token it creates and hands to every service; the checks that come before any build, each one line
(the model, the ports, the fit in memory), and the build it serves (no test hooks). Restarts:
tests/test_restarts.py."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from moe_l2_contracts.admin import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE_ENV
from moe_l2_llama import build as build_mod
from moe_l2_llama.backend import GpuDetection, NvidiaGpu, VulkanDevice, choose_backend
from moe_l2_llama.build import BuildConfig, BuildError
from moe_l2_ops import preflight
from moe_l2_ops.stack import StackSettings, stack_admin_token, stack_services
from moe_l2_ops.supervisor import free_port, port_in_use
from tests.test_restarts import service_pids


def wait_for_line(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line)
        if marker in line:
            return lines
    raise AssertionError(f"{marker!r} not printed; output so far: {''.join(lines)}")


@pytest.mark.llama
def test_up_serves_the_demo_model_and_stops_cleanly(llama_binary: Path, tmp_path: Path) -> None:
    llama_port, redis_port, proxy_port = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "MOE_L2_LLAMA_PORT": str(llama_port),
        "MOE_L2_REDIS_PORT": str(redis_port),
        "MOE_L2_PROXY_PORT": str(proxy_port),
        "MOE_L2_CACHE_PORT": str(free_port()),
        "MOE_L2_PREDICTOR_PORT": str(free_port()),
        "MOE_L2_STATE_DIR": str(tmp_path / "state"),
        # the suite's build (with the test hooks), not a second, serving build compiled in this test: which
        # build `up` asks for is test_up_serves_a_build_without_the_test_hooks's
        "MOE_L2_LLAMA_SERVER": str(llama_binary),
        "MOE_L2_LLAMA_PARALLEL": "2",
        # the flywheel's pulls would reset llama's routing counts under this test's feet
        "MOE_L2_CACHE_PULL_INTERVAL_S": "0",
    }
    env.pop("MOE_L2_MODEL_PATH", None)
    env.pop("MODEL", None)
    env.pop(ADMIN_TOKEN_ENV, None)  # so `up` creates the state folder's token
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_l2_ops.cli", "up"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        # as when a shell starts it in the background: SIGINT ignored, Ctrl-C must still work
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        output = "".join(wait_for_line(proc, "Ctrl-C stops everything", timeout_s=600))
        assert f"http://127.0.0.1:{llama_port}/v1" in output
        assert f"redis://127.0.0.1:{redis_port}/0" in output
        assert (tmp_path / "state" / "models" / "moe-l2-demo-seed0.gguf").is_file()

        # the admin token: created private at the first start, in every service's environment
        token_file = tmp_path / "state" / "admin-token"
        assert f"admin token    {token_file}" in output
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        children = service_pids(proc.pid)
        assert set(children) == {"redis", "llama", "cache-manager", "predictor", "proxy"}
        for name, pid in children.items():
            if name == "redis":
                continue  # it writes its process title over its environment block; it makes no admin calls
            environ = dict(
                item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item
            )
            assert environ.get(ADMIN_TOKEN_ENV.encode()) == token.encode(), name
            if name == "llama":
                assert environ.get(b"LLAMA_ARG_MOE_ADMIN_TOKEN") == token.encode()

        resp = httpx.post(
            f"http://127.0.0.1:{llama_port}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "what is the integral"}], "max_tokens": 8},
            timeout=60,
        )
        assert resp.status_code == 200
        assert resp.json()["choices"][0]["message"]["content"]
        assert httpx.get(f"http://127.0.0.1:{llama_port}/moe/routing", timeout=10).json()["tokens"] > 0

        # and through the gateway, with the domain predicted for it
        resp = httpx.post(
            f"http://127.0.0.1:{proxy_port}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "solve the integral of x squared"}], "max_tokens": 4},
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        assert resp.headers["X-MoE-Domain"] == "math"

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            # SIGTERM lets `up` stop its children; SIGKILL would orphan them
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert not port_in_use("127.0.0.1", llama_port)
    assert not port_in_use("127.0.0.1", redis_port)
    # Redis persisted with AOF into the state folder
    assert any((tmp_path / "state" / "redis").iterdir())


# Every port `moe-l2 up` binds, by the variable that moves it.
PORT_VARIABLES = (
    "MOE_L2_LLAMA_PORT",
    "MOE_L2_REDIS_PORT",
    "MOE_L2_PROXY_PORT",
    "MOE_L2_CACHE_PORT",
    "MOE_L2_PREDICTOR_PORT",
)


def distinct_free_ports(n: int) -> list[str]:
    """n free ports, all different: each socket is held until all are chosen (free_port's could repeat)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [str(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass(frozen=True)
class UpResult:
    lines: list[str]  # stderr
    seconds: float

    @property
    def last(self) -> str:
        return self.lines[-1]


def run_up(model: Path, tmp_path: Path, **env: str) -> UpResult:
    """`moe-l2 up --model` that must fail before starting anything, with a llama-server that does not exist
    (unless `env` names one): a check that comes before the build says its line last; one after it would let
    `up` reach the binary and say it is missing. Every port free (the defaults may be taken by a stack running
    on this machine), the state in tmp_path."""
    full = {
        **os.environ,
        "MOE_L2_STATE_DIR": str(tmp_path / "state"),
        "MOE_L2_LLAMA_SERVER": str(tmp_path / "no-such-llama-server"),
        **dict(zip(PORT_VARIABLES, distinct_free_ports(len(PORT_VARIABLES)), strict=True)),
        **env,
    }
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "moe_l2_ops.cli", "up", "--model", str(model)],
        capture_output=True,
        text=True,
        env=full,
        timeout=120,
    )
    seconds = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    assert not (tmp_path / "state" / "logs" / "llama.log").exists(), "a service was started"
    return UpResult(result.stderr.strip().splitlines(), seconds)


def up_error(model: Path, tmp_path: Path) -> str:
    """run_up's last line: the error that stopped it."""
    return run_up(model, tmp_path).last


def report_seconds(what: str, result: UpResult) -> None:
    # measured, not asserted (a loaded 2-core machine varies): `pytest -rP` shows it
    print(f"[timing] moe-l2 up {what}: its line after {result.seconds:.2f} s: {result.last}")


def test_up_with_a_missing_model_is_one_clear_line(tmp_path: Path) -> None:
    result = run_up(tmp_path / "nope.gguf", tmp_path)
    report_seconds("--model nope.gguf", result)
    assert result.lines == [f"error: model {tmp_path / 'nope.gguf'} does not exist"]


def test_up_with_a_dense_model_is_one_line_before_any_build(tmp_path: Path) -> None:
    from tests.cache.gguf_models import build_dense

    dense = build_dense(tmp_path).path
    result = run_up(dense, tmp_path)
    report_seconds("--model <dense model>", result)
    assert result.lines == [
        f"error: model {dense} is a dense model (no routed experts): moe-l2 keeps a mixture-of-experts model's "
        "experts in host memory and has nothing to place for it; serve it with llama-server directly"
    ]


def test_up_with_a_file_that_is_not_gguf_is_one_line_before_any_build(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    line = up_error(text, tmp_path)
    assert line.startswith(f"error: model {text} cannot be read as a GGUF model: "), line


@pytest.fixture
def moe_model(tmp_path: Path) -> Path:
    """A small MoE GGUF (3 layers, 235 KiB of weights, 768 bytes of f16 KV cache a token)."""
    from tests.cache.gguf_models import build_mixtral

    folder = tmp_path / "model"  # apart from tmp_path's state/ and meminfo
    folder.mkdir()
    return build_mixtral(folder).path


@pytest.mark.parametrize("listening", [False, True], ids=["bound", "listening"])
def test_a_busy_port_is_one_line_naming_it_and_its_variable(moe_model: Path, tmp_path: Path, listening: bool) -> None:
    """Before the build. A socket bound without listening is found too: a connect would not see it, and
    llama-server's own bind would fail on it after a build of minutes."""
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        if listening:
            busy.listen()
        result = run_up(moe_model, tmp_path, MOE_L2_LLAMA_PORT=str(port))
    report_seconds(f"with port {port} {'listened on' if listening else 'bound'}", result)
    assert result.last == (
        f"error: llama: port {port} on 127.0.0.1 is already in use; stop what runs there or move llama to a free "
        "port with MOE_L2_LLAMA_PORT"
    )


def test_the_port_check_names_each_service_s_variable() -> None:
    from moe_l2_ops.stack import port_setting

    assert port_setting("redis") == "MOE_L2_REDIS_PORT"
    assert port_setting("proxy") == "MOE_L2_PROXY_PORT"
    assert port_setting("cache-manager") == "MOE_L2_CACHE_PORT"
    assert port_setting("llama-3") == "MOE_L2_LLAMA_PORT (replica i listens on it + 100·(i-1))"
    assert port_setting("predictor-2").startswith("MOE_L2_PREDICTOR_PORT ")


def plant_meminfo(tmp_path: Path, available_kib: int) -> Path:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        f"MemTotal:        {available_kib * 4} kB\nMemFree:  1 kB\nMemAvailable:    {available_kib} kB\n"
    )
    return meminfo


def test_a_model_larger_than_the_ram_is_a_warning_with_its_figures(moe_model: Path, tmp_path: Path) -> None:
    """mmap: llama-server starts with a model larger than the RAM (and reads it from disk again); the line
    says so with the figures, and `up` goes on to the build (here: the missing binary's line)."""
    meminfo = plant_meminfo(tmp_path, 100)
    result = run_up(moe_model, tmp_path, MOE_L2_TEST_MEMINFO=str(meminfo), MOE_L2_LLAMA_CTX_PER_REQUEST="64")
    report_seconds("with MemAvailable 100 kB", result)
    warnings = [line for line in result.lines if line.startswith("warning: ")]
    assert warnings == [
        "warning: the model (234.8 KiB) and the KV cache (192.0 KiB for 256 tokens of context, f16) need 426.8 KiB "
        "and there is 100.0 KiB of RAM available (MemAvailable): llama-server maps the model, so it starts, but "
        "rereads from disk what does not fit (slowly); MOE_L2_RAM_BUDGET serves a model larger than the RAM on "
        "purpose (docs/ram-tier.md)"
    ]
    assert result.last == f"error: MOE_L2_LLAMA_SERVER={tmp_path / 'no-such-llama-server'} does not exist"
    # with the RAM to spare: no line
    roomy = run_up(moe_model, tmp_path, MOE_L2_TEST_MEMINFO=str(plant_meminfo(tmp_path, 10**6)))
    assert not [line for line in roomy.lines if line.startswith("warning: ")], roomy.lines


def test_a_cpu_build_s_kv_cache_beyond_the_ram_stops_before_the_build(moe_model: Path, tmp_path: Path) -> None:
    """The KV cache is allocated whole at load, not mapped: on a CPU build (a build-info.json beside the given
    binary says so) it is an error, before any build."""
    build_dir = tmp_path / "cpu-build"
    (build_dir / "bin").mkdir(parents=True)
    (build_dir / "build-info.json").write_text(json.dumps({"backend": "cpu"}))
    result = run_up(
        moe_model,
        tmp_path,
        MOE_L2_TEST_MEMINFO=str(plant_meminfo(tmp_path, 1024)),
        MOE_L2_LLAMA_SERVER=str(build_dir / "bin" / "llama-server"),  # absent: a build would come next
    )
    report_seconds("with MemAvailable 1 MiB, a CPU build", result)
    assert result.last == (
        "error: the KV cache (12.0 MiB for 16384 tokens of context, f16) does not fit the 1.0 MiB of RAM available "
        "(MemAvailable): it is allocated whole at load, and llama-server would be killed for memory; lower the "
        "context (-c 16384: MOE_L2_LLAMA_CTX_PER_REQUEST times MOE_L2_LLAMA_PARALLEL)"
    )


def fake_nvidia_smi(folder: Path, free_mib: list[int]) -> Path:
    """An nvidia-smi that answers the GPU query (index, name, total, free) with these free MiB, one GPU a line."""
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / "nvidia-smi"
    rows = "".join(f"echo '{i}, NVIDIA H100, 81559, {mib}'\n" for i, mib in enumerate(free_mib))
    tool.write_text("#!/bin/sh\n" + rows)
    tool.chmod(0o755)
    return folder


def test_a_cuda_build_weighs_the_gpu_s_free_memory(moe_model: Path, tmp_path: Path) -> None:
    """The weights besides the routed experts and the KV cache go to the GPU under the GPU defaults: against
    nvidia-smi's free memory (summed over the GPUs), a warning line with the figures."""
    build_dir = tmp_path / "cuda-build"
    (build_dir / "bin").mkdir(parents=True)
    (build_dir / "build-info.json").write_text(json.dumps({"backend": "cuda"}))
    tools = fake_nvidia_smi(tmp_path / "tools", [1, 1])
    result = run_up(
        moe_model,
        tmp_path,
        MOE_L2_LLAMA_SERVER=str(build_dir / "bin" / "llama-server"),
        PATH=f"{tools}{os.pathsep}{os.environ['PATH']}",
    )
    assert [line for line in result.lines if line.startswith("warning: ")] == [
        "warning: the weights besides the routed experts (99.8 KiB) and the KV cache (12.0 MiB for 16384 tokens of "
        "context, f16) need 12.1 MiB of GPU memory and nvidia-smi reports 2.0 MiB free: with the GPU defaults "
        "(every layer on the GPU) llama-server will fail to load; lower the context (MOE_L2_LLAMA_CTX_PER_REQUEST) "
        "or set MOE_L2_LLAMA_GPU_LAYERS"
    ]
    assert result.last.endswith("does not exist")  # then the build's turn: no build started


def test_nvidia_smi_s_free_memory_is_read_in_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path / "two", [81000, 40000])))
    assert preflight.nvidia_free_bytes() == 121000 * 2**20
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert preflight.nvidia_free_bytes() is None


def test_a_given_binary_without_build_info_is_one_warning_with_the_fix(moe_model: Path, tmp_path: Path) -> None:
    """MOE_L2_LLAMA_SERVER with no build-info.json: its backend is unknown, so no GPU default is applied; said
    in one line, with where the file goes. (A busy port stops `up` before it would start the binary.)"""
    binary = tmp_path / "elsewhere" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\nexit 1\n")
    binary.chmod(0o755)
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        result = run_up(moe_model, tmp_path, MOE_L2_LLAMA_SERVER=str(binary), MOE_L2_LLAMA_PORT=str(port))
    info = tmp_path / "elsewhere" / "build-info.json"
    assert result.lines[0] == (
        f"warning: llama-server {binary} (MOE_L2_LLAMA_SERVER) has no {info}, so its backend is unknown and the GPU "
        'defaults (-ngl 999, --cpu-moe, the expert cache) are off; for a GPU build write {"backend": "cuda"} (or '
        "vulkan) into that file, or unset MOE_L2_LLAMA_SERVER and let `moe-l2 up` build one"
    )
    assert result.last.startswith(f"error: llama: port {port} ")
    # the fix works: with the file, the plan names the backend and the warning is gone
    info.write_text(json.dumps({"backend": "cuda"}))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        fixed = run_up(moe_model, tmp_path, MOE_L2_LLAMA_SERVER=str(binary), MOE_L2_LLAMA_PORT=str(port))
    assert fixed.lines[0] == f"llama-server: {binary} (MOE_L2_LLAMA_SERVER, a cuda build)"


def test_up_serves_a_build_without_the_test_hooks(
    moe_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`moe-l2 up` (and `make run`) asks the build for a serving binary: no route-trace hook, no upstream test
    programs. Its own code path to the build, stopped there: nothing is compiled."""
    from moe_l2_llama import serving_plan
    from moe_l2_ops import stack

    asked: list[BuildConfig] = []

    def no_build(config: BuildConfig, **_: object) -> Path:
        asked.append(config)
        raise BuildError("stopped where the build would start")

    monkeypatch.setattr(serving_plan, "build", no_build)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # main's handlers would outlive the test
    monkeypatch.delenv("MOE_L2_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("MOE_L2_LLAMA_BACKEND", "cpu")  # the CPU build whatever GPU this machine has
    monkeypatch.setenv("MOE_L2_STATE_DIR", str(tmp_path / "state"))
    for name, port in zip(PORT_VARIABLES, distinct_free_ports(len(PORT_VARIABLES)), strict=True):
        monkeypatch.setenv(name, port)
    assert stack.main(["--model", str(moe_model)]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: stopped where the build would start"
    (config,) = asked
    assert config == BuildConfig() and not config.test_hooks
    assert "-DLLAMA_MOE_TEST_HOOKS=OFF" in config.cmake_flags() and "-DLLAMA_BUILD_TESTS=OFF" in config.cmake_flags()
    assert config.targets() == ["llama-server"]
    patches = build_mod.patch_files(build_mod.default_patches_dir())
    assert build_mod.build_key(config, patches) != build_mod.build_key(BuildConfig(test_hooks=True), patches)


def test_every_build_up_may_choose_is_a_serving_build() -> None:
    """auto's GPU choices too (the CUDA build for the GPU found, the Vulkan build), not only the CPU one."""
    nvidia = GpuDetection(nvidia=(NvidiaGpu("NVIDIA H100", "9.0"),))
    vulkan = GpuDetection(vulkan=(VulkanDevice(0, "Radeon", "DISCRETE_GPU"),))
    chosen = [choose_backend("auto", detection, problem=lambda _: None) for detection in (nvidia, vulkan)]
    chosen.append(choose_backend("cpu"))
    assert [c.backend for c in chosen] == ["cuda", "vulkan", "cpu"]
    assert not any(c.config.test_hooks for c in chosen)


def test_the_test_fixtures_build_with_the_test_hooks() -> None:
    """tests/conftest.py asks for them explicitly: the fixtures' builds are today's test builds, key for key."""
    from tests.conftest import engine_test_build

    for backend in ("cpu", "rpc", "vulkan"):
        config = engine_test_build(backend)
        assert config == BuildConfig(backend=backend, test_hooks=True)
        assert "-DLLAMA_MOE_TEST_HOOKS=ON" in config.cmake_flags() and "test-backend-ops" in config.targets()


def test_the_start_timeout_grows_with_the_model() -> None:
    """MOE_L2_START_TIMEOUT_S is the floor; a model that takes longer to read at 200 MB/s gets that, plus a
    minute, so that its first load is not taken for a hung server."""
    assert preflight.llama_start_timeout(180, 10**9) == 180  # 1 GB: 5 s of reading
    assert preflight.llama_start_timeout(180, 100 * 10**9) == pytest.approx(60 + 500)
    assert preflight.llama_start_timeout(3600, 100 * 10**9) == 3600  # a longer setting stands


def test_the_start_timeout_reaches_llama_s_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from moe_l2_ops.stack import with_llama_start_timeout

    settings = StackSettings(state_dir=tmp_path)
    assert with_llama_start_timeout(settings, 10**6) is settings
    grown = with_llama_start_timeout(settings, 100 * 10**9)
    assert "llama start timeout: 560 s for a 93.1 GiB model" in capsys.readouterr().err
    llama = next(s for s in stack_services(grown, Path("/nonexistent.gguf"), Path("/bin/true")) if s.name == "llama")
    assert llama.start_timeout_s == pytest.approx(560)


def test_the_kv_estimate_matches_llama_cpp_on_known_shapes() -> None:
    """Mixtral 8x7B: 32 layers x 8 KV heads x 128 x (K + V), f16: 128 KiB a token. DeepSeek-V3 with MLA: the
    compressed K alone (576 a layer, no V cache): llama.cpp logs 274.50 MiB for 4,096 tokens."""
    mixtral = {
        "llama.block_count": 32,
        "llama.embedding_length": 4096,
        "llama.attention.head_count": 32,
        "llama.attention.head_count_kv": 8,
    }
    assert preflight.kv_bytes_per_token(mixtral, "llama") == 128 * 1024
    deepseek = {
        "deepseek2.block_count": 61,
        "deepseek2.embedding_length": 7168,
        "deepseek2.attention.head_count": 128,
        "deepseek2.attention.head_count_kv": 1,
        "deepseek2.attention.key_length": 576,
        "deepseek2.attention.value_length": 512,
        "deepseek2.attention.key_length_mla": 192,
        "deepseek2.attention.value_length_mla": 128,
    }
    assert preflight.kv_bytes_per_token(deepseek, "deepseek2") * 4096 == 274.5 * 2**20
    # a hybrid's recurrent layers keep no KV cache (head_count_kv 0 there); no shape, no estimate
    hybrid = {**mixtral, "llama.attention.head_count_kv": [8, 0] * 16}
    assert preflight.kv_bytes_per_token(hybrid, "llama") == 64 * 1024
    assert preflight.kv_bytes_per_token({"llama.block_count": 32}, "llama") == 0


def fit(backend: str, ram: int | None, **kw: object) -> list[preflight.Finding]:
    facts = preflight.ModelFacts(
        tensor_bytes=100 * 2**30,
        routed_bytes=90 * 2**30,
        kv_bytes_per_token=2**20,
        context_length=8192,
        sliding_window=bool(kw.pop("sliding_window", False)),
    )
    fields = {"ctx_size": 4096, "replicas": 1, **kw}
    return preflight.fit_findings(preflight.FitInputs(facts, backend, ram_available=ram, **fields))  # type: ignore[arg-type]


def test_what_does_not_fit_is_an_error_only_where_it_cannot_work() -> None:
    """A CPU build's KV cache beyond the RAM: an error, unless the figure is an upper bound (a sliding window, a
    smaller cache type). The model beyond the RAM: a warning (mmap), none with the RAM tier; a GPU build weighs
    the routed experts against the RAM and the rest with the KV cache against nvidia-smi's free memory."""
    gib = 2**30
    assert [f.level for f in fit("cpu", 3 * gib)] == ["error"]  # a 4 GiB KV cache
    assert [f.level for f in fit("cpu", 3 * gib, sliding_window=True)] == ["warning"]
    assert [f.level for f in fit("cpu", 3 * gib, kv_typed=True)] == ["warning"]
    assert [f.level for f in fit("cpu", 50 * gib)] == ["warning"]  # 104 GiB in 50: mmap
    assert fit("cpu", 50 * gib, ram_budget="40G") == []
    assert fit("cpu", 200 * gib) == [] and fit("cpu", None) == []
    assert [f.level for f in fit("cpu", 50 * gib, ctx_size=0)] == ["warning"]  # the model's 8192 tokens: 8 GiB
    assert "8192 tokens" in fit("cpu", 50 * gib, ctx_size=0)[0].message
    assert fit("cuda", 95 * gib, device_free=80 * gib) == []  # 90 GiB of experts in RAM, 14 GiB on the GPU
    (device,) = fit("cuda", 95 * gib, device_free=12 * gib)
    assert device.level == "warning" and "need 14.0 GiB of GPU memory and nvidia-smi reports 12.0 GiB free" in (
        device.message
    )
    assert [f.level for f in fit("vulkan", 80 * gib)] == ["warning"]  # the experts beyond the RAM
    # two replicas: two KV caches, one mapped model
    assert "4096 tokens of context x 2 replicas" in fit("cpu", 7 * gib, replicas=2)[0].message


def test_the_context_and_cache_type_are_read_from_the_command() -> None:
    assert preflight.context_of(["llama-server", "--ctx-size", "16384", "--parallel", "4"]) == 16384
    assert preflight.context_of(["llama-server", "--ctx-size", "16384", "-c", "2048"]) == 2048  # extra args win
    assert preflight.context_of(["llama-server", "--ctx-size=512"]) == 512
    assert preflight.context_of(["llama-server"]) == 0
    assert preflight.kv_type_given(["llama-server", "-ctk", "q8_0"])
    assert not preflight.kv_type_given(["llama-server", "--ctx-size", "1"])


def test_mem_available_is_read_in_bytes(tmp_path: Path) -> None:
    assert preflight.mem_available(plant_meminfo(tmp_path, 2048)) == 2048 * 1024
    (tmp_path / "other").write_text("MemTotal: 1 kB\n")
    assert preflight.mem_available(tmp_path / "other") is None
    assert preflight.mem_available(tmp_path / "missing") is None


@pytest.fixture
def no_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No admin token in the environment; the state folder in tmp_path. Returns the token file's path."""
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    monkeypatch.delenv(ADMIN_TOKEN_FILE_ENV, raising=False)
    monkeypatch.setenv("MOE_L2_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state" / "admin-token"


def test_admin_token_is_created_private_and_kept_across_starts(no_token: Path) -> None:
    token = stack_admin_token(StackSettings())
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    assert no_token.read_text().strip() == token
    assert stat.S_IMODE(no_token.stat().st_mode) == 0o600
    written = no_token.stat().st_mtime_ns
    assert stack_admin_token(StackSettings()) == token  # the next `moe-l2 up`
    assert no_token.stat().st_mtime_ns == written


def test_admin_token_from_the_environment_wins(no_token: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "given-by-the-user")
    assert stack_admin_token(StackSettings()) == "given-by-the-user"
    assert not no_token.exists(), "a token file was created although MOE_L2_ADMIN_TOKEN is set"
    monkeypatch.delenv(ADMIN_TOKEN_ENV)
    elsewhere = no_token.parent.parent / "secret"
    elsewhere.write_text("from-a-file\n")
    monkeypatch.setenv(ADMIN_TOKEN_FILE_ENV, str(elsewhere))
    assert stack_admin_token(StackSettings()) == "from-a-file"
    assert not no_token.exists()


def test_every_service_gets_the_admin_token(no_token: Path) -> None:
    specs = stack_services(StackSettings(), Path("/nonexistent.gguf"), Path("/bin/true"), admin_token="t0k3n")
    assert [s.name for s in specs] == ["redis", "llama", "cache-manager", "predictor", "proxy"]
    for spec in specs:
        assert spec.env[ADMIN_TOKEN_ENV] == "t0k3n", spec.name
    llama = next(s for s in specs if s.name == "llama")
    assert llama.env["LLAMA_ARG_MOE_ADMIN_TOKEN"] == "t0k3n"


def test_stack_restart_roles(no_token: Path) -> None:
    """Which services a crash loop may leave behind (degraded) and which stop the stack; Redis
    acknowledges a count only once it is on disk."""
    specs = {s.name: s for s in stack_services(StackSettings(), Path("/nonexistent.gguf"), Path("/bin/true"))}
    assert {name for name, s in specs.items() if s.required} == {"redis", "llama", "proxy"}
    argv = specs["redis"].argv
    assert argv[argv.index("--appendonly") + 1] == "yes"
    assert argv[argv.index("--appendfsync") + 1] == "always"


def test_doctor_checks_the_admin_token(no_token: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_l2_ops.doctor import check_admin_token

    check = check_admin_token()
    assert check.status == "warn" and f"`moe-l2 up` creates {no_token}" in check.detail
    token = stack_admin_token(StackSettings())  # what `moe-l2 up` does at its first start
    check = check_admin_token()
    assert (check.status, check.detail) == ("pass", f"{no_token} (the token `moe-l2 up` created), mode 0600")
    no_token.chmod(0o644)
    check = check_admin_token()
    assert check.status == "fail" and "mode 0644: others can read it; chmod 600 it" in check.detail
    assert token not in check.detail
    monkeypatch.setenv(ADMIN_TOKEN_FILE_ENV, str(no_token.parent / "missing"))
    check = check_admin_token()
    assert check.status == "fail" and "cannot read the admin token file" in check.detail
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "from-the-environment")
    assert (check_admin_token().status, check_admin_token().detail) == ("pass", f"from {ADMIN_TOKEN_ENV}")
