"""Configuration of the llama service, from MOE_L2_* environment variables."""

from __future__ import annotations

import shlex
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class LlamaSettings(BaseSettings):
    """How llama-server is started; compose.yaml sets the same variables."""

    model_config = SettingsConfigDict(env_prefix="MOE_L2_", extra="ignore")

    model_path: Path | None = Field(default=None, description="GGUF model; a demo model is generated if unset")
    llama_server: Path | None = Field(
        default=None, description="use this llama-server binary (built with the patches) instead of building one"
    )
    llama_host: str = "127.0.0.1"
    llama_port: int = Field(default=11436, ge=1, le=65535)
    parallel: int = Field(default=4, ge=1, le=256, description="llama-server slots (-np)")
    ctx_size: int = Field(default=4096, ge=0, description="total context over all slots (-c)")
    threads: int | None = Field(default=None, ge=1, description="CPU threads (-t), llama.cpp picks if unset")
    telemetry: bool = Field(default=True, description="per-domain routing telemetry (LLAMA_MOE_TELEMETRY)")
    n_cpu_moe: int | None = Field(default=None, ge=0, description="keep the experts of the first N layers on the CPU")
    gpu_layers: int | None = Field(default=None, description="-ngl; unset leaves llama.cpp's default")
    llama_extra_args: str = Field(default="", description="more llama-server arguments, shell-quoted")


def llama_server_binary(settings: LlamaSettings) -> Path:
    """The binary to run: MOE_L2_LLAMA_SERVER if set, else the cached build (built now if missing)."""
    if settings.llama_server is not None:
        if not settings.llama_server.is_file():
            from moe_l2_llama.build import BuildError

            raise BuildError(f"MOE_L2_LLAMA_SERVER={settings.llama_server} does not exist")
        return settings.llama_server
    from moe_l2_llama.build import build

    return build()


def llama_server_command(binary: Path, model: Path, settings: LlamaSettings) -> list[str]:
    cmd = [
        str(binary),
        "--model", str(model),
        "--host", settings.llama_host,
        "--port", str(settings.llama_port),
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
    cmd += shlex.split(settings.llama_extra_args)
    return cmd


def llama_server_env(settings: LlamaSettings) -> dict[str, str]:
    """Variables added to the environment of llama-server."""
    return {"LLAMA_MOE_TELEMETRY": "1" if settings.telemetry else "0"}
