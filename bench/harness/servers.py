"""The llama-server a benchmark measures, and how a benchmark stops.

moe_l2_llama, moe_l2_ops and the build are imported inside the functions: `--help` and the pure parts the tests load
need neither.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_l2_ops.supervisor import Supervisor


class BenchError(Exception):
    """Bad input or a setup that cannot run; the message is one line for the user."""


class Interrupted(Exception):
    """SIGTERM (a step timeout of bench/gpu_check.sh): stop measuring, report the runs done."""


def on_sigterm(signum: int, frame: FrameType | None) -> None:
    """signal.signal(SIGTERM, on_sigterm): the measuring loop ends in Interrupted and the JSON is written."""
    raise Interrupted


def resolve_binary(
    binary: Path | None, backend: str = "cpu", *, test_hooks: bool = True, cuda_arch: str | None = None
) -> Path:
    """`binary` checked, else the project's build for `backend` (cached under ~/.cache/moe-l2; built on a
    miss). test_hooks: the route-trace hook, which replays the ESFT trace (the serving build lacks it)."""
    if binary is not None:
        if not binary.is_file():
            raise BenchError(f"--binary {binary} does not exist")
        if not os.access(binary, os.X_OK):
            raise BenchError(f"--binary {binary} is not executable")
        return binary
    from moe_l2_llama.build import BuildConfig, BuildError, build

    try:
        if backend == "cuda":  # the GPU's compute capability, not this machine's CPU
            return build(BuildConfig(backend="cuda", cuda_architectures=cuda_arch, native=False, test_hooks=test_hooks))
        return build(BuildConfig(backend=backend, native=True, test_hooks=test_hooks))
    except BuildError as exc:
        raise BenchError(f"cannot build the {backend} llama-server: {exc}") from exc


def trace_patch_present(binary: Path) -> bool:
    """Whether `binary` replays route traces: a test-hooks build with the route-trace patch."""
    from moe_l2_llama.build import built_with_patch, built_with_test_hooks
    from moe_l2_llama.route_trace import ROUTE_TRACE_ENV

    return built_with_test_hooks(binary) and built_with_patch(
        binary, lambda p: ROUTE_TRACE_ENV in p.read_text(errors="replace")
    )


def start_rpc_device(supervisor: Supervisor, binary: Path, name: str, threads: int) -> str:
    """A ggml-rpc-server of its own for one llama-server (it serves one client at a time; the RPC build's
    `binary` names it), its CPU backend the device: where a rehearsal runs when llvmpipe faults
    (docs/test-bed.md). Started under `supervisor` as `name`; returns host:port for llama-server's --rpc."""
    from moe_l2_llama.build import rpc_server_binary
    from moe_l2_ops.supervisor import ServiceSpec, free_port, tcp_open

    port = free_port()
    argv = [str(rpc_server_binary(binary)), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)]
    spec = ServiceSpec(name, argv, tcp_open("127.0.0.1", port), f"127.0.0.1:{port}", start_timeout_s=60)
    return supervisor.start(spec).spec.url
