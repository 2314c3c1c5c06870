"""Device memory for bench/expert_offload.py: what is free before the servers start, what each config's server
needs (so that every config fits beside the others, or all-device is dropped with its reason), and what each
server holds, from llama-server's own account of its buffers."""

from __future__ import annotations

import re
import shutil
import subprocess

from harness.output import meminfo_bytes
from harness.servers import BenchError
from offload_configs import Config, ExpertLayout

DEVICE_MARGIN_BYTES = 1 << 30  # KV cache, compute buffers and the driver's own, per server


def device_free_bytes(backend: str) -> int | None:
    """Free memory of the device the servers will use: the GPU's (nvidia-smi) for CUDA; host memory
    for Vulkan, whose llvmpipe device allocates from it (a real Vulkan GPU is not checked), and for the RPC
    device, whose ggml-rpc-servers do; None for the CPU backend, which has no device."""
    if backend == "cuda":
        if not shutil.which("nvidia-smi"):
            raise BenchError("--backend cuda but nvidia-smi is not on PATH: no NVIDIA driver here")
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0 or not out.stdout.strip():
            raise BenchError(f"nvidia-smi cannot read the GPU's free memory: {out.stderr.strip() or out.stdout}")
        return int(out.stdout.split()[0]) << 20
    if backend in ("vulkan", "rpc"):
        return meminfo_bytes("MemAvailable") or None
    return None


def device_need(
    config: Config, layout: ExpertLayout, device_expert_bytes: int, margin: int = DEVICE_MARGIN_BYTES
) -> int:
    """A server's device memory, estimated: the non-expert weights, its experts, a margin."""
    need = layout.other_bytes + margin
    if config.base == "a":
        need += layout.routed_bytes
    elif config.base in ("c", "e"):
        need += device_expert_bytes
    if config.base in ("d", "e"):
        # the scheduler's device copy of one layer's expert tensors (whole tensors, used slices filled)
        need += max(layout.layer_bytes(layer) for layer in layout.expert_bytes)
    return need


_BUFFER_LINE = re.compile(
    r"\b([A-Za-z_]+\d*(?:\[[^\]\s]*\])?(?:_[A-Za-z]+)?) (model|KV|compute|RS) buffer size =\s*([0-9.]+) MiB"
)


def buffer_sizes(log_text: str) -> dict[str, dict[str, int]]:
    """llama-server's own account of its buffers: {buffer name: {model|KV|compute|RS: bytes}}."""
    sizes: dict[str, dict[str, int]] = {}
    for name, kind, mib in _BUFFER_LINE.findall(log_text):
        by_kind = sizes.setdefault(name, {})
        size = int(float(mib) * (1 << 20))
        # a model may have several weight buffers of one type (one per file); a compute or KV buffer
        # is reported again when it is reallocated, and the last report is the one in use
        by_kind[kind] = by_kind.get(kind, 0) + size if kind == "model" else size
    return sizes


def is_device_buffer(name: str) -> bool:
    """CUDA0, Vulkan0, RPC0[host:port]: device memory. CPU, CPU_Mapped, CUDA_Host (pinned host memory): not."""
    return re.fullmatch(r"(CUDA|Vulkan|ROCm|SYCL|Metal)\d+|RPC\d+\[[^\]]*\]", name) is not None


def check_fits(
    configs: list[Config], layout: ExpertLayout, device_expert_c: int, backend: str, margin: int = DEVICE_MARGIN_BYTES
) -> tuple[list, dict]:
    """The configs that fit in the device's free memory together; (a) is dropped with a reason when
    it alone does not fit, any other shortfall is an error."""
    free = device_free_bytes(backend)
    skipped: dict[str, str] = {}
    if free is None:
        return configs, skipped
    needs = {c.key: device_need(c, layout, device_expert_c, margin) for c in configs}
    if sum(needs.values()) > free and "a" in needs:
        skipped["a"] = (
            f"does not fit: needs about {needs.pop('a') / 1e9:.1f} GB of device memory, "
            f"{free / 1e9:.1f} GB free beside the other servers"
        )
    total = sum(needs.values())
    if total > free:
        raise BenchError(
            f"the model does not fit: the servers need about {total / 1e9:.1f} GB of device memory, "
            f"{free / 1e9:.1f} GB is free (lower --cache-bytes or use fewer --configs)"
        )
    return [c for c in configs if c.key not in skipped], skipped
