"""llama-server as a supervised service: the one place its command, environment and health check meet."""

from __future__ import annotations

from pathlib import Path

from moe_l2_contracts.services import LLAMA
from moe_l2_llama.command_line import llama_server_command, llama_server_env
from moe_l2_llama.settings import LlamaSettings
from moe_l2_llama.vulkan_env import device_env
from moe_l2_ops.supervisor import ServiceSpec, http_ok

# What a stop waits beyond llama-server's drain (--shutdown-timeout): its error events to what still runs, its exit.
LLAMA_STOP_MARGIN_S = 10.0


def llama_service_spec(
    name: str,
    binary: Path,
    model: Path,
    settings: LlamaSettings,
    *,
    url_path: str = "",
    start_timeout_s: float = 120.0,
) -> ServiceSpec:
    """A ServiceSpec that runs the patched llama-server and is healthy once /health answers 200."""
    base = f"http://{settings.host}:{settings.port}"
    return ServiceSpec(
        name=name,
        argv=llama_server_command(binary, model, settings),
        env={**llama_server_env(settings), **device_env(binary)},
        health=http_ok(f"{base}{LLAMA.health_path}"),
        url=base + url_path,
        start_timeout_s=start_timeout_s,
        # SIGKILL before the drain's end would cut the streams it lets finish
        stop_timeout_s=settings.shutdown_timeout_s + LLAMA_STOP_MARGIN_S,
    )
