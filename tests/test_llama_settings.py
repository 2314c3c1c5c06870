"""How the service starts llama-server on this machine: --no-repack on AMX CPUs, the Vulkan device."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from moe_l2_gguf.model_shapes import get_shape, write_shape_model
from moe_l2_llama.build_info import build_backend
from moe_l2_llama.command_line import llama_server_command, llama_server_env
from moe_l2_llama.cpu_features import cpu_has_amx
from moe_l2_llama.settings import LlamaSettings, warn_ctx_size_deprecated
from moe_l2_llama.vulkan_env import device_env
from moe_l2_ops.llama_service import llama_service_spec
from moe_l2_ops.supervisor import Supervisor, free_port

SAPPHIRE_RAPIDS_FLAGS = "fpu vme avx512f avx512_vnni amx_bf16 avx512_fp16 amx_tile amx_int8"


def cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / f"cpuinfo-{len(flags)}"
    path.write_text(f"processor\t: 0\nmodel name\t: some cpu\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    return path


def test_amx_is_read_from_the_cpu_flags(tmp_path: Path) -> None:
    assert cpu_has_amx(cpuinfo(tmp_path, SAPPHIRE_RAPIDS_FLAGS))
    assert not cpu_has_amx(cpuinfo(tmp_path, "fpu vme avx2 avx512f avx512_vnni"))
    assert not cpu_has_amx(tmp_path / "missing")


@pytest.mark.parametrize("repack", [None, True, False])
def test_no_repack_follows_the_cpu_unless_set(repack: bool | None) -> None:
    settings = LlamaSettings(cpu_repack=repack)
    cmd = llama_server_command(Path("llama-server"), Path("m.gguf"), settings)
    expected = not cpu_has_amx() if repack is None else repack
    assert ("--no-repack" not in cmd) == expected


@pytest.mark.parametrize(
    ("value", "flag"),
    [("", None), ("0", None), ("0G", None), ("0%", None), ("0.0%", None), ("4G", "4G"), ("512MiB", "512MiB"),
     ("70%", "70%"), ("12.5%", "12.5%"), ("1024", "1024"), ("auto", "auto"), ("auto:8G", "auto:8G"),
     ("auto:90%", "auto:90%"), ("auto:0", None)],
)  # fmt: skip
def test_the_expert_cache_budget_is_a_size_or_a_share_and_zero_is_off(value: str, flag: str | None) -> None:
    cmd = llama_server_command(Path("llama-server"), Path("m.gguf"), LlamaSettings(expert_cache_bytes=value))
    if flag is None:
        assert "--moe-cache-bytes" not in cmd
    else:
        assert cmd[cmd.index("--moe-cache-bytes") + 1] == flag


@pytest.mark.parametrize("value", ["4 lots", "70 %", "%", "-5%", "1e3%", "0x10", "auto:", "automatic", "auto:auto"])
def test_an_expert_cache_budget_that_is_neither_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="expert_cache_bytes"):
        LlamaSettings(expert_cache_bytes=value)


@pytest.mark.parametrize(
    ("cache", "transitions", "telemetry", "counted"),
    [("", None, True, False), ("4G", None, True, True), ("70%", None, True, True), ("0%", None, True, False),
     ("", True, True, True), ("4G", False, True, False), ("4G", None, False, False), ("", True, False, False)],
)  # fmt: skip
def test_transitions_are_counted_with_the_expert_cache_unless_set(
    cache: str, transitions: bool | None, telemetry: bool, counted: bool
) -> None:
    settings = LlamaSettings(expert_cache_bytes=cache, transitions=transitions, telemetry=telemetry, admin_token="t")
    assert llama_server_env(settings)["LLAMA_ARG_MOE_TRANSITIONS"] == ("1" if counted else "0")


@pytest.mark.parametrize(
    ("cache", "given", "curve"),
    [("", None, None), ("4G", None, None), ("70%", None, None), ("auto:0", None, None), ("auto", None, "shipped"),
     ("auto:8G", None, "shipped"), ("auto:90%", None, "shipped"), ("auto", "/state/mine.txt", "/state/mine.txt"),
     ("4G", "/state/mine.txt", None)],
)  # fmt: skip
def test_the_hit_curve_goes_to_the_auto_placement_only(cache: str, given: str | None, curve: str | None) -> None:
    """--moe-cache-hit-curve (LLAMA_ARG_MOE_CACHE_HIT_CURVE) is what the engine's auto split reads: with auto
    only (a fixed budget reads no curve), the file given, else the shipped default (moe_l2_placement)."""
    from moe_l2_placement.hit_curve import DEFAULT_HIT_CURVE

    env = llama_server_env(LlamaSettings(expert_cache_bytes=cache, hit_curve=given, admin_token="t"))
    expected = str(DEFAULT_HIT_CURVE) if curve == "shipped" else curve
    assert env.get("LLAMA_ARG_MOE_CACHE_HIT_CURVE") == expected


def test_the_hit_curve_setting_reads_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_L2_LLAMA_HIT_CURVE", "/curves/model.txt")
    assert LlamaSettings().hit_curve == Path("/curves/model.txt")
    monkeypatch.setenv("MOE_L2_LLAMA_HIT_CURVE", "")  # compose's ${VAR:-}: unset
    assert LlamaSettings().hit_curve is None


@pytest.mark.parametrize(
    ("budget", "willneed", "flag"),
    [("", None, False), ("12GiB", None, True), ("", True, True), ("12GiB", False, False), ("  ", None, False)],
)
def test_the_engine_reads_experts_ahead_under_a_ram_budget_unless_set(
    budget: str, willneed: bool | None, flag: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOE_L2_RAM_BUDGET", budget)  # stack-wide: the cache-manager holds it, llama follows
    settings = LlamaSettings(moe_willneed=willneed)
    assert ("--moe-willneed" in llama_server_command(Path("llama-server"), Path("m.gguf"), settings)) == flag


def flag(settings: LlamaSettings, name: str) -> str:
    cmd = llama_server_command(Path("llama-server"), Path("/models/m.gguf"), settings)
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize(
    ("given", "slots", "total"),
    [({}, "4", "16384"), ({"ctx_per_request": 8192, "parallel": 3}, "3", "24576"), ({"parallel": 1}, "1", "4096"),
     ({"ctx_size": 12288}, "4", "12288"), ({"ctx_size": 0, "parallel": 2}, "2", "0")],
)  # fmt: skip
def test_the_context_is_each_requests_times_the_slots(given: dict, slots: str, total: str) -> None:
    """-c is the context of all the slots: 4,096 tokens a request over 4 slots by default; a total given
    (ctx_size) is -c itself, 0 the model's own context."""
    settings = LlamaSettings(**given)
    assert (flag(settings, "--parallel"), flag(settings, "--ctx-size")) == (slots, total)


@pytest.mark.parametrize(("env", "alias"), [(None, "moe-l2"), ("", "moe-l2"), ("  ", "moe-l2"), ("acme-7b", "acme-7b")])
def test_clients_see_moe_l2_unless_named(env: str | None, alias: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One name whatever the model file (not the GGUF's general.name): compose's and Kubernetes' default."""
    if env is not None:
        monkeypatch.setenv("MOE_L2_LLAMA_MODEL_ALIAS", env)
    assert flag(LlamaSettings(), "--alias") == alias


def test_the_old_total_warns_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """MOE_L2_LLAMA_CTX_SIZE still sets -c, with one line naming its replacement however often the settings are
    read; a total given in Python (tests, benchmarks) is no variable and says nothing."""
    warn_ctx_size_deprecated.cache_clear()
    with caplog.at_level(logging.WARNING, logger="moe_l2.settings"):
        assert flag(LlamaSettings(ctx_size=2048), "--ctx-size") == "2048"
        assert not caplog.records
        monkeypatch.setenv("MOE_L2_LLAMA_CTX_SIZE", "12288")
        assert [flag(LlamaSettings(), "--ctx-size") for _ in range(2)] == ["12288", "12288"]
    [record] = caplog.records
    assert record.getMessage().startswith(
        "MOE_L2_LLAMA_CTX_SIZE is deprecated: set MOE_L2_LLAMA_CTX_PER_REQUEST instead (-c is it times "
        "MOE_L2_LLAMA_PARALLEL); MOE_L2_LLAMA_CTX_SIZE=12288 is still the total"
    )
    monkeypatch.setenv("MOE_L2_LLAMA_CTX_SIZE", "")  # empty: unset, as compose hands it by default
    assert flag(LlamaSettings(), "--ctx-size") == "16384"


def write_info(tmp_path: Path, info: dict) -> Path:
    binary = tmp_path / "key" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.touch()
    (tmp_path / "key" / "build-info.json").write_text(json.dumps(info))
    return binary


def test_a_vulkan_build_sees_the_software_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GGML_VK_VISIBLE_DEVICES", raising=False)
    vulkan = write_info(tmp_path / "vk", {"backend": "vulkan", "cmake_flags": ["-DGGML_VULKAN=ON"]})
    cpu = write_info(tmp_path / "cpu", {"backend": "cpu", "cmake_flags": []})
    assert build_backend(vulkan) == "vulkan"
    monkeypatch.delenv("LP_NUM_THREADS", raising=False)
    assert device_env(vulkan) == {"GGML_VK_VISIBLE_DEVICES": "0", "LP_NUM_THREADS": "1"}
    monkeypatch.setenv("LP_NUM_THREADS", "4")  # the environment's thread count is kept
    assert device_env(vulkan) == {"GGML_VK_VISIBLE_DEVICES": "0"}
    monkeypatch.delenv("LP_NUM_THREADS")
    assert device_env(cpu) == {}
    assert device_env(tmp_path / "elsewhere" / "llama-server") == {}  # no build-info: nothing to add
    # the environment's own choice wins
    monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", "1")
    assert device_env(vulkan) == {}


@pytest.fixture(scope="module")
def small_ds_v2_lite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("amx") / "ds-v2-lite-3.gguf"
    write_shape_model(path, get_shape("ds-v2-lite").reduced(3, 8192), seed=0, progress=False)
    yield path
    path.unlink(missing_ok=True)


@pytest.mark.llama
@pytest.mark.slow
def test_quantized_shape_serves_with_default_settings(
    llama_binary: Path, small_ds_v2_lite: Path, tmp_path: Path
) -> None:
    # On an AMX CPU this is the case that crashed at warm-up before the service added --no-repack
    # (GGML_ASSERT(*cur_backend_id != -1) for deepseek2); elsewhere it is a plain Q4 model.
    settings = LlamaSettings(port=free_port(), parallel=1, ctx_size=512, threads=2)
    supervisor = Supervisor(tmp_path)
    try:
        supervisor.start(llama_service_spec("llama-ds", llama_binary, small_ds_v2_lite, settings))
        base = f"http://{settings.host}:{settings.port}"
        resp = httpx.post(
            f"{base}/completion",
            json={"prompt": "the capital of france is", "n_predict": 4, "temperature": 0, "ignore_eos": True},
            timeout=120,
        )
    finally:
        supervisor.stop()
    assert resp.status_code == 200, resp.text
    assert resp.json()["tokens_predicted"] == 4
