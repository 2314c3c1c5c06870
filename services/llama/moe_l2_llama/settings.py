"""Configuration of the llama service: its own MOE_L2_LLAMA_* variables and the stack-wide ones
(moe_l2_contracts.env gives the convention).

The settings model alone (LlamaSettings, its defaults and validators). What is made of it lives beside it,
each in its own module: llama-server's argv and environment (command_line), the build `moe-l2 up` serves
(serving_plan), the CPU's features (cpu_features), a Vulkan build's device variables (vulkan_env) and what a
binary's build-info.json says (build_info); none of them is needed to read the settings."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from moe_l2_contracts.env import ServiceSettings, renamed_before_convention, stack_wide
from moe_l2_contracts.services import LLAMA

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
# The gateway's drain (MOE_L2_PROXY_DRAIN_S) is as long: a llama replica stopped alone (a rolling restart,
# a pod moved) lets a stream the gateway is relaying finish as the gateway would.
DEFAULT_SHUTDOWN_TIMEOUT_S = 30
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
    hit_curve: Path | None = Field(
        default=None,
        description="the hit curve expert_cache_bytes=auto splits the budget with (--moe-cache-hit-curve): the hit "
        "rate of a layer's cache against the share of its experts it holds (moe_l2_placement.hit_curve); unset: "
        "under `moe-l2 up` the curve its cache-manager calibrated on the hit rate the engine measured, if there is "
        "one, else the shipped default (the project's policy replayed on DeepSeek-V2-Lite's ESFT routing)",
    )
    transitions: bool | None = Field(
        default=None,
        description="count per domain which expert follows which at the next layer (--moe-transitions), "
        "the tables the expert cache's prefetch learns from; needs the telemetry; unset: on with the expert cache",
    )
    ram_budget: str = stack_wide(
        "RAM_BUDGET", default="", description="the RAM tier's budget, held by the cache-manager (docs/ram-tier.md)"
    )
    shutdown_timeout_s: int = Field(
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        ge=0,
        description="on SIGTERM, llama-server answers new requests 503 and lets those in flight finish for this "
        "many seconds (--shutdown-timeout); what still runs then ends with an error event, never a cut stream",
    )
    moe_willneed: bool | None = Field(
        default=None,
        description="as soon as a MoE layer's router has chosen, read the chosen experts ahead from the mapped "
        "model (--moe-willneed); unset: on when MOE_L2_RAM_BUDGET is set",
    )

    @field_validator("parallel", "ctx_per_request", "ctx_size", "model_alias", "hit_curve", mode="before")
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
