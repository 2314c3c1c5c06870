"""Configuration of the llama service: its own MOE_L2_LLAMA_* variables and the stack-wide ones
(moe_l2_contracts.env gives the convention)."""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from moe_l2_contracts.admin import configured_token
from moe_l2_contracts.env import ServiceSettings, renamed_before_convention, stack_wide
from moe_l2_contracts.services import LLAMA
from moe_l2_domains.known import known_domains


class LlamaSettings(ServiceSettings):
    """How llama-server is started; compose.yaml sets the same variables."""

    model_config = SettingsConfigDict(env_prefix=LLAMA.env_prefix, extra="ignore", populate_by_name=True)
    renamed_env: ClassVar[Mapping[str, str]] = renamed_before_convention(
        "parallel",
        "ctx_size",
        "threads",
        "telemetry",
        "n_cpu_moe",
        "gpu_layers",
        "cpu_repack",
        "model_alias",
        "expert_cache_bytes",
        "expert_cache_policy",
        "transitions",
    )

    model_path: Path | None = stack_wide(
        "MODEL_PATH", default=None, description="GGUF model; a demo model is generated if unset"
    )
    server: Path | None = Field(
        default=None, description="use this llama-server binary (built with the patches) instead of building one"
    )
    host: str = "127.0.0.1"
    port: int = Field(default=LLAMA.port, ge=1, le=65535)
    parallel: int = Field(default=4, ge=1, le=256, description="llama-server slots (-np)")
    ctx_size: int = Field(default=4096, ge=0, description="total context over all slots (-c)")
    threads: int | None = Field(default=None, ge=1, description="CPU threads (-t), llama.cpp picks if unset")
    telemetry: bool = Field(default=True, description="per-domain routing telemetry (LLAMA_MOE_TELEMETRY)")
    n_cpu_moe: int | None = Field(default=None, ge=0, description="keep the experts of the first N layers on the CPU")
    gpu_layers: int | None = Field(default=None, description="-ngl; unset leaves llama.cpp's default")
    extra_args: str = Field(default="", description="more llama-server arguments, shell-quoted")
    cpu_repack: bool | None = Field(
        default=None,
        description="let the CPU backend repack weights into its own buffer types; unset: off on CPUs with "
        "AMX, where the repacked path crashes (see cpu_has_amx), on elsewhere",
    )
    model_alias: str = Field(
        default="", description="the model name clients see (default: the GGUF's general.name, else the file stem)"
    )
    admin_token: str = stack_wide(
        "ADMIN_TOKEN", default="", description="required by llama's admin calls (see moe_l2_contracts.admin)"
    )
    expert_cache_bytes: str = Field(
        default="",
        pattern=r"^(|\d+([KkMmGgTt]([Ii]?[Bb])?|[Bb])?|\d+(\.\d+)?%)$",
        description="device memory for the expert cache (--moe-cache-bytes), e.g. 4G or 512M, or a share of "
        "the device memory left free once the weights and the KV cache are placed, e.g. 70%; empty, 0 or 0%: off. "
        "It needs a GPU build and experts kept in host memory (n_cpu_moe, or --cpu-moe in extra_args)",
    )
    expert_cache_policy: Literal["default", "hybrid", "lru"] = Field(
        default="default", description="which experts the cache keeps (--moe-cache-policy)"
    )
    transitions: bool | None = Field(
        default=None,
        description="count per domain which expert follows which at the next layer (LLAMA_MOE_TRANSITIONS), "
        "the tables the expert cache's prefetch learns from; needs the telemetry; unset: on with the expert cache",
    )
    ram_budget: str = stack_wide(
        "RAM_BUDGET", default="", description="the RAM tier's budget, held by the cache-manager (docs/ram-tier.md)"
    )
    moe_willneed: bool | None = Field(
        default=None,
        description="as soon as a MoE layer's router has chosen, read the chosen experts ahead from the mapped "
        "model (--moe-willneed); unset: on when MOE_L2_RAM_BUDGET is set",
    )


def expert_cache_on(settings: LlamaSettings) -> bool:
    return bool(re.sub(r"[^1-9]", "", settings.expert_cache_bytes))  # any nonzero digit: not off


def willneed_on(settings: LlamaSettings) -> bool:
    """A model larger than its RAM budget is read expert by expert from its mapping: the engine asks for each
    layer's chosen experts at once instead of faulting them in (docs/ram-tier.md has the measurement)."""
    return settings.moe_willneed if settings.moe_willneed is not None else bool(settings.ram_budget.strip())


def counts_transitions(settings: LlamaSettings) -> bool:
    # a domain's table is n_layer x n_expert^2 counts (15 MiB for DeepSeek-V3): worth it only for a cache
    wanted = settings.transitions if settings.transitions is not None else expert_cache_on(settings)
    return settings.telemetry and wanted


def llama_server_binary(settings: LlamaSettings) -> Path:
    """The binary to run: MOE_L2_LLAMA_SERVER if set, else the cached build (built now if missing)."""
    if settings.server is not None:
        if not settings.server.is_file():
            from moe_l2_llama.build import BuildError

            raise BuildError(f"MOE_L2_LLAMA_SERVER={settings.server} does not exist")
        return settings.server
    from moe_l2_llama.build import build

    return build()


def llama_server_command(binary: Path, model: Path, settings: LlamaSettings) -> list[str]:
    cmd = [
        str(binary),
        "--model", str(model),
        "--host", settings.host,
        "--port", str(settings.port),
        "--parallel", str(settings.parallel),
        "--ctx-size", str(settings.ctx_size),
        "--metrics",
        "--no-webui",
    ]  # fmt: skip
    if settings.threads:
        cmd += ["--threads", str(settings.threads)]
    if settings.n_cpu_moe is not None:
        cmd += ["--n-cpu-moe", str(settings.n_cpu_moe)]
    if settings.gpu_layers is not None:
        cmd += ["--gpu-layers", str(settings.gpu_layers)]
    if expert_cache_on(settings):
        cmd += ["--moe-cache-bytes", settings.expert_cache_bytes, "--moe-cache-policy", settings.expert_cache_policy]
    if willneed_on(settings):
        cmd.append("--moe-willneed")
    repack = settings.cpu_repack if settings.cpu_repack is not None else not cpu_has_amx()
    if not repack:
        cmd.append("--no-repack")
    # clients see a model name, never the host path llama-server would report as the model id
    cmd += ["--alias", settings.model_alias or model_name(model)]
    cmd += shlex.split(settings.extra_args)
    return cmd


def model_name(model: Path) -> str:
    """The GGUF's `general.name`, else the file's stem (a split model's shard suffix dropped)."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(model).get_field("general.name")
        if field is not None:
            name = str(field.contents()).strip()
            if name:
                return name
    except (OSError, ValueError, KeyError, IndexError):
        pass  # not readable as GGUF here: llama-server will say why; the stem still names it
    return re.sub(r"-\d{5}-of-\d{5}$", "", model.stem)


def llama_server_env(settings: LlamaSettings) -> dict[str, str]:
    """Variables added to the environment of llama-server: the telemetry and transitions switches, the
    admin token (empty: every admin call is refused) and the domains a request may be tagged with."""
    return {
        "LLAMA_MOE_TELEMETRY": "1" if settings.telemetry else "0",
        "LLAMA_MOE_TRANSITIONS": "1" if counts_transitions(settings) else "0",
        "LLAMA_MOE_ADMIN_TOKEN": settings.admin_token or configured_token(),
        "LLAMA_MOE_DOMAINS": ",".join(sorted(known_domains())),
    }


@cache
def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True on CPUs with AMX (Intel Sapphire Rapids and later), where llama-server needs --no-repack.

    The native CPU build then moves quantized 2-D weights into ggml's AMX buffer type, and that path
    crashes on Q4_K/Q4_0/Q8_0 models at warm-up (measured when the model shapes were added, on a
    Xeon with amx_int8, build 0c1e570: a segfault in ggml_backend_amx_mul_mat for a qwen3moe file,
    GGML_ASSERT(*cur_backend_id != -1) in the scheduler for a deepseek2 one; llama.cpp#20824).
    --no-repack keeps the weights in the plain CPU buffer and both generate. Without AMX the repacked
    layouts are sound and faster (an AMD EPYC without AMX serves the same 3-layer ds-v2-lite file
    with and without the flag), so only AMX CPUs lose them. F16/F32 models never take that path.
    """
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "amx_int8" in flags


def build_backend(binary: Path) -> str:
    """The backend a binary was built for, from the build-info.json that `moe-l2 build-llama` writes
    next to its bin/ ("cpu" for a binary from elsewhere: nothing says otherwise)."""
    info = binary.parent.parent / "build-info.json"
    try:
        data = json.loads(info.read_text())
    except (OSError, ValueError):
        return "cpu"
    if backend := data.get("backend"):
        return str(backend)
    return "vulkan" if "-DGGML_VULKAN=ON" in data.get("cmake_flags", []) else "cpu"


def device_env(binary: Path) -> dict[str, str]:
    """Variables that let a GPU build find its device.

    ggml-vulkan skips devices of type CPU (Mesa's llvmpipe, the software GPU of machines without
    one) unless GGML_VK_VISIBLE_DEVICES names them, and then runs everything on the CPU backend
    without a word. A Vulkan build therefore gets device 0 unless the environment already chooses:
    on a machine with several devices, set GGML_VK_VISIBLE_DEVICES yourself.
    """
    if build_backend(binary) == "vulkan" and "GGML_VK_VISIBLE_DEVICES" not in os.environ:
        return {"GGML_VK_VISIBLE_DEVICES": "0"}
    return {}
