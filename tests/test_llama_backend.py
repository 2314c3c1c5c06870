"""Which llama-server build `moe-l2 up` serves and `moe-l2 doctor` reports (moe_l2_llama.backend).

The GPU probes run fake `nvidia-smi` / `vulkaninfo` scripts from a PATH that holds nothing else, so
the tests mean the same on a machine with a GPU. Nothing is compiled: a GPU build `up` would use is
planted in a temporary cache under the key build() looks for.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from moe_l2_llama import backend as backend_mod
from moe_l2_llama import build as build_mod
from moe_l2_llama.build import BuildConfig, BuildError
from moe_l2_llama.serving_plan import plan_serving, prepare_llama_server
from moe_l2_llama.settings import LlamaSettings
from moe_l2_llama.vulkan_env import SOFTWARE_VULKAN_ENV, device_env

H100 = "NVIDIA H100 80GB HBM3, 9.0"
# What the driver prints when it cannot reach its GPU (a container without the device, a driver mismatch).
NO_DRIVER = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
LLVMPIPE = """\
Devices:
========
GPU0:
\tapiVersion         = 1.3.230
\tdeviceType         = PHYSICAL_DEVICE_TYPE_CPU
\tdeviceName         = llvmpipe (LLVM 15.0.6, 256 bits)
\tdriverName         = llvmpipe
"""
RADEON_AND_LLVMPIPE = (
    LLVMPIPE
    + """\
GPU1:
\tapiVersion         = 1.3.260
\tdeviceType         = PHYSICAL_DEVICE_TYPE_DISCRETE_GPU
\tdeviceName         = AMD Radeon RX 7900 XTX (RADV NAVI31)
\tdriverName         = radv
"""
)
# Every variable the plan may add to the stack's environment: restored after each test.
PLAN_ENV = [*(f"MOE_L2_LLAMA_{f.upper()}" for f in ("gpu_layers", "cpu_moe", "fit", "expert_cache_bytes")),
            "GGML_OP_OFFLOAD_MIN_BATCH"]  # fmt: skip


def fake_tool(bin_dir: Path, name: str, stdout: str = "", exit_code: int = 0, stderr: str = "") -> Path:
    """A script on the fake PATH that prints what the real tool would and records that it ran."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / name
    script.write_text(
        "#!/bin/sh\n"
        f"echo ran >> '{bin_dir}/{name}.calls'\n"
        # shell builtins only: the fake PATH has no cat
        f"while IFS= read -r line; do printf '%s\\n' \"$line\"; done <<'EOF'\n{stdout}EOF\n"
        + (f"echo '{stderr}' >&2\n" if stderr else "")
        + f"exit {exit_code}\n"
    )
    script.chmod(0o755)
    return script


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH of fake tools only, an empty build cache, and no backend or binary chosen by the caller."""
    path = tmp_path / "bin"
    path.mkdir()
    monkeypatch.setenv("PATH", str(path))
    monkeypatch.setenv("MOE_L2_BUILD_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("MOE_L2_LLAMA_BACKEND", "MOE_L2_LLAMA_SERVER", "GGML_VK_VISIBLE_DEVICES", "LP_NUM_THREADS", *PLAN_ENV):
        monkeypatch.setenv(name, "")  # recorded, so that what the test (or the plan) sets is undone
        monkeypatch.delenv(name)
    return path


def can_build(config: BuildConfig) -> str | None:
    return None


def plant_build(config: BuildConfig) -> Path:
    """A cached build of config where build() looks (with the patch series' strings doctor checks)."""
    patches = build_mod.patch_files(build_mod.default_patches_dir())
    binary = build_mod.cached_binary(build_mod.default_cache_dir(), build_mod.build_key(config, patches))
    binary.parent.mkdir(parents=True)
    binary.write_bytes(b"\x7fELF ... moe_hot_hits_total ... /moe/hot-set ...")
    binary.chmod(0o755)
    for target in config.targets():  # what a complete build keeps next to it (test-backend-ops, ggml-rpc-server)
        if target != "llama-server":
            (binary.parent / target).write_bytes(b"\x7fELF")
            (binary.parent / target).chmod(0o755)
    current = {p.name: build_mod.hashlib.sha256(p.read_bytes()).hexdigest() for p in patches}
    info = {"backend": config.backend, "sdist_sha256": build_mod.SDIST_SHA256, "patches": current}
    (binary.parent.parent / "build-info.json").write_text(json.dumps({**info, "cmake_flags": config.cmake_flags()}))
    return binary


def test_nvidia_smi_picks_the_cuda_build_for_its_compute_capability(bin_dir: Path) -> None:
    fake_tool(bin_dir, "nvidia-smi", H100 + "\n")
    choice = backend_mod.choose_backend("auto", problem=can_build)
    assert choice.backend == "cuda"
    assert choice.config == BuildConfig(backend="cuda", cuda_architectures="90", native=True)
    assert (
        choice.line == "llama-server: CUDA build for sm_90 (nvidia-smi: NVIDIA H100 80GB HBM3, compute capability 9.0)"
    )
    assert choice.build_command() == "moe-l2 build-llama --cuda --arch '90'"


def test_every_gpu_of_the_machine_gets_its_architecture(bin_dir: Path) -> None:
    fake_tool(bin_dir, "nvidia-smi", "NVIDIA H100 80GB HBM3, 9.0\nNVIDIA GeForce RTX 3090, 8.6\nNVIDIA H100, 9.0\n")
    choice = backend_mod.choose_backend("auto", problem=can_build)
    assert choice.config.cuda_architectures == "86;90"
    assert choice.label == "CUDA build for sm_86+sm_90"


def test_a_driver_that_cannot_say_the_capability_gets_the_image_architectures(bin_dir: Path) -> None:
    # drivers before R510 refuse the compute_cap field; the names alone still say there is a GPU
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in *compute_cap*) echo \'Field "compute_cap" is not a valid field to query.\'; exit 2;; esac\n'
        "echo 'Tesla V100-SXM2-16GB'\n"
    )
    script.chmod(0o755)
    choice = backend_mod.choose_backend("auto", problem=can_build)
    assert choice.backend == "cuda" and choice.config.cuda_architectures == build_mod.CUDA_ARCHITECTURES
    assert "does not report the compute capability" in choice.reason


def test_a_failing_nvidia_smi_means_the_cpu_build_and_says_why(bin_dir: Path) -> None:
    fake_tool(bin_dir, "nvidia-smi", NO_DRIVER + "\n", exit_code=9)
    choice = backend_mod.choose_backend("auto", problem=can_build)
    assert choice.backend == "cpu" and choice.config == BuildConfig()
    assert choice.line == (
        f"llama-server: CPU build (no GPU: nvidia-smi failed (exit 9): {NO_DRIVER}, "
        "no Vulkan GPU (vulkaninfo not found))"
    )


def test_no_tool_at_all_is_the_cpu_build(bin_dir: Path) -> None:
    choice = backend_mod.choose_backend("auto", problem=can_build)
    assert choice.line == "llama-server: CPU build (no GPU: nvidia-smi not found, no Vulkan GPU (vulkaninfo not found))"


def test_llvmpipe_is_not_a_gpu(bin_dir: Path) -> None:
    fake_tool(bin_dir, "vulkaninfo", LLVMPIPE)
    choice = backend_mod.choose_backend("auto", problem=can_build)
    assert choice.backend == "cpu"
    assert "no Vulkan GPU (only llvmpipe (LLVM 15.0.6, 256 bits), type CPU)" in choice.reason


def test_a_vulkan_gpu_picks_the_vulkan_build_and_ggml_picks_the_device(bin_dir: Path, tmp_path: Path) -> None:
    fake_tool(bin_dir, "vulkaninfo", RADEON_AND_LLVMPIPE)
    choice = backend_mod.choose_backend("auto", problem=can_build)
    assert choice.backend == "vulkan" and choice.config == BuildConfig(backend="vulkan")
    assert choice.line == "llama-server: Vulkan build (vulkaninfo: GPU1 AMD Radeon RX 7900 XTX (RADV NAVI31))"
    # device 0 is llvmpipe here: the service leaves the choice to ggml-vulkan, which skips CPU devices
    binary = plant_build(choice.config)
    assert device_env(binary) == {}
    fake_tool(bin_dir, "vulkaninfo", LLVMPIPE)  # the software GPU alone: it must be named to be used
    assert device_env(binary) == SOFTWARE_VULKAN_ENV


def test_a_gpu_whose_build_cannot_be_had_falls_back_to_the_next_then_the_cpu(bin_dir: Path) -> None:
    fake_tool(bin_dir, "nvidia-smi", H100 + "\n")
    fake_tool(bin_dir, "vulkaninfo", RADEON_AND_LLVMPIPE.replace("AMD Radeon RX 7900 XTX (RADV NAVI31)", "NVIDIA H100"))

    def no_nvcc(config: BuildConfig) -> str | None:
        return "the CUDA backend needs nvcc (the CUDA toolkit); none found" if config.backend == "cuda" else None

    assert backend_mod.choose_backend("auto", problem=no_nvcc).backend == "vulkan"
    choice = backend_mod.choose_backend("auto", problem=lambda config: f"no {config.backend} toolchain")
    assert choice.backend == "cpu"
    assert choice.reason == (
        "nvidia-smi: NVIDIA H100 80GB HBM3, compute capability 9.0, but no cuda toolchain; "
        "vulkaninfo: GPU1 NVIDIA H100, but no vulkan toolchain"
    )


def test_the_cpu_setting_wins_and_asks_no_gpu_tool(bin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tool(bin_dir, "nvidia-smi", H100 + "\n")
    monkeypatch.setenv("MOE_L2_LLAMA_BACKEND", "cpu")
    plan = plan_serving(LlamaSettings())
    assert plan.line == "llama-server: CPU build (MOE_L2_LLAMA_BACKEND=cpu)"
    assert plan.choice.config == BuildConfig() and plan.env == {}
    assert not (bin_dir / "nvidia-smi.calls").exists()


def test_a_forced_gpu_backend_is_built_whatever_was_found(bin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_L2_LLAMA_BACKEND", "cuda")
    plan = plan_serving(LlamaSettings())
    assert plan.choice.backend == "cuda" and plan.choice.config.cuda_architectures == build_mod.CUDA_ARCHITECTURES
    assert plan.choice.reason == "MOE_L2_LLAMA_BACKEND=cuda; nvidia-smi not found"


def test_the_expert_cache_on_the_cpu_build_is_refused_in_one_line(
    bin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOE_L2_LLAMA_EXPERT_CACHE_BYTES", "8G")
    refusal = "MOE_L2_LLAMA_EXPERT_CACHE_BYTES=8G needs a GPU build, and this machine serves the CPU build (no GPU: "
    with pytest.raises(BuildError, match=re.escape(refusal)):
        plan_serving(LlamaSettings())


def up_on_a_fake_gpu(bin_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, list[str], dict[str, str]]:
    """What `moe-l2 up` logs and runs on a host whose nvidia-smi lists an H100: its line, llama-server's
    command and environment, through the functions `up` calls (the CUDA build planted, not compiled)."""
    from moe_l2_ops.stack import StackSettings, llama_service

    fake_tool(bin_dir, "nvidia-smi", H100 + "\n")
    planted = plant_build(BuildConfig(backend="cuda", cuda_architectures="90"))
    binary = prepare_llama_server(os.environ)
    assert binary == planted
    spec = llama_service(StackSettings(), Path("model.gguf"), binary)
    line = capsys.readouterr().err.strip()
    return line, spec.argv, {**os.environ, **spec.env}


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_up_on_a_gpu_host_serves_the_cuda_build_with_compose_s_gpu_settings(
    bin_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line, argv, env = up_on_a_fake_gpu(bin_dir, capsys)
    assert line == "llama-server: CUDA build for sm_90 (nvidia-smi: NVIDIA H100 80GB HBM3, compute capability 9.0)"
    # compose.yaml's llama service: -ngl 999, --cpu-moe, --fit off, the experts' budget split by the engine
    assert flag(argv, "--gpu-layers") == "999" and "--cpu-moe" in argv and flag(argv, "--fit") == "off"
    assert flag(argv, "--moe-cache-bytes") == "auto" and flag(argv, "--moe-cache-policy") == "default"
    assert env["LLAMA_ARG_MOE_TRANSITIONS"] == "1"  # the prefetch's tables come with the cache
    assert env["GGML_OP_OFFLOAD_MIN_BATCH"] == "1"


def test_up_keeps_what_the_user_set(
    bin_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOE_L2_EXPERT_CACHE_BYTES", "8G")  # the name before the convention counts too
    monkeypatch.setenv("MOE_L2_LLAMA_N_CPU_MOE", "20")
    monkeypatch.setenv("GGML_OP_OFFLOAD_MIN_BATCH", "32")
    _, argv, env = up_on_a_fake_gpu(bin_dir, capsys)
    assert flag(argv, "--moe-cache-bytes") == "8G"
    assert flag(argv, "--n-cpu-moe") == "20" and "--cpu-moe" not in argv  # the user's split, not all experts
    assert env["GGML_OP_OFFLOAD_MIN_BATCH"] == "32"


def test_extra_args_that_decide_the_same_are_kept(
    bin_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOE_L2_LLAMA_EXTRA_ARGS", "-ot 'blk\\.[0-3]\\..*_exps=CPU' -ngl=40")
    _, argv, _ = up_on_a_fake_gpu(bin_dir, capsys)
    assert "--cpu-moe" not in argv and "--gpu-layers" not in argv  # the user's placement and layers
    assert flag(argv, "-ot") == "blk\\.[0-3]\\..*_exps=CPU" and "-ngl=40" in argv
    assert flag(argv, "--fit") == "off" and flag(argv, "--moe-cache-bytes") == "auto"


def test_up_on_a_cpu_host_runs_what_it_ran_before(bin_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from moe_l2_ops.stack import StackSettings, llama_service

    planted = plant_build(BuildConfig())
    assert prepare_llama_server(os.environ) == planted
    argv = llama_service(StackSettings(), Path("model.gguf"), planted).argv
    assert not {"--cpu-moe", "--gpu-layers", "--fit", "--moe-cache-bytes"} & set(argv)
    assert not set(PLAN_ENV) & set(os.environ)
    assert capsys.readouterr().err.startswith("llama-server: CPU build (no GPU: nvidia-smi not found")


def test_doctor_names_the_build_up_serves(bin_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from moe_l2_ops.doctor import check_llama_binary

    line, _, _ = up_on_a_fake_gpu(bin_dir, capsys)
    check = check_llama_binary()
    assert check.status == "pass"
    assert f"llama-server: {check.detail}".startswith(line + ": ")


def test_doctor_says_why_it_falls_back_to_the_cpu(bin_dir: Path) -> None:
    from moe_l2_ops.doctor import check_llama_binary

    fake_tool(bin_dir, "nvidia-smi", NO_DRIVER + "\n", exit_code=9)
    plant_build(BuildConfig(backend="cuda", cuda_architectures="90"))  # built before the driver broke
    expected = plan_serving(LlamaSettings()).summary
    assert expected.startswith(f"CPU build (no GPU: nvidia-smi failed (exit 9): {NO_DRIVER}")
    check = check_llama_binary()
    assert check.status == "warn"
    assert (
        check.detail
        == f"{expected}: not built yet; `moe-l2 up` builds it (or `moe-l2 build-llama`) (also current: cuda)"
    )


def test_outside_up_auto_is_the_cpu_build(bin_dir: Path) -> None:
    """Tests and benchmarks ask llama_server_binary for the engine they measure: a GPU on the machine
    does not turn their CPU build into a 30-minute CUDA compile."""
    from moe_l2_llama.serving_plan import llama_server_binary

    fake_tool(bin_dir, "nvidia-smi", H100 + "\n")
    planted = plant_build(BuildConfig())
    assert llama_server_binary(LlamaSettings()) == planted
    assert not (bin_dir / "nvidia-smi.calls").exists()
