"""Configuration of the llama service: its own MOE_L2_LLAMA_* variables and the stack-wide ones
(moe_l2_contracts.env gives the convention)."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from moe_l2_contracts.admin import configured_token
from moe_l2_contracts.env import ServiceSettings, renamed_before_convention, stack_wide
from moe_l2_contracts.services import LLAMA
from moe_l2_domains.known import known_domains
from moe_l2_llama import cuda_toolchain
from moe_l2_llama.backend import BackendChoice, GpuDetection, choose_backend, probe_vulkan
from moe_l2_llama.build import BuildConfig, BuildError, build, built_binary

log = logging.getLogger("moe_l2.settings")  # where the convention's renamed variables warn too

# The defaults every launcher starts llama-server with (`moe-l2 up` from these fields, compose.yaml's
# `${VAR:-default}` and the Kubernetes base's values; tests/test_launcher_settings.py holds them equal).
# Four slots of 4,096 tokens each: llama-server's -c is the context of all its slots together.
DEFAULT_PARALLEL = 4
DEFAULT_CTX_PER_REQUEST = 4096
# One name whatever the file, on every launcher: the containers cannot read the GGUF's own name
# (llama's image has no Python; llama-server alone would report the model's path), and clients
# configured with it keep working when the model file changes.
DEFAULT_MODEL_ALIAS = "moe-l2"
CTX_SIZE_ENV = LLAMA.env_prefix + "CTX_SIZE"  # the total before ctx_per_request: still read, with a warning


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
    backend: Literal["auto", "cpu", "cuda", "vulkan"] = Field(
        default="auto",
        description="which build `moe-l2 up` serves with: auto finds the GPU (nvidia-smi: CUDA, vulkaninfo: Vulkan) "
        "and falls back to the CPU build; cpu forces the CPU build (moe_l2_llama.backend)",
    )
    host: str = "127.0.0.1"
    port: int = Field(default=LLAMA.port, ge=1, le=65535)
    parallel: int = Field(default=DEFAULT_PARALLEL, ge=1, le=256, description="llama-server slots (-np)")
    ctx_per_request: int = Field(
        default=DEFAULT_CTX_PER_REQUEST,
        ge=1,
        description="context of each request, in tokens (prompt and answer): llama-server's -c is this times "
        "parallel, the context of all the slots together",
    )
    ctx_size: int | None = Field(
        default=None,
        ge=0,
        description="total context over all slots (-c), instead of ctx_per_request times parallel; "
        "MOE_L2_LLAMA_CTX_SIZE is deprecated (a warning): set MOE_L2_LLAMA_CTX_PER_REQUEST",
    )
    threads: int | None = Field(default=None, ge=1, description="CPU threads (-t), llama.cpp picks if unset")
    telemetry: bool = Field(default=True, description="per-domain routing telemetry (--moe-telemetry)")
    cpu_moe: bool | None = Field(
        default=None,
        description="keep every MoE layer's experts in host memory (--cpu-moe); unset: on for a GPU build under "
        "`moe-l2 up` unless n_cpu_moe is set, as compose.yaml does",
    )
    n_cpu_moe: int | None = Field(default=None, ge=0, description="keep the experts of the first N layers on the CPU")
    fit: Literal["on", "off"] | None = Field(
        default=None,
        description="let llama.cpp fit unset parameters to the free device memory (--fit); unset: llama.cpp's "
        "default, off for a GPU build under `moe-l2 up` as in compose.yaml",
    )
    gpu_layers: int | None = Field(default=None, description="-ngl; unset leaves llama.cpp's default")
    extra_args: str = Field(default="", description="more llama-server arguments, shell-quoted")
    cpu_repack: bool | None = Field(
        default=None,
        description="let the CPU backend repack weights into its own buffer types; unset: off on CPUs with "
        "AMX, where the repacked path crashes (see cpu_has_amx), on elsewhere",
    )
    model_alias: str = Field(
        default=DEFAULT_MODEL_ALIAS,
        description="the model name clients see in /v1/models, /api/tags and every answer (empty: the default)",
    )
    admin_token: str = stack_wide(
        "ADMIN_TOKEN", default="", description="required by llama's admin calls (see moe_l2_contracts.admin)"
    )
    expert_cache_bytes: str = Field(
        default="",
        pattern=r"^(|auto|(auto:)?(\d+([KkMmGgTt]([Ii]?[Bb])?|[Bb])?|\d+(\.\d+)?%))$",
        description="device memory for the expert cache (--moe-cache-bytes), e.g. 4G or 512M, or a share of "
        "the device memory left free once the weights and the KV cache are placed, e.g. 70%; empty, 0 or 0%: off. "
        "It needs a GPU build and experts kept in host memory (n_cpu_moe, or --cpu-moe in extra_args). "
        "auto (the GPU default), auto:8G or auto:90%: a budget split between whole layers of experts on the "
        "device and the cache for the others, as the engine's cost model decides (docs/expert-cache.md)",
    )
    expert_cache_policy: Literal["default", "hybrid", "lru"] = Field(
        default="default", description="which experts the cache keeps (--moe-cache-policy)"
    )
    transitions: bool | None = Field(
        default=None,
        description="count per domain which expert follows which at the next layer (--moe-transitions), "
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

    @field_validator("parallel", "ctx_per_request", "ctx_size", "model_alias", mode="before")
    @classmethod
    def _empty_is_the_default(cls, value: object, info: ValidationInfo) -> object:
        # as compose's ${MOE_L2_LLAMA_PARALLEL:-4}: an empty variable is an unset one, on every launcher
        if isinstance(value, str) and not value.strip():
            return cls.model_fields[str(info.field_name)].default
        return value

    @model_validator(mode="after")
    def _warn_of_the_total(self) -> LlamaSettings:
        # the variable, not the field: tests and benchmarks give a total in Python, without a warning
        for name in (CTX_SIZE_ENV, *(old for old, field in self.renamed_env.items() if field == "ctx_size")):
            if given := os.environ.get(name, "").strip():
                warn_ctx_size_deprecated(name, given)
        return self


@cache
def warn_ctx_size_deprecated(name: str, value: str) -> None:
    """One line, once per value: `moe-l2 up` builds the settings several times (its plan, each replica)."""
    log.warning(
        "%s is deprecated: set %sCTX_PER_REQUEST instead (-c is it times %sPARALLEL); %s=%s is still the total",
        name, LLAMA.env_prefix, LLAMA.env_prefix, name, value,
    )  # fmt: skip


def total_context(settings: LlamaSettings) -> int:
    """llama-server's -c, the context of all its slots together: each request's times the slots, unless
    a total is given (ctx_size)."""
    return settings.ctx_size if settings.ctx_size is not None else settings.ctx_per_request * settings.parallel


def expert_cache_on(settings: LlamaSettings) -> bool:
    value = settings.expert_cache_bytes
    return value == "auto" or bool(re.sub(r"[^1-9]", "", value))  # auto, or any nonzero digit: not off


def willneed_on(settings: LlamaSettings) -> bool:
    """A model larger than its RAM budget is read expert by expert from its mapping: the engine asks for each
    layer's chosen experts at once instead of faulting them in (docs/ram-tier.md has the measurement)."""
    return settings.moe_willneed if settings.moe_willneed is not None else bool(settings.ram_budget.strip())


def counts_transitions(settings: LlamaSettings) -> bool:
    # a domain's table is n_layer x n_expert^2 counts (15 MiB for DeepSeek-V3): worth it only for a cache
    wanted = settings.transitions if settings.transitions is not None else expert_cache_on(settings)
    return settings.telemetry and wanted


def llama_server_binary(settings: LlamaSettings, choice: BackendChoice | None = None) -> Path:
    """The binary to run: MOE_L2_LLAMA_SERVER if set, else the cached build of `choice`, built now if
    missing. Without a choice, the backend settings.backend names; `auto` is `moe-l2 up`'s to resolve
    (plan_serving) and means the CPU build here, the one tests and benchmarks measure."""
    if settings.server is not None:
        if not settings.server.is_file():
            raise BuildError(f"MOE_L2_LLAMA_SERVER={settings.server} does not exist")
        return settings.server
    config = (choice or choose_backend("cpu" if settings.backend == "auto" else settings.backend)).config
    if config.backend == "cuda" and built_binary(config) is None:
        config = _checked_cuda_config(config)
    return build(config)


def _checked_cuda_config(config: BuildConfig) -> BuildConfig:
    """The architectures checked against this nvcc before a 30-minute compile starts (as build-llama does)."""
    try:
        return replace(config, cuda_architectures=cuda_toolchain.resolve_arch(config.cuda_architectures))
    except cuda_toolchain.ToolchainError as exc:
        raise BuildError(f"{exc} (MOE_L2_LLAMA_BACKEND=cpu serves the CPU build)") from exc


# compose.yaml's llama service on a GPU: every layer on the device, the routed experts in host memory,
# no fitting, and the expert budget split between whole layers and the cache by the engine (auto: all the
# device memory a dry run finds free for experts, less --fit-target's 1 GiB margin).
GPU_DEFAULTS: Mapping[str, str] = {"gpu_layers": "999", "cpu_moe": "1", "fit": "off", "expert_cache_bytes": "auto"}
# and decode's expert matmuls on the device for the experts the cache does not hold (compose sets it too)
GPU_PROCESS_ENV: Mapping[str, str] = {"GGML_OP_OFFLOAD_MIN_BATCH": "1"}
# llama-server's flags in MOE_L2_LLAMA_EXTRA_ARGS that already decide what a GPU default would
# (-ot: the user places tensors, the experts among them, where they want them)
GPU_DEFAULT_FLAGS: Mapping[str, tuple[str, ...]] = {
    "gpu_layers": ("-ngl", "--gpu-layers", "--n-gpu-layers"),
    "cpu_moe": ("-cmoe", "--cpu-moe", "-ncmoe", "--n-cpu-moe", "-ot", "--override-tensor"),
    "fit": ("-fit", "--fit"),
    "expert_cache_bytes": ("--moe-cache-bytes",),
}


@dataclass(frozen=True)
class ServingPlan:
    """What `moe-l2 up` serves with: the build and why, and compose's GPU defaults for what the
    user left unset, as the variables every llama replica's settings read."""

    choice: BackendChoice
    env: dict[str, str]
    given: Path | None = None  # MOE_L2_LLAMA_SERVER

    @property
    def summary(self) -> str:
        if self.given is None:
            return self.choice.summary
        return f"{self.given} ({self.choice.reason})"

    @property
    def line(self) -> str:
        return f"llama-server: {self.summary}"


def gpu_default_env(settings: LlamaSettings, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """GPU_DEFAULTS as MOE_L2_LLAMA_* variables, for the fields the user did not set (under either of
    a field's names: model_fields_set holds what any source gave), plus GPU_PROCESS_ENV where unset."""
    environ = os.environ if environ is None else environ
    given = settings.model_fields_set
    extra = {arg.split("=", 1)[0] for arg in shlex.split(settings.extra_args)}
    env = {}
    for field, value in GPU_DEFAULTS.items():
        # a user's --n-cpu-moe split (or --cpu-moe itself) is their choice of where experts live
        if field in given or (field == "cpu_moe" and "n_cpu_moe" in given) or extra & set(GPU_DEFAULT_FLAGS[field]):
            continue
        env[f"{LLAMA.env_prefix}{field.upper()}"] = value
    env.update({name: value for name, value in GPU_PROCESS_ENV.items() if name not in environ})
    return env


def plan_serving(settings: LlamaSettings, detection: GpuDetection | None = None) -> ServingPlan:
    """The build `moe-l2 up` serves with and `moe-l2 doctor` reports (one function, so they agree).

    A CPU build with the expert cache asked for is refused here, in one line, rather than by
    llama-server after the model has loaded."""
    if settings.server is not None:
        backend = known_backend(settings.server)
        if backend is None:
            why = "MOE_L2_LLAMA_SERVER; no build-info.json beside it, so its backend is unknown: no GPU defaults"
            return ServingPlan(BackendChoice("unknown", BuildConfig(), why), {}, settings.server)
        choice = BackendChoice(backend, BuildConfig(backend=backend), f"MOE_L2_LLAMA_SERVER, a {backend} build")
        env = gpu_default_env(settings) if backend in ("cuda", "vulkan") else {}
        return ServingPlan(choice, env, settings.server)
    choice = choose_backend(settings.backend, detection)
    if choice.backend == "cpu" and expert_cache_on(settings):
        raise BuildError(
            f"MOE_L2_LLAMA_EXPERT_CACHE_BYTES={settings.expert_cache_bytes} needs a GPU build, and this machine "
            f"serves the {choice.summary}: unset it, or see MOE_L2_LLAMA_BACKEND / MOE_L2_LLAMA_SERVER"
        )
    return ServingPlan(choice, gpu_default_env(settings) if choice.backend != "cpu" else {})


def prepare_llama_server(environ: MutableMapping[str, str]) -> Path:
    """`moe-l2 up`'s llama-server: logs which build serves and why, adds the plan's GPU defaults to
    `environ` (the stack's environment, which each replica's LlamaSettings and llama-server read,
    as compose's `${VAR:-default}`), and returns the binary, built now if missing."""
    settings = LlamaSettings()
    plan = plan_serving(settings)
    print(plan.line, file=sys.stderr, flush=True)
    for name, value in plan.env.items():
        environ.setdefault(name, value)
    return llama_server_binary(settings, plan.choice)


def llama_server_command(binary: Path, model: Path, settings: LlamaSettings) -> list[str]:
    cmd = [
        str(binary),
        "--model", str(model),
        "--host", settings.host,
        "--port", str(settings.port),
        "--parallel", str(settings.parallel),
        "--ctx-size", str(total_context(settings)),
        "--metrics",
        "--no-webui",
    ]  # fmt: skip
    if settings.threads:
        cmd += ["--threads", str(settings.threads)]
    if settings.cpu_moe:
        cmd.append("--cpu-moe")
    if settings.n_cpu_moe is not None:
        cmd += ["--n-cpu-moe", str(settings.n_cpu_moe)]
    if settings.fit is not None:
        cmd += ["--fit", settings.fit]
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
    cmd += ["--alias", settings.model_alias]
    cmd += shlex.split(settings.extra_args)
    return cmd


def llama_server_env(settings: LlamaSettings) -> dict[str, str]:
    """Variables added to the environment of llama-server, the LLAMA_ARG_* variables of its MoE flags
    (patches 0018-0023): --moe-telemetry and --moe-transitions, the admin token (a variable, not
    --moe-admin-token, which `ps` would show; empty: every admin call is refused) and --moe-domains,
    the domains a request may be tagged with."""
    return {
        "LLAMA_ARG_MOE_TELEMETRY": "1" if settings.telemetry else "0",
        "LLAMA_ARG_MOE_TRANSITIONS": "1" if counts_transitions(settings) else "0",
        "LLAMA_ARG_MOE_ADMIN_TOKEN": settings.admin_token or configured_token(),
        "LLAMA_ARG_MOE_DOMAINS": ",".join(sorted(known_domains())),
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


def known_backend(binary: Path) -> str | None:
    """The backend a binary was built for, from the build-info.json that `moe-l2 build-llama` writes
    next to its bin/; None for a binary from elsewhere."""
    info = binary.parent.parent / "build-info.json"
    try:
        data = json.loads(info.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if backend := data.get("backend"):
        return str(backend)
    return "vulkan" if "-DGGML_VULKAN=ON" in data.get("cmake_flags", []) else "cpu"


def build_backend(binary: Path) -> str:
    """known_backend, "cpu" for a binary from elsewhere: nothing says otherwise."""
    return known_backend(binary) or "cpu"


# The software GPU: device 0, and one llvmpipe thread. With llvmpipe's default of one thread per core,
# Mesa 22.3.6's lavapipe (Debian 12) corrupted its heap ("double free or corruption", SIGABRT) or never
# answered a prompt of 9 tokens through llama-server's Vulkan backend, in 5 starts of 5 on a 2-core Xeon
# with AVX-512 (2026-12-06; LP_NUM_THREADS=2 failed 1 start of 3, LP_NATIVE_VECTOR_WIDTH=256 hung on
# every prompt); with LP_NUM_THREADS=1 every prompt of
# 2, 7, 9 and 25 tokens answered in 5 starts of 5, as fast within the noise (a 9-token prompt 3.7-6.1 s
# against 4.2 s). So the "batches of 3 to 8 rows" fault of tests/llvmpipe_probe.py is a race between
# llvmpipe's threads: a 7-token prompt answers on one thread.
SOFTWARE_VULKAN_ENV = {"GGML_VK_VISIBLE_DEVICES": "0", "LP_NUM_THREADS": "1"}


def device_env(binary: Path) -> dict[str, str]:
    """Variables that let a GPU build find its device.

    ggml-vulkan skips devices of type CPU (Mesa's llvmpipe, the software GPU of machines without
    one) unless GGML_VK_VISIBLE_DEVICES names them, and then runs everything on the CPU backend
    without a word. A Vulkan build therefore gets device 0 unless the environment already chooses,
    or vulkaninfo lists a real GPU: ggml-vulkan then picks the discrete and integrated GPUs itself,
    where device 0 could be llvmpipe. On a machine with several devices, set GGML_VK_VISIBLE_DEVICES.
    On llvmpipe, LP_NUM_THREADS=1 as well (SOFTWARE_VULKAN_ENV), unless the environment sets it.
    """
    if build_backend(binary) != "vulkan" or "GGML_VK_VISIBLE_DEVICES" in os.environ:
        return {}
    devices, _ = probe_vulkan()
    if any(d.is_gpu for d in devices):
        return {}
    return {k: v for k, v in SOFTWARE_VULKAN_ENV.items() if k == "GGML_VK_VISIBLE_DEVICES" or k not in os.environ}
