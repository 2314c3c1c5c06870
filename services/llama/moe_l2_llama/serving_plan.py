"""The build `moe-l2 up` serves with and `moe-l2 doctor` reports: the backend chosen for this machine,
compose's GPU defaults for what the user left unset (ServingPlan, plan_serving), and the binary itself,
built now if missing (llama_server_binary).

Separate from the settings model and the command line: it probes the machine (the GPU, the toolchain)
and may start a build, neither of which reading the settings or making argv should.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, replace
from pathlib import Path

from moe_l2_contracts.services import LLAMA
from moe_l2_llama import cuda_toolchain
from moe_l2_llama.backend import BackendChoice, GpuDetection, choose_backend
from moe_l2_llama.build import build
from moe_l2_llama.build_cache import built_binary
from moe_l2_llama.build_config import BuildConfig, BuildError
from moe_l2_llama.build_info import known_backend
from moe_l2_llama.command_line import expert_cache_on
from moe_l2_llama.settings import LlamaSettings


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
