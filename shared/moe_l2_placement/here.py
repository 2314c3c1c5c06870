"""This machine (its memory, nvidia-smi's GPUs) and the placement the cost model predicts for a model on it:
what `moe-l2 doctor --model M` prints.

The placement is the engine's own `--moe-cache-bytes auto` (engine_auto_split: what llama-server does by
default), on a device budget of the first GPU's memory less the model's other weights and DEVICE_RESERVE_BYTES
(the KV cache and compute buffers); its decode tok/s is the full model's (estimate.decode) with the policy's
replay at its slot count. The constants: the H200 of 2026-12-04 where the GPU is an H200 (measured, scaled to
the shape as the real-shapes table does), else the 24 GB desktop's assumed ones (PCIe 4.0, an 8-core DDR5
CPU) at the card's data-sheet bandwidth, and said so. Without a GPU nothing is predicted in tok/s: every
constant of the model is measured on a GPU machine (host->device rates, the GPU's step, the CPU's expert
rate net of them); what is said is where the experts would live (host memory, the drive).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from moe_l2_placement.choose import engine_auto_split
from moe_l2_placement.curve import esft_stats
from moe_l2_placement.estimate import (
    HOST_RESERVE_BYTES,
    Placement,
    decode,
    layer_misses_at,
    page_cache_misses,
    ram_share,
)
from moe_l2_placement.machine import (
    DEVICE_RESERVE_BYTES,
    NVME_GBPS,
    Machine,
    consumer_machine,
    h200_for,
    h200_machine,
    hbm_of,
)
from moe_l2_placement.shape import Shape


def human_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps a digit before the point (a demo model is a few MiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_bytes: int
    free_bytes: int = 0  # free now (what a launch can still take), as nvidia-smi reports it


def host_ram_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemTotal: the host memory the page cache can give the experts (0 where it cannot be read)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def nvidia_gpus(timeout_s: float = 10.0) -> tuple[list[Gpu], str]:
    """nvidia-smi's GPUs (name, total and free memory) and, where there are none, why."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "no nvidia-smi on PATH"
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,name,memory.total,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return [], f"nvidia-smi failed: {exc}"
    gpus = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit() and parts[2].isdigit() and parts[3].isdigit():
            total, free = (int(mib) * 2**20 for mib in parts[2:])  # nounits: MiB
            gpus.append(Gpu(int(parts[0]), parts[1], total, free))
    return gpus, "" if gpus else "nvidia-smi lists no GPU"


@dataclass
class Forecast:
    """The placement predicted for one model on one machine; `predicted` False says why in `why_not`."""

    model: str
    shape: dict[str, object]
    host_ram_bytes: int
    gpus: list[dict[str, object]]
    predicted: bool
    why_not: str = ""
    device: str = ""  # the GPU the placement is for
    budget_bytes: int = 0  # device memory the routed experts may take
    placement: str = ""  # the engine's auto split, in words
    n_dev: int = 0  # MoE layers wholly on the device
    n_cache: int = 0  # MoE layers behind the expert cache
    slots: int = 0  # slots a cached layer
    n_cpu: int = 0  # MoE layers computed on the CPU
    cache_bytes: int = 0  # the expert cache: n_cache * slots * expert_bytes
    hit_rate: float | None = None  # the policy's replay at `slots` (ESFT_CURVE)
    host_expert_bytes: int = 0  # routed expert bytes host memory holds
    ram_share: float = 1.0  # of those, the share host memory keeps (the rest read from the drive)
    drive_experts_per_token: float = 0.0  # experts read from the drive a decode token
    decode_tps: float | None = None
    decode_bound: str = ""
    constants: str = ""  # where the machine's constants come from
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def lines(self) -> list[str]:
        """The forecast in words, a line a fact."""
        s = self.shape
        h = human_bytes
        out = [
            f"model: {s['name']}: {s['n_moe']} MoE layers x {s['n_expert']} experts ({s['top_k']} used), "
            f"routed experts {h(int(s['routed_bytes']))}, other weights {h(int(s['other_bytes']))}",
            f"host memory {h(self.host_ram_bytes)}; "
            + (
                "GPUs: " + "; ".join(f"{g['index']}: {g['name']} {h(int(g['memory_bytes']))}" for g in self.gpus)
                if self.gpus
                else "no GPU"
            ),
        ]
        if self.device:
            out += [
                f"device: {self.device}, {h(self.budget_bytes)} for routed experts (its memory less the "
                f"other weights and {DEVICE_RESERVE_BYTES / 1e9:.0f} GB of KV cache and buffers)",
                f"placement (--moe-cache-bytes auto): {self.placement}",
            ]
            if self.n_cache:
                hit = (
                    f", hit rate {100 * self.hit_rate:.1f}% (the policy's replay)" if self.hit_rate is not None else ""
                )
                out.append(f"expert cache: {self.slots} slots x {self.n_cache} layers = {h(self.cache_bytes)}{hit}")
        out.append(
            f"host experts: {h(self.host_expert_bytes)}"
            + (
                " (host memory holds them all)"
                if self.ram_share >= 1.0
                else f"; host memory keeps {100 * self.ram_share:.0f}% of them, "
                f"{self.drive_experts_per_token:.1f} experts a token read from the drive (the RAM tier)"
            )
        )
        if self.predicted:
            out.append(f"predicted decode: {self.decode_tps:.1f} tok/s, bound by {self.decode_bound}")
            out.append(f"constants: {self.constants}")
        else:
            out.append(f"not predicted: {self.why_not}")
        return out + self.notes


def machine_for_gpu(gpu: Gpu, shape: Shape, ram_bytes: int) -> tuple[Machine, str]:
    """The constants for `gpu` and where they come from (see the module docstring)."""
    h200 = h200_machine()
    if "H200" in gpu.name:
        m = replace(h200_for(shape, h200), host_ram_bytes=ram_bytes)
        return m, "measured: the H200 of 2026-12-04 (bench/data/gpu-2026-12-04), scaled to this shape"
    hbm = hbm_of(gpu.name)
    m = replace(consumer_machine(shape, h200, hbm or 1008.0), host_ram_bytes=ram_bytes, nvme_gbps=NVME_GBPS)
    bw = f"its data-sheet {hbm:.0f} GB/s" if hbm else "an RTX 4090's 1008 GB/s (this card's bandwidth is not known)"
    return m, (
        f"assumed, not measured on a {gpu.name}: PCIe 4.0 x16 (25 GB/s pinned), an 8-core DDR5 CPU (40 GB/s of "
        f"experts), the H200's per-layer step overhead, {bw} (bench/gpu_facts.py constants measures them)"
    )


def forecast(model: str, shape: Shape, ram_bytes: int, gpus: list[Gpu], no_gpu_why: str = "") -> Forecast:
    """The placement of `shape` on a host of `ram_bytes` with `gpus` (the first one serves)."""
    fc = Forecast(
        model=model,
        shape=asdict(shape) | {"routed_bytes": shape.routed_bytes},
        host_ram_bytes=ram_bytes,
        gpus=[asdict(g) for g in gpus],
        predicted=False,
    )
    L, S = shape.n_moe, shape.expert_bytes
    if not gpus:
        # the CPU build: every routed expert is computed on the CPU from host memory
        fc.n_cpu, fc.host_expert_bytes = L, shape.routed_bytes
        fc.ram_share = ram_share(ram_bytes, shape.routed_bytes)
        fc.drive_experts_per_token = (
            L * layer_misses_at(shape, fc.ram_share * shape.n_expert) if fc.ram_share < 1 else 0.0
        )
        fc.why_not = (
            f"no GPU ({no_gpu_why or 'none listed'}): the cost model's constants (host->device copy rates, the "
            "GPU's decode step, the CPU's expert rate net of them) are measured on a GPU machine; the CPU build "
            f"computes all {L} MoE layers' experts on the CPU from host memory"
        )
        if fc.ram_share < 1:
            fc.why_not += (
                f", of which the host's memory less {HOST_RESERVE_BYTES / 1e9:.0f} GB keeps "
                f"{100 * fc.ram_share:.0f}%: the rest is read from the drive as used"
            )
        return fc
    gpu = gpus[0]
    if len(gpus) > 1:
        fc.notes.append(f"note: {len(gpus)} GPUs; the model places one device's experts (GPU {gpu.index})")
    machine, fc.constants = machine_for_gpu(gpu, shape, ram_bytes)
    fc.device = f"GPU {gpu.index} {gpu.name}"
    fc.budget_bytes = max(0, gpu.memory_bytes - shape.other_bytes - DEVICE_RESERVE_BYTES)
    auto = engine_auto_split(
        L, shape.n_expert, shape.top_k, S, fc.budget_bytes, machine.t_rt_s, machine.expert_copy_s(S, "pinned")
    )
    rest = L - auto.n_dev
    fc.placement, fc.n_dev = auto.why(L, shape.n_expert), auto.n_dev
    stats = None
    if auto.n_slot:
        stats = esft_stats(auto.n_slot, shape.top_k, shape.n_expert)
        fc.n_cache, fc.slots, fc.hit_rate = rest, auto.n_slot, stats.hit_rate
        fc.cache_bytes = rest * auto.n_slot * S
        pl = Placement("auto", n_dev=auto.n_dev, n_cache=rest, slots=auto.n_slot, cpu_misses=True)
    elif rest:
        fc.n_cpu = rest
        pl = Placement("auto", n_dev=auto.n_dev, n_cpu=rest)
    else:
        pl = Placement("auto", n_dev=L)
    fc.host_expert_bytes = rest * shape.layer_bytes
    fc.ram_share = ram_share(ram_bytes, fc.host_expert_bytes)
    if fc.ram_share < 1:
        # nothing can be pinned past the host's memory: the experts are copied from the mapping
        pl = replace(pl, host="mapped")
        fc.drive_experts_per_token = page_cache_misses(shape, machine, pl)
    est = decode(shape, machine, pl, stats)
    fc.predicted, fc.decode_tps, fc.decode_bound = True, est.tokens_per_s, est.bound
    return fc
