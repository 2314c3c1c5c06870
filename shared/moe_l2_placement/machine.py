"""A machine's measured constants (`Machine`): the host->device rates, the CPU's expert throughput, the GPU's
step; the free parameters of the model; the H200 of 2026-12-04 and the machines scaled from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moe_l2_placement.shape import KNOWN_SHAPES, NotModelled, Shape

T_RT_S = 35e-6  # fitted: one host round trip per host-crossing layer and token
MAPPED_FACTOR = 0.85  # fitted: copies from the mapped model / torch's pageable copies
CPU_TOKEN_COST = 0.5  # assumed: an extra token of a CPU expert, relative to reading it
HBM_EFFICIENCY = 0.8  # assumed: the share of the data-sheet bandwidth a decode step reads weights at


@dataclass(frozen=True)
class Machine:
    """Measured constants of one GPU and its host (GB/s are 1e9 bytes a second)."""

    name: str
    h2d_pinned_big_gbps: float  # 512 MiB from pinned memory
    h2d_pinned_expert_gbps: float  # one expert (ref_bytes) from pinned memory
    h2d_pageable_big_gbps: float  # 512 MiB from an anonymous pageable buffer (torch)
    cpu_expert_gbps: float  # B_cpu: expert bytes a second the CPU threads compute, at the run's threads
    gpu_token_s: float  # T_gpu: a decode step with every expert on the device
    gpu_prompt_fixed_s: float  # g0
    gpu_prompt_token_s: float  # g1
    h2d_mapped_gbps: float | None = None  # measured from the mapped model file, when the run did
    ref_bytes: int = 4_866_048  # the size h2d_pinned_expert_gbps was measured at
    hbm_gbps: float | None = None  # the GPU's data-sheet memory bandwidth
    t_rt_s: float = T_RT_S
    sources: dict[str, str] = field(default_factory=dict)  # constant -> where it comes from
    host_ram_bytes: float = 0.0  # the host's memory; 0: unbounded (every run of the bench fits it)
    nvme_gbps: float = 0.0  # what the drive under the model reads experts at, where RAM cannot hold them

    @property
    def copy_latency_s(self) -> float:
        """t_lat: one copy's fixed cost, from the one-expert and the 512 MiB pinned rates."""
        r = self.ref_bytes
        return max(0.0, r / (self.h2d_pinned_expert_gbps * 1e9) - r / (self.h2d_pinned_big_gbps * 1e9))

    @property
    def mapped_gbps(self) -> float:
        return self.h2d_mapped_gbps or self.h2d_pageable_big_gbps * MAPPED_FACTOR

    def expert_copy_s(self, nbytes: int, host: str) -> float:
        """t_x: one expert's copy, from pinned memory or from the mapping (the driver's staging)."""
        if host == "pinned":
            return self.copy_latency_s + nbytes / (self.h2d_pinned_big_gbps * 1e9)
        if host == "mapped":
            return nbytes / (self.mapped_gbps * 1e9)
        raise NotModelled(RING_REASON)

    def bulk_copy_s(self, nbytes: float, host: str) -> float:
        """Long runs of experts (the stock scheduler's copy of a layer's used experts)."""
        if host == "pinned":
            return nbytes / (self.h2d_pinned_big_gbps * 1e9)
        if host == "mapped":
            return nbytes / (self.mapped_gbps * 1e9)
        raise NotModelled(RING_REASON)

    def cpu_expert_s(self, nbytes: int, tokens: float = 1.0) -> float:
        """t_cpu: one expert on the CPU threads for `tokens` tokens."""
        return nbytes / (self.cpu_expert_gbps * 1e9) * (1 + CPU_TOKEN_COST * max(0.0, tokens - 1))

    def gpu_prompt_s(self, n: int) -> float:
        return self.gpu_prompt_fixed_s + self.gpu_prompt_token_s * n


RING_REASON = (
    "copies through the staging ring: its rate is the engine's own pipeline (copy threads, 4 MiB pinned "
    "chunks, an event each), which no constant measured before the servers start isolates"
)

# The H200 of 2026-12-04 (bench/data/gpu-2026-12-04): a's decode in r50/r25 (206.2 and 206.7 tok/s),
# a's prompt runs fitted as g0 + g1 n (8 runs of 81-118 tokens), h2d.txt. A run on an H200 without an a
# row (the dev run) takes T_gpu, g0, g1 from here, and says so.
H200_GPU = {"gpu_token_s": 1 / 206.44, "gpu_prompt_fixed_s": 0.02168, "gpu_prompt_token_s": 0.0001327}
HBM_GBPS = {"H200": 4800.0, "H100": 3350.0, "4090": 1008.0, "5090": 1792.0, "3090": 936.0}


def hbm_of(name: str) -> float | None:
    return next((v for k, v in HBM_GBPS.items() if k in name), None)


def h200_machine() -> Machine:
    """The H200 of 2026-12-04 (h2d.txt, r50/r25's a rows); B_cpu the median of its runs' b rows (p50, p25,
    p12, r50, r25: 60.8, 56.3, 49.9, 52.0, 52.6 tok/s)."""
    t_gpu = H200_GPU["gpu_token_s"]
    b_median = 52.6
    cpu = 26 * 6 * 4_866_048 / (1 / b_median - t_gpu - 26 * T_RT_S) / 1e9
    return Machine(
        "NVIDIA H200 (2026-12-04)",
        55.3,
        49.8,
        9.8,
        cpu,
        t_gpu,
        H200_GPU["gpu_prompt_fixed_s"],
        H200_GPU["gpu_prompt_token_s"],
        hbm_gbps=HBM_GBPS["H200"],
        sources={"all": "bench/data/gpu-2026-12-04: h2d.txt, a rows, the median b row"},
    )


CONSUMER_CPU_GBPS = 40.0  # assumed: 8 cores on dual-channel DDR5 (~60 GB/s): Q4 matvecs at ~2/3 of it
CONSUMER_HBM_GBPS = 1008.0  # a 24 GB card of the RTX 4090 class


def consumer_machine(shape: Shape, h200: Machine, hbm_gbps: float = CONSUMER_HBM_GBPS) -> Machine:
    """A 24 GB card on PCIe 4.0 x16 (25 GB/s pinned, 12 pageable) and an 8-core desktop CPU with dual-channel
    DDR5 (~60 GB/s; CONSUMER_CPU_GBPS assumed). T_gpu: the H200's per-layer overhead (its step less its weight
    reads, per layer) times the shape's layers, plus the shape's weight reads at the card's bandwidth;
    the prompt's per-token compute 3x the H200's (int8 tensor throughput ~660 against ~1980 TOPS). `hbm_gbps`:
    another card's data-sheet bandwidth on the same host (`moe-l2 doctor` on a GPU no run measured)."""
    ds = KNOWN_SHAPES["ds-v2-lite"]
    h200_read = ds.decode_read_bytes / (h200.hbm_gbps * HBM_EFFICIENCY * 1e9)  # type: ignore[operator]
    per_layer = (h200.gpu_token_s - h200_read) / ds.n_layer
    t_gpu = per_layer * shape.n_layer + shape.decode_read_bytes / (hbm_gbps * HBM_EFFICIENCY * 1e9)
    scale_tok = 3.0 * shape.decode_read_bytes / ds.decode_read_bytes
    return Machine(
        "24 GB card, PCIe 4.0 x16, 8-core DDR5 desktop",
        25.0,
        1 / (h200.copy_latency_s / h200.ref_bytes + 1 / 25e9) / 1e9,  # the same DMA setup cost per copy
        12.0,
        CONSUMER_CPU_GBPS,
        t_gpu,
        h200.gpu_prompt_fixed_s * shape.n_layer / ds.n_layer,
        h200.gpu_prompt_token_s * scale_tok,
        hbm_gbps=hbm_gbps,
        sources={
            "h2d": "given: PCIe 4.0 x16, 25 GB/s pinned, 12 pageable; one copy's fixed cost the H200's",
            "cpu": f"assumed {CONSUMER_CPU_GBPS} GB/s CPU expert throughput (8 cores, dual-channel DDR5 ~60 GB/s)",
            "gpu": "scaled from the H200 (see consumer_machine)",
        },
    )


H200_DEVICE_BYTES = 139 * 2**30  # the lent H200's memory (the device tool: about 139 GiB)
H200_HOST_RAM_BYTES = 128 * 2**30  # its host (the device tool: 128 GiB)
CONSUMER_HOST_RAM_BYTES = 96e9  # assumed: 2 x 48 GB DDR5, the dual-channel desktop CONSUMER_CPU_GBPS assumes
NVME_GBPS = 5.0  # assumed: a PCIe 4.0 NVMe drive (7 GB/s on its data sheet) reading 10-100 MB experts
DEVICE_RESERVE_BYTES = 2 * 10**9  # the KV cache and compute buffers, as the 24 GB rows above


def h200_for(shape: Shape, h200: Machine) -> Machine:
    """The H200 with another shape: its per-layer overhead (measured on ds-v2-lite: the step less its weight
    reads) times the shape's layers, plus the shape's weight reads at its bandwidth; the prompt's per-token
    compute scaled by the weights a token reads. The host's 128 GiB and an NVMe drive under the model."""
    ds = KNOWN_SHAPES["ds-v2-lite"]
    bw = h200.hbm_gbps * HBM_EFFICIENCY * 1e9  # type: ignore[operator]
    per_layer = (h200.gpu_token_s - ds.decode_read_bytes / bw) / ds.n_layer
    return replace(
        h200,
        gpu_token_s=per_layer * shape.n_layer + shape.decode_read_bytes / bw,
        gpu_prompt_fixed_s=h200.gpu_prompt_fixed_s * shape.n_layer / ds.n_layer,
        gpu_prompt_token_s=h200.gpu_prompt_token_s * shape.decode_read_bytes / ds.decode_read_bytes,
        host_ram_bytes=H200_HOST_RAM_BYTES,
        nvme_gbps=NVME_GBPS,
    )
