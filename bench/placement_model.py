"""A cost model of decode and prompt tokens/s for every place a MoE model's experts can live (issue 32),
calibrated on measured constants, checked against the runs of bench/expert_offload.py.

    python bench/placement_model.py                       # the new design's predictions (H200, consumer)
    python bench/placement_model.py --against DIR [DIR]   # predicted vs measured, every cell; exit 1 if > 15%
    python bench/placement_model.py --json OUT            # the predictions (and any --against cells) as JSON
    python bench/placement_model.py --replay-curve        # regenerate ESFT_CURVE from the policy's replay

The formula (seconds; one decode step, then one prompt micro-batch of n tokens)
-------------------------------------------------------------------------------
A shape has L MoE layers of E experts, k used a token, S bytes an expert. A placement puts each MoE
layer's experts in one of four places: on the device (n_dev layers), computed on the CPU (n_cpu: b, c's
host layers), copied every step (n_copy: d), or behind the expert cache with s slots (n_cache: e).

    decode = T_gpu                                   all on the device: a's step (launches, weights)
           + (n_cpu + n_copy + n_cache) * t_rt       one host round trip a host-crossing layer a token
           + n_cpu * k * S / B_cpu                   CPU experts
           + n_copy * k * t_x                        d: every used expert copied
           + n_cache * (p * t_x + crit)              e: the prefetch's copies and the misses
    crit   = m * t_x                                 e: the layer's m misses copied, then computed
           = min over c of max((m - c) * t_x,        e+cpu (new): m - c copied while the CPU computes c
                               c * t_cpu + [c > 0] * t_lat)      (choose_split)
    decode = max(decode, n_cache * (m + p) * t_x)    e+cpu: every miss is still admitted by a copy, off
                                                     the critical path, but the link carries it

    prompt = G(n) = g0 + g1 * n                      a's prompt: GPU compute of one micro-batch
           + copied bytes / h2d_big                  stock (n >= the offload minimum, 32): the scheduler
                                                     copies each host layer's used experts, in long runs
           + copied bytes / h2d_expert               e after patch 0013: the cache copies its misses, one
                                                     expert each (the others come from slots on the device)

where m and p are a cached layer's misses and prefetches a token (the policy's replay: m = k (1 - hit
rate), the distribution of m from the replay when ESFT_CURVE holds the shape, else binomial), and

    t_x   = S / h2d_expert  pinned: one expert's copy (the one-expert rate: t_lat + S / h2d_big)
          = S / h2d_mapped  mapped (pageable): the driver stages every copy (see MAPPED_FACTOR)
    t_cpu = S / B_cpu * (1 + CPU_TOKEN_COST * (tokens - 1))    one missing expert on the CPU threads
    t_lat = S / h2d_expert - S / h2d_big             the fixed cost of one copy (DMA setup): 9.7 us on the H200

The bounding term of a cell is the largest of its terms (printed with its share of the time).

The constants and where each is measured
----------------------------------------
- h2d_big, h2d_expert (pinned), h2d_pageable: host->device GB/s for 512 MiB and for one expert, by torch at
  the bench's start (bench/gpu_facts.py constants, the JSON's `constants.h2d`); a folder without them
  (bench/data/gpu-2026-12-04) has them in h2d.txt, which is read instead.
- h2d_mapped: host->device GB/s from the mapped model file itself (bench/expert_offload.py measures it at
  its start since this model: `constants.h2d_mapped`); where absent, h2d_pageable * MAPPED_FACTOR.
- T_gpu, g0, g1: row a (all on the device) of the run, else of a sibling file of the folder (same machine),
  else the H200 of 2026-12-04 (H200_GPU: r50/r25's a rows) when the run's GPU is an H200; each cell says so.
- B_cpu: CPU expert GB/s at the run's thread count, from row b's decode (every run has b):
  B_cpu = L k S / (1 / b_decode - T_gpu - L t_rt). Row b's decode is therefore the calibration cell of B_cpu
  (its error is 0 by construction), and every other CPU cell (c, new design) is a prediction from it.
- hit rate, misses and prefetches: the e row's `replay_check.replay` (the Python replay of the engine's own
  access log, which equals the engine's counters); for slot counts no run measured, ESFT_CURVE (the
  policy's replay of the bench's own requests on the ESFT trace, `--replay-curve`), which reproduces the
  measured 56.6 / 64.5 / 81.4% at 7 / 14 / 32 slots within 0.5 points.
- copied prompt bytes: the run's own (routing-derived for stock rows, the cache's counters for e); for a
  prediction, used share * E * S per host layer (ESFT prompts of the bench: PROMPT_USED_SHARE), times the
  share the cache does not hold (ESFT_CURVE's prompt share).

Free parameters: two fitted, two assumed, each a physical quantity
--------------------------------------------------------------------
- T_RT_S = 35 us: one host round trip per host-crossing layer and token (the router's ids read back to the
  host, the stream synchronised, the next kernels launched). Fitted on the pinned d rows of 2026-12-04,
  whose every other term is measured (36 and 40 us), and e at 50% (28 us).
- MAPPED_FACTOR = 0.85: a copy from the mapped model (4 KiB page-cache pages, staged by the driver) runs
  at 0.85 x torch's pageable rate (an anonymous buffer). Fitted on 2026-12-04's mapped rows (d, e, b/c
  prompts: 0.83-0.88); the dev run's ed cells (0.80-0.95) check it.
- CPU_TOKEN_COST = 0.5 (assumed; no run measures it): each extra token of a CPU expert costs half its
  read (17 MFLOP a token-expert at ~0.5 TFLOP/s against 4.87 MB at ~60 GB/s). Only batched CPU misses use it.
- HBM_EFFICIENCY = 0.8 (assumed): the GPU reads weights at 80% of its data-sheet bandwidth; it only splits
  T_gpu into weights read and per-token overhead, and scales T_gpu to a GPU without a measurement.

Known bias: the cache's decode with pinned copies is predicted 4-11% slow at 7-16 slots (p12, p25, the
dev run's e25), where the prefetch copies a token's 30-67 experts: the model puts every prefetch copy on the
critical path (at 7 slots on the H200 the measurement is 9% above that, while hiding them behind compute
would predict 21% above it), and the prefetch's second stream hides some of them. Not fitted away: a
parameter for it would fit the table.

Out of scope, printed with the reason: rows with -np N (batched decode of several requests), rows through
the staging ring (its rate is the engine's own pipeline of copy threads and pinned chunks; no constant
measured before the servers start isolates it; the cell prints the rate it implies).

For the engine's `auto` mode: choose_split (per layer and micro-batch) and choose_layers_and_cache (per
budget) below; their docstrings give the arithmetic to copy.

Standard library and numpy at import time; moe_l2_gguf and moe_l2_cache only inside the functions that
need them (a shape by name, --replay-curve), so a bare interpreter with numpy runs --against.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

TOLERANCE = 0.15  # the bound on a cell's error
T_RT_S = 35e-6  # fitted: one host round trip per host-crossing layer and token
MAPPED_FACTOR = 0.85  # fitted: copies from the mapped model / torch's pageable copies
CPU_TOKEN_COST = 0.5  # assumed: an extra token of a CPU expert, relative to reading it
HBM_EFFICIENCY = 0.8  # assumed: the share of the data-sheet bandwidth a decode step reads weights at
OFFLOAD_MIN_BATCH = 32  # ggml's GGML_OP_OFFLOAD_MIN_BATCH: a prompt of fewer rows computes host experts on the CPU
PROMPT_TOKENS = (117, 81, 118)  # the bench's three prompts of 40 words (every run of 2026-12-04)
# ESFT prompts of the bench: the experts a 117-token prompt uses, a share of a layer's 64 (p50's b: 7.16 GB
# copied = 26 layers x 56.6 experts x 4.87 MB)
PROMPT_USED_SHARE = 0.884

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own modules
from data_paths import esft_npz  # noqa: E402


class NotModelled(Exception):
    """A cell the model cannot predict; the message says why, in one line."""


# -- shapes ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What the model needs of a MoE model: its MoE layers, experts and bytes."""

    name: str
    n_layer: int  # all layers (dense ones too): the per-layer launch overhead scales with them
    n_moe: int  # L
    n_expert: int  # E
    top_k: int  # k
    expert_bytes: int  # S: gate + up + down of one expert
    other_bytes: int  # every tensor that is not a routed expert (on the device in every placement)
    embd_bytes: int = 0  # the token embedding (a decode step reads one row of it)

    @property
    def layer_bytes(self) -> int:
        return self.n_expert * self.expert_bytes

    @property
    def routed_bytes(self) -> int:
        return self.n_moe * self.layer_bytes

    @property
    def decode_read_bytes(self) -> int:
        """Weights a decode step reads on the device with every expert there: all but the embedding, and
        k experts a MoE layer."""
        return self.other_bytes - self.embd_bytes + self.n_moe * self.top_k * self.expert_bytes

    @classmethod
    def named(cls, name: str) -> Shape:
        """A shape of moe_l2_gguf.model_shapes (grep model_shapes), or the copy below on a bare interpreter."""
        try:
            from moe_l2_gguf.model_shapes import get_shape, sizes
        except ImportError:
            return KNOWN_SHAPES[name]
        s = get_shape(name)
        size = sizes(s)
        embd = s.n_vocab * s.n_embd * 34 // 32  # token_embd is Q8_0 (34 bytes a block of 32)
        n_moe = len(s.moe_layers)
        return cls(name, s.n_layer, n_moe, s.n_expert, s.n_expert_used, size.expert_bytes, size.other_bytes, embd)

    @classmethod
    def from_run(cls, run: Mapping) -> Shape:
        """The shape a bench/expert_offload.py JSON describes (its `model`)."""
        m = run["model"]
        per_layer = {int(k): int(v) for k, v in m["expert_bytes_per_layer"].items()}
        name = str(m.get("shape") or Path(str(m.get("path", "model"))).stem)
        known = KNOWN_SHAPES.get(name) or next(
            (s for s in KNOWN_SHAPES.values() if s.expert_bytes == max(per_layer.values())), None
        )
        embd = known.embd_bytes if known else 0
        return cls(
            name if known is None else known.name,
            int(m["n_layer"]),
            len(per_layer),
            int(m["n_expert"]),
            int(m["n_expert_used"]),
            max(per_layer.values()),
            int(m["other_bytes"]),
            embd,
        )


# moe_l2_gguf.model_shapes's figures (tests/test_placement_model.py checks that they still agree)
KNOWN_SHAPES = {
    "ds-v2-lite": Shape("ds-v2-lite", 27, 26, 64, 6, 4_866_048, 1_403_992_064, 222_822_400),
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", 48, 48, 128, 8, 2_654_208, 1_674_993_664, 330_612_736),
    # `make bench-gpu`'s second architecture (MXFP4 experts, biases)
    "gpt-oss-20b": Shape("gpt-oss-20b", 24, 24, 32, 4, 13_219_200, 1_944_212_736, 615_329_280),
}


# -- the machine ----------------------------------------------------------------------------------------


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


# -- hit rates: the project's policy replayed ------------------------------------------------------------


@dataclass(frozen=True)
class CacheStats:
    """A cached layer a decode token: its hit rate, misses and prefetches, and how its misses spread."""

    hit_rate: float
    misses: float  # m: misses a cached layer a token (demand copies)
    prefetch: float  # p: prefetched experts a cached layer a token
    miss_hist: tuple[float, ...]  # P(m = 0..k) a layer a token
    prompt_copy_share: float = 1.0  # of a prompt's used experts, the share not in a slot (copied)
    source: str = ""

    @classmethod
    def binomial(cls, k: int, hit_rate: float, prefetch: float, **kw: object) -> CacheStats:
        q = 1 - hit_rate
        hist = tuple(math.comb(k, i) * q**i * (1 - q) ** (k - i) for i in range(k + 1))
        return cls(hit_rate, k * q, prefetch, hist, **kw)  # type: ignore[arg-type]


# Generated by `python bench/placement_model.py --replay-curve`: the project's default policy
# (hybrid_threshold_prefetch, per-domain priors and transitions fitted on ESFT sequences 7..212) replaying
# the bench's own requests on the ESFT trace (a warm-up, then per run a prompt of 117/81/118 tokens and a
# decode of 65 tokens, sequences 0..6, as bench/expert_offload.py's 3 runs send them). The prompt copy share
# counts the prompts of runs 2 and 3 (a cache warmed by a decode; the first prompt follows only the warm-up).
# slots: (hit rate, misses a token, prefetches a token, P(m = 0..6) a layer a token, prompt copy share)
# fmt: off
ESFT_CURVE: dict[int, tuple[float, float, float, tuple[float, ...], float]] = {
    6: (0.5388, 71.95, 75.16, (0.0381, 0.1685, 0.2507, 0.2406, 0.1743, 0.0881, 0.0396), 0.8973),
    7: (0.5658, 67.73, 67.23, (0.0655, 0.1998, 0.2263, 0.2304, 0.1577, 0.0906, 0.0296), 0.8802),
    8: (0.5825, 65.14, 59.53, (0.0895, 0.1968, 0.2234, 0.2308, 0.1531, 0.0819, 0.0245), 0.8631),
    9: (0.5936, 63.39, 52.35, (0.0972, 0.2043, 0.2225, 0.229, 0.1535, 0.0733, 0.0203), 0.846),
    10: (0.6041, 61.75, 46.74, (0.103, 0.2099, 0.2281, 0.2298, 0.144, 0.0676, 0.0176), 0.8289),
    11: (0.6149, 60.07, 41.41, (0.1111, 0.2159, 0.2325, 0.2269, 0.1351, 0.0624, 0.016), 0.8118),
    12: (0.6257, 58.39, 37.06, (0.1193, 0.2234, 0.2356, 0.2223, 0.1274, 0.0576, 0.0145), 0.795),
    13: (0.6351, 56.92, 33.15, (0.1281, 0.2263, 0.2397, 0.2194, 0.1208, 0.052, 0.0137), 0.7782),
    14: (0.6449, 55.4, 29.86, (0.1349, 0.2329, 0.2455, 0.2136, 0.1127, 0.0475, 0.0129), 0.7611),
    15: (0.6541, 53.96, 26.86, (0.1419, 0.2424, 0.2431, 0.2107, 0.1063, 0.0443, 0.0114), 0.744),
    16: (0.6635, 52.49, 24.34, (0.1492, 0.2509, 0.2439, 0.2047, 0.1009, 0.04, 0.0104), 0.7269),
    17: (0.6726, 51.07, 22.02, (0.1569, 0.2572, 0.247, 0.1983, 0.0934, 0.0383, 0.0089), 0.7098),
    18: (0.6819, 49.63, 19.9, (0.1664, 0.2613, 0.253, 0.1869, 0.0891, 0.0354, 0.0079), 0.6927),
    19: (0.6916, 48.12, 18.12, (0.1751, 0.2681, 0.2545, 0.1811, 0.0829, 0.0311, 0.0072), 0.6756),
    20: (0.7013, 46.6, 16.53, (0.1867, 0.2735, 0.254, 0.173, 0.0787, 0.028, 0.0062), 0.6584),
    21: (0.7111, 45.07, 15.11, (0.1964, 0.2833, 0.2514, 0.1656, 0.0713, 0.0263, 0.0056), 0.6413),
    22: (0.7217, 43.42, 13.69, (0.2109, 0.2878, 0.2495, 0.1581, 0.0651, 0.0232, 0.0054), 0.6245),
    23: (0.7307, 42.02, 12.64, (0.2223, 0.2938, 0.247, 0.1513, 0.0588, 0.022, 0.0048), 0.6074),
    24: (0.74, 40.56, 11.65, (0.2337, 0.3015, 0.2431, 0.1424, 0.0557, 0.0193, 0.0043), 0.5913),
    25: (0.7493, 39.11, 10.79, (0.2453, 0.311, 0.2375, 0.1326, 0.052, 0.0174, 0.0043), 0.5745),
    26: (0.7585, 37.67, 9.97, (0.258, 0.3172, 0.2327, 0.1249, 0.0481, 0.0155, 0.0037), 0.5577),
    27: (0.7687, 36.08, 9.22, (0.2756, 0.3208, 0.2259, 0.1164, 0.0439, 0.0141, 0.0033), 0.5413),
    28: (0.7781, 34.62, 8.55, (0.2901, 0.3278, 0.217, 0.1088, 0.0406, 0.0129, 0.0027), 0.5242),
    29: (0.7866, 33.29, 8.0, (0.3071, 0.3261, 0.2136, 0.1026, 0.0365, 0.0116, 0.0025), 0.5077),
    30: (0.7953, 31.93, 7.45, (0.3233, 0.3284, 0.2055, 0.0972, 0.0325, 0.0114, 0.0017), 0.4906),
    31: (0.8048, 30.45, 6.9, (0.3446, 0.3286, 0.1923, 0.093, 0.0302, 0.0099, 0.0015), 0.4742),
    32: (0.8132, 29.14, 6.38, (0.3616, 0.3241, 0.195, 0.0818, 0.0276, 0.0083, 0.0015), 0.4571),
    33: (0.8218, 27.8, 5.96, (0.3806, 0.3232, 0.1871, 0.0748, 0.0253, 0.0081, 0.001), 0.4403),
    34: (0.8311, 26.35, 5.66, (0.4034, 0.3189, 0.1792, 0.0673, 0.0232, 0.0072, 0.001), 0.4235),
    35: (0.8395, 25.04, 5.36, (0.4237, 0.3156, 0.1705, 0.0622, 0.0213, 0.0058, 0.001), 0.4077),
    36: (0.8471, 23.85, 5.11, (0.4424, 0.3123, 0.1625, 0.0584, 0.0178, 0.0056, 0.001), 0.3906),
    37: (0.8544, 22.71, 4.76, (0.4584, 0.3129, 0.1538, 0.0528, 0.0164, 0.0046, 0.001), 0.3741),
    38: (0.8621, 21.51, 4.53, (0.478, 0.3114, 0.143, 0.0472, 0.0151, 0.0044, 0.001), 0.3587),
    39: (0.8688, 20.47, 4.31, (0.4942, 0.3119, 0.1303, 0.0452, 0.0135, 0.0039, 0.001), 0.3425),
    40: (0.8756, 19.41, 4.08, (0.5128, 0.3092, 0.1189, 0.0421, 0.0129, 0.0031, 0.001), 0.3261),
    41: (0.8819, 18.42, 3.92, (0.533, 0.3005, 0.1109, 0.0406, 0.0112, 0.0027, 0.001), 0.3096),
    42: (0.8881, 17.45, 3.75, (0.5508, 0.2953, 0.1034, 0.0373, 0.0095, 0.0027, 0.001), 0.2935),
    43: (0.8942, 16.5, 3.61, (0.5727, 0.2839, 0.0959, 0.0356, 0.0087, 0.0023, 0.001), 0.2781),
    44: (0.8999, 15.62, 3.5, (0.5924, 0.2731, 0.0905, 0.0338, 0.007, 0.0023, 0.001), 0.2626),
    45: (0.9045, 14.89, 3.38, (0.609, 0.2642, 0.0856, 0.0311, 0.0072, 0.0019, 0.001), 0.2468),
    46: (0.91, 14.04, 3.27, (0.6278, 0.2555, 0.0789, 0.0286, 0.0066, 0.0017, 0.001), 0.232),
    47: (0.9154, 13.2, 3.16, (0.6477, 0.2441, 0.0731, 0.0267, 0.006, 0.0017, 0.0008), 0.2178),
    48: (0.92, 12.47, 3.05, (0.6631, 0.2371, 0.068, 0.0236, 0.0056, 0.0017, 0.0008), 0.2024),
    49: (0.9246, 11.76, 2.96, (0.6821, 0.225, 0.063, 0.0218, 0.0056, 0.0017, 0.0008), 0.1862),
    50: (0.9295, 11.01, 2.89, (0.7012, 0.2126, 0.0589, 0.0193, 0.0056, 0.0015, 0.0008), 0.1708),
    51: (0.9341, 10.29, 2.81, (0.719, 0.2022, 0.0537, 0.0176, 0.0052, 0.0015, 0.0008), 0.155),
    52: (0.9385, 9.6, 2.74, (0.7389, 0.1871, 0.0503, 0.0166, 0.0048, 0.0015, 0.0008), 0.1412),
    53: (0.9418, 9.08, 2.71, (0.7542, 0.1755, 0.047, 0.0168, 0.0043, 0.0015, 0.0008), 0.126),
    54: (0.9455, 8.5, 2.69, (0.7714, 0.1627, 0.0431, 0.0164, 0.0041, 0.0015, 0.0008), 0.1122),
    55: (0.9497, 7.84, 2.66, (0.7901, 0.149, 0.0396, 0.0149, 0.0041, 0.0015, 0.0008), 0.0981),
    56: (0.9549, 7.04, 2.62, (0.8137, 0.1312, 0.0352, 0.0135, 0.0041, 0.0015, 0.0008), 0.0859),
    57: (0.958, 6.55, 2.61, (0.8278, 0.121, 0.0321, 0.0128, 0.0041, 0.0015, 0.0008), 0.0763),
    58: (0.9628, 5.81, 2.53, (0.8496, 0.104, 0.029, 0.011, 0.0043, 0.0014, 0.0008), 0.0638),
    59: (0.9691, 4.81, 2.33, (0.879, 0.0823, 0.0224, 0.0099, 0.0043, 0.0014, 0.0008), 0.0497),
    60: (0.9737, 4.1, 2.28, (0.9001, 0.0659, 0.0187, 0.0095, 0.0039, 0.0012, 0.0008), 0.0378),
    61: (0.9762, 3.71, 2.26, (0.9134, 0.0541, 0.0172, 0.0095, 0.0039, 0.0012, 0.0008), 0.0286),
    62: (0.9803, 3.08, 2.15, (0.9296, 0.0433, 0.0137, 0.0083, 0.0033, 0.001, 0.0008), 0.0201),
    63: (0.9813, 2.91, 2.15, (0.9353, 0.0383, 0.0131, 0.0083, 0.0033, 0.001, 0.0008), 0.0138),
    64: (0.9826, 2.71, 2.15, (0.9432, 0.0303, 0.0131, 0.0083, 0.0033, 0.001, 0.0008), 0.0109),
}
# fmt: on


def esft_stats(slots: int, k: int = 6, n_expert: int = 64) -> CacheStats:
    """The replay's figures at `slots` of `n_expert` (ESFT_CURVE). Another shape (qwen3-30b-a3b has no
    trace here) takes the ESFT figures at the same share of a layer's experts, and a binomial spread."""
    if not ESFT_CURVE:
        raise NotModelled("ESFT_CURVE is empty: run --replay-curve")
    share = min(1.0, slots / n_expert)
    s = min(64, max(min(ESFT_CURVE), round(share * 64)))
    hit, misses, prefetch, hist, prompt_share = ESFT_CURVE[s]
    if (k, n_expert) == (6, 64):
        return CacheStats(hit, misses / 26, prefetch / 26, hist, prompt_share, f"ESFT replay, {s} slots")
    src = f"ESFT replay at {s}/64 slots (same share), binomial spread: no {k}-of-{n_expert} trace here"
    return CacheStats.binomial(k, hit, prefetch / 26 * k / 6, prompt_copy_share=prompt_share, source=src)


def stats_from_row(row: Mapping, shape: Shape) -> CacheStats:
    """An e row's hit rate, misses and prefetches a cached layer a token: the Python replay of the engine's
    access log (replay_check.replay), else the engine's decode counters; the spread from ESFT_CURVE."""
    cache = row.get("expert_cache") or {}
    replay = (cache.get("replay_check") or {}).get("replay")
    slots = (cache.get("replay_check") or {}).get("slots") or slots_of(row, shape)
    if replay and replay.get("accesses"):
        acc = replay["accesses"]
        hit, loads, prefetch, src = (
            replay["hits"] / acc,
            replay["loads"] / acc,
            replay.get("prefetch", 0) / acc,
            "replay",
        )
    elif cache.get("decode_totals", {}).get("accesses"):
        t = cache["decode_totals"]
        hit, loads, src = t["hits"] / t["accesses"], t["loads"] / t["accesses"], "engine counters (no replay)"
        prefetch = max(0.0, t["h2d_bytes"] / shape.expert_bytes - t["loads"]) / t["accesses"]
    else:
        raise NotModelled("the e row has neither a replay nor decode counters: no hit rate")
    k = shape.top_k
    try:
        spread = esft_stats(slots, k, shape.n_expert).miss_hist
    except NotModelled:
        spread = CacheStats.binomial(k, hit, 0).miss_hist
    return CacheStats(hit, k * loads, k * prefetch, spread, source=f"{src}, {slots} slots")


def slots_of(row: Mapping, shape: Shape) -> int:
    return min(shape.n_expert, int(row.get("device_expert_bytes", 0)) // (shape.n_moe * shape.expert_bytes))


# -- the placements ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where each MoE layer's experts are: n_dev + n_cpu + n_copy + n_cache = L."""

    label: str
    n_dev: int = 0  # wholly on the device
    n_cpu: int = 0  # computed on the CPU in decode (the stock host layers)
    n_copy: int = 0  # used experts copied every step (d)
    n_cache: int = 0  # behind the expert cache
    slots: int = 0
    cpu_misses: bool = False  # the new design: misses split between copies and the CPU
    host: str = "pinned"  # pinned | mapped | ring: where the host experts are copied from
    prompt_through_cache: bool = True  # patch 0013: a prompt's misses copied by the cache, one expert each
    prompt_ahead: bool = False  # patch 0017: a prompt's copies one expert tensor ahead, overlapping compute


@dataclass
class Estimate:
    """One cell's time and its terms (seconds); tok/s and the bounding term follow."""

    tokens: float
    terms: dict[str, float]
    total_s: float = 0.0
    bound_override: str | None = None

    def __post_init__(self) -> None:
        if not self.total_s:
            self.total_s = sum(self.terms.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s

    @property
    def bound(self) -> str:
        if self.bound_override:
            return self.bound_override
        name, t = max(self.terms.items(), key=lambda kv: kv[1])
        return f"{name} {100 * t / self.total_s:.0f}%"


def split_gpu_time(shape: Shape, machine: Machine) -> dict[str, float]:
    """T_gpu as 'GPU weights read' (decode_read_bytes at HBM_EFFICIENCY of the data sheet) and 'per-token
    overhead' (launches, synchronisation: the rest); one term when the GPU's bandwidth is unknown."""
    if not machine.hbm_gbps:
        return {"GPU step (all on device)": machine.gpu_token_s}
    read = min(machine.gpu_token_s, shape.decode_read_bytes / (machine.hbm_gbps * HBM_EFFICIENCY * 1e9))
    return {"GPU weights read": read, "per-token overhead": machine.gpu_token_s - read}


def expected_crit(stats: CacheStats, shape: Shape, machine: Machine, cpu_misses: bool, host: str) -> float:
    """E[crit] a cached layer a token over the replay's spread of m (see the module docstring)."""
    t_x = machine.expert_copy_s(shape.expert_bytes, host)
    if not cpu_misses:
        return stats.misses * t_x
    t_cpu = machine.cpu_expert_s(shape.expert_bytes)
    total = 0.0
    for m, p in enumerate(stats.miss_hist):
        c = choose_split(m, 1, shape.expert_bytes, 0, 0, t_copy_s=t_x, t_cpu_s=t_cpu, t_return_s=machine.copy_latency_s)
        total += p * split_time(m, c, t_x, t_cpu, machine.copy_latency_s)
    # the spread's mean may differ from the replay's m by rounding: scale to the replay's misses
    mean = sum(m * p for m, p in enumerate(stats.miss_hist))
    return total * (stats.misses / mean) if mean > 0 else 0.0


def decode(shape: Shape, machine: Machine, pl: Placement, stats: CacheStats | None = None) -> Estimate:
    """One decode step of `pl` (the module docstring's formula)."""
    terms = split_gpu_time(shape, machine)
    crossing = pl.n_cpu + pl.n_copy + pl.n_cache
    terms["host round trips"] = crossing * machine.t_rt_s
    terms["CPU experts"] = pl.n_cpu * shape.top_k * machine.cpu_expert_s(shape.expert_bytes)
    copies = pl.n_copy * shape.top_k * machine.expert_copy_s(shape.expert_bytes, pl.host) if pl.n_copy else 0.0
    link = copies
    if pl.n_cache:
        if stats is None:
            raise NotModelled("a cached placement needs the policy's hit rate")
        t_x = machine.expert_copy_s(shape.expert_bytes, pl.host)
        crit = expected_crit(stats, shape, machine, pl.cpu_misses, pl.host)
        copies += pl.n_cache * stats.prefetch * t_x
        if pl.cpu_misses:
            terms["misses: PCIe || CPU"] = pl.n_cache * crit
        else:
            copies += pl.n_cache * crit
        link += pl.n_cache * (stats.misses + stats.prefetch) * t_x
    terms["PCIe copies"] = terms.get("PCIe copies", 0.0) + copies
    terms["NVMe reads"] = page_cache_misses(shape, machine, pl) * shape.expert_bytes / nvme_bps(machine)
    est = Estimate(1, {k: v for k, v in terms.items() if v > 0})
    if pl.cpu_misses and link > est.total_s:
        est.total_s = link
        est.bound_override = "PCIe link (demand copies, admissions, prefetch) 100%"
    return est


def prompt(
    shape: Shape,
    machine: Machine,
    pl: Placement,
    n: int,
    copied_bytes: float | None = None,
    stats: CacheStats | None = None,
) -> Estimate:
    """One prompt micro-batch of n tokens; `copied_bytes` are the run's own (else predicted)."""
    terms = {"GPU prompt compute": machine.gpu_prompt_s(n)}
    host_layers = pl.n_cpu + pl.n_copy + pl.n_cache
    if not host_layers:
        return Estimate(n, terms)
    terms["host round trips"] = host_layers * machine.t_rt_s
    used = min(distinct_used(shape, n), PROMPT_USED_SHARE * shape.n_expert)
    if n < OFFLOAD_MIN_BATCH and not pl.n_cache and not pl.n_copy:
        # a short prompt's host experts are computed on the CPU: each used expert read once, for its tokens
        tokens = n * shape.top_k / used
        terms["CPU experts"] = pl.n_cpu * used * machine.cpu_expert_s(shape.expert_bytes, tokens)
        return Estimate(n, terms)
    if copied_bytes is None:
        share = stats.prompt_copy_share if (pl.n_cache and stats and pl.prompt_through_cache) else 1.0
        copied_bytes = host_layers * used * share * shape.expert_bytes
    if pl.n_cache and pl.prompt_through_cache:
        n_copies = copied_bytes / shape.expert_bytes
        copy_s = n_copies * machine.expert_copy_s(shape.expert_bytes, pl.host)
        if pl.prompt_ahead:
            return prompt_ahead(n, terms, copy_s, used / shape.n_expert, pl.n_cache)
        terms["PCIe copies"] = copy_s
    else:
        terms["PCIe copies"] = machine.bulk_copy_s(copied_bytes, pl.host)
    terms["NVMe reads"] = copied_bytes * page_cache_miss_share(shape, machine, pl) / nvme_bps(machine)
    return Estimate(n, {k: v for k, v in terms.items() if v > 0})


# -- the host's memory: the page cache over the experts the host holds, the drive under it ---------------------

HOST_RESERVE_BYTES = 8e9  # assumed: the OS, the server, its buffers: host memory the experts cannot have


def host_held_bytes(shape: Shape, pl: Placement) -> int:
    """Expert bytes the host holds: every MoE layer not wholly on the device (a cached layer's experts all stay
    in host memory, the slots hold copies)."""
    return (pl.n_cpu + pl.n_copy + pl.n_cache) * shape.layer_bytes


def page_cache_share(shape: Shape, machine: Machine, pl: Placement) -> float:
    """The share of each host-held layer's experts the host's memory keeps (1: all of them)."""
    held = host_held_bytes(shape, pl)
    if not machine.host_ram_bytes or held == 0:
        return 1.0
    return max(0.0, min(1.0, (machine.host_ram_bytes - HOST_RESERVE_BYTES) / held))


def page_cache_misses(shape: Shape, machine: Machine, pl: Placement) -> float:
    """Experts the host-held layers read from the drive a decode token, all of them together.

    The page cache keeps the experts read most (an LRU over each layer's experts), so a stock host layer
    misses like a cache of the page cache's share of the layer: the policy's replay at that share
    (esft_stats); below a sixteenth of the layer, every use is a miss. An expert in one of a cached layer's
    device slots is not read from the host while it is there, so the page cache ages it out: the device's
    slots and the page cache add up, and a cached layer misses like a cache of both."""
    share = page_cache_share(shape, machine, pl)
    if share >= 1.0:
        return 0.0
    E, k = shape.n_expert, shape.top_k

    def misses_at(slots: float) -> float:
        if slots >= E:
            return 0.0
        if slots < E / 16:
            return float(k)
        return esft_stats(round(slots), k, E).misses

    return (pl.n_cpu + pl.n_copy) * misses_at(share * E) + pl.n_cache * misses_at(pl.slots + share * E)


def page_cache_miss_share(shape: Shape, machine: Machine, pl: Placement) -> float:
    """Of the expert bytes a prompt reads from the host, the share that comes from the drive."""
    host_layers = pl.n_cpu + pl.n_copy + pl.n_cache
    return page_cache_misses(shape, machine, pl) / (host_layers * shape.top_k) if host_layers else 0.0


def nvme_bps(machine: Machine) -> float:
    return (machine.nvme_gbps or math.inf) * 1e9


EXPERT_TENSORS = 3  # gate, up, down: the expert nodes of a layer, each a split of its own
AHEAD_LAYER_SHARE = 0.75  # patch 0017 copies the next layer ahead when this one used this share of its experts


def prompt_ahead(n: int, terms: dict[str, float], copy_s: float, used_share: float, n_cache: int) -> Estimate:
    """Patch 0017: while one expert tensor computes, the next one's misses cross on the copy stream. Only the
    first tensor's copies stay in line; the others overlap the compute, so the prompt takes the longer of the
    two. Across layers the copies ahead take every expert not in a slot (the next layer's ids are not known
    yet): a share 1 - used_share of them goes unused, which the copy stream carries too."""
    if used_share >= AHEAD_LAYER_SHARE:
        copy_s /= used_share
        first = copy_s / (EXPERT_TENSORS * n_cache)
    else:
        first = copy_s / EXPERT_TENSORS  # each layer's first tensor in line, the other two ahead
    compute = sum(terms.values())
    terms["PCIe copies (in line)"] = first
    terms["PCIe copies (beyond the compute)"] = max(0.0, copy_s - first - compute)
    return Estimate(n, terms)


def distinct_used(shape: Shape, n: int) -> float:
    """Distinct experts n tokens use in a layer, routed uniformly: an upper bound (the ESFT prompts of the
    bench, skewed, use PROMPT_USED_SHARE of a layer's experts, which caps it in prompt())."""
    return shape.n_expert * (1 - (1 - shape.top_k / shape.n_expert) ** n)


# -- for the engine's auto mode ----------------------------------------------------------------------------


def split_time(m: int, c: int, t_copy_s: float, t_cpu_s: float, t_return_s: float = 0.0) -> float:
    """A layer's critical time with m misses, c of them on the CPU: max(copies, CPU)."""
    return max((m - c) * t_copy_s, c * t_cpu_s + (t_return_s if c > 0 else 0.0))


def choose_split(
    n_miss: int,
    tokens_per_miss: float,
    expert_bytes: int,
    h2d_gbps: float,
    cpu_gbps: float,
    *,
    cpu_token_cost: float = CPU_TOKEN_COST,
    t_copy_s: float | None = None,
    t_cpu_s: float | None = None,
    t_return_s: float = 0.0,
) -> int:
    """How many of a layer's `n_miss` missing experts the CPU computes; the others are copied.

    The arithmetic (the engine's `auto` mirrors it, per layer and micro-batch):

        t_copy = expert_bytes / (h2d_gbps * 1e9)                 one miss copied (the one-expert rate)
        t_cpu  = expert_bytes / (cpu_gbps * 1e9) * (1 + cpu_token_cost * (tokens_per_miss - 1))
        time(c) = max((n_miss - c) * t_copy, c * t_cpu + (c > 0 ? t_return : 0))
        return the c in 0..n_miss with the least time(c), the smaller c on a tie (a copied miss is also
        admitted to the cache at once)

    which is c = round(n_miss * t_copy / (t_copy + t_cpu)) give or take one. t_copy_s / t_cpu_s, when
    given, replace the first two lines (the model passes the copy latency in). A very slow link (t_copy
    >> t_cpu) puts every miss on the CPU; a very slow CPU, none.
    """
    if n_miss <= 0:
        return 0
    if t_copy_s is None:
        t_copy_s = expert_bytes / (h2d_gbps * 1e9)
    if t_cpu_s is None:
        t_cpu_s = expert_bytes / (cpu_gbps * 1e9) * (1 + cpu_token_cost * max(0.0, tokens_per_miss - 1))
    best, best_t = 0, split_time(n_miss, 0, t_copy_s, t_cpu_s, t_return_s)
    for c in range(1, n_miss + 1):
        t = split_time(n_miss, c, t_copy_s, t_cpu_s, t_return_s)
        if t < best_t - 1e-15:
            best, best_t = c, t
    return best


@dataclass(frozen=True)
class LayersAndCache:
    """choose_layers_and_cache's answer."""

    n_dev: int  # MoE layers wholly on the device (the last ones, as --n-cpu-moe keeps them)
    n_cache: int  # MoE layers behind the cache
    n_cpu: int  # MoE layers computed on the CPU (a budget under top-k slots for the rest)
    slots: int  # slots a cached layer
    decode_tps: float
    why: str


def choose_layers_and_cache(
    budget_bytes: int,
    shape: Shape,
    machine: Machine,
    *,
    cpu_misses: bool = True,
    stats_at: Callable[[int], CacheStats] | None = None,
) -> LayersAndCache:
    """The split of a device budget between whole layers and the cache that decodes fastest.

    The arithmetic (the engine's `--moe-cache-bytes auto` mirrors it):

        layer = n_expert * expert_bytes
        if budget >= L * layer: every expert on the device ("everything fits")
        for n_dev in 0 .. floor(budget / layer):
            rest  = L - n_dev
            slots = min(n_expert, floor((budget - n_dev * layer) / (rest * expert_bytes)))
            if slots < top_k: the rest on the CPU, T = T_gpu + rest * (t_rt + k * S / B_cpu)
            else: T = T_gpu + rest * (t_rt + p(slots) * t_x + sum over m of P_slots(m) * time(m, choose_split(m)))
                  (without CPU misses: time(m) = m * t_x), and with CPU misses T >= rest * (m + p) * t_x
        the n_dev of least T; on a tie the larger n_dev (its prompt copies less)

    P_slots(m), p(slots): the policy's replay at that slot count (ESFT_CURVE here; the engine may use a
    binomial(k, 1 - hit rate) of its own live hit rate). T_gpu does not depend on n_dev.
    """
    stats_for = stats_at or (lambda s: esft_stats(s, shape.top_k, shape.n_expert))
    layer = shape.layer_bytes
    if budget_bytes >= shape.n_moe * layer:
        t = decode(shape, machine, Placement("a", n_dev=shape.n_moe)).tokens_per_s
        return LayersAndCache(shape.n_moe, 0, 0, 0, t, "everything fits: every expert on the device")
    best: LayersAndCache | None = None
    for n_dev in range(0, min(shape.n_moe - 1, budget_bytes // layer) + 1):
        rest = shape.n_moe - n_dev
        slots = min(shape.n_expert, (budget_bytes - n_dev * layer) // (rest * shape.expert_bytes))
        if slots < shape.top_k:
            pl = Placement("c", n_dev=n_dev, n_cpu=rest)
            cand = LayersAndCache(n_dev, 0, rest, 0, decode(shape, machine, pl).tokens_per_s, "")
        else:
            pl = Placement("lc", n_dev=n_dev, n_cache=rest, slots=slots, cpu_misses=cpu_misses)
            cand = LayersAndCache(n_dev, rest, 0, slots, decode(shape, machine, pl, stats_for(slots)).tokens_per_s, "")
        if best is None or cand.decode_tps >= best.decode_tps * (1 - 1e-9):
            best = cand
    assert best is not None
    why = f"{best.n_dev} layers on the device, " + (
        f"{best.n_cache} behind a cache of {best.slots} slots" if best.n_cache else f"{best.n_cpu} on the CPU"
    )
    return replace(best, why=why)


# -- the engine's --moe-cache-bytes auto (patch 0016), the same arithmetic -----------------------------------------

# ESFT_CURVE's hit rates, s = 6..64 of 64 slots: the prior common.cpp's COMMON_MOE_HIT_PRIOR holds (the routing a
# server will see is unknown when it chooses the placement, before the model loads)
ENGINE_HIT_PRIOR: tuple[float, ...] = tuple(ESFT_CURVE[s][0] for s in range(6, 65))


def engine_hit_prior(share: float) -> float:
    """common_moe_hit_prior: the prior at the nearest of 6..64 slots of 64 (halves round up, as C's floor(x + 0.5))."""
    s = min(64, max(6, math.floor(share * 64.0 + 0.5)))
    return ENGINE_HIT_PRIOR[s - 6]


@dataclass(frozen=True)
class EngineSplit:
    """common_moe_choose_split's answer."""

    n_dev: int  # MoE layers wholly on the device (the last ones)
    n_slot: int  # slots a cached layer; 0: no cache
    cost_s: float  # the round trips and misses a decode step the split leaves

    def why(self, n_layer: int, n_expert: int) -> str:
        rest = n_layer - self.n_dev
        if rest == 0:
            return f"every expert fits: all {n_layer} MoE layers on the device"
        if self.n_slot == 0:
            return f"{self.n_dev} layers on the device, {rest} on the CPU (fewer slots than top-k)"
        return f"{self.n_dev} layers on the device, a cache of {self.n_slot} of {n_expert} slots for {rest}"


def engine_auto_split(
    n_layer: int, n_expert: int, n_used: int, expert_bytes: int, budget: int, t_rt_s: float, t_miss_s: float
) -> EngineSplit:
    """The engine's `--moe-cache-bytes auto`, operation for operation (common.cpp common_moe_choose_split).

    A cached layer costs a decode step one round trip (t_rt) and n_used * (1 - hit(slots)) misses of t_miss;
    a layer on the device neither. The n_dev of least cost, the larger on a tie; where no split leaves top-k
    slots, whole layers only. It is choose_layers_and_cache with the CPU's share of the misses, the prefetch
    and the prompt left out, on the ESFT prior: `predictions` prints what the full model predicts for its
    choice next to the full model's own."""
    layer = n_expert * expert_bytes
    if budget >= n_layer * layer:
        return EngineSplit(n_layer, 0, 0.0)
    max_dev = min(n_layer - 1, budget // layer)
    best: EngineSplit | None = None
    for n_dev in range(max_dev + 1):
        rest = n_layer - n_dev
        n_slot = min(n_expert, (budget - n_dev * layer) // (rest * expert_bytes))
        if n_slot < n_used:
            continue
        cost = rest * (t_rt_s + n_used * (1.0 - engine_hit_prior(n_slot / n_expert)) * t_miss_s)
        if best is None or cost <= best.cost_s * (1.0 + 1e-9):
            best = EngineSplit(n_dev, n_slot, cost)
    return best if best is not None else EngineSplit(max_dev, 0, 0.0)


# -- reading runs ---------------------------------------------------------------------------------------------


def parse_h2d_txt(text: str) -> dict[str, float]:
    """h2d.txt of bench/data/gpu-2026-12-04 as gpu_facts' keys."""
    out: dict[str, float] = {}
    pats = {
        "pageable_512MiB_gbps": r"pageable:\s*([\d.]+) GB/s",
        "pinned_512MiB_gbps": r"pinned:\s*([\d.]+) GB/s",
        "pageable_expert_gbps": r"pageable one expert[^:]*:\s*([\d.]+) GB/s",
        "pinned_expert_gbps": r"pinned one expert[^:]*:\s*([\d.]+) GB/s",
    }
    for key, pat in pats.items():
        m = re.search(pat, text, re.IGNORECASE)
        if m:
            out[key] = float(m[1])
    return out


def base_of(key: str, row: Mapping) -> str:
    return str(row.get("base") or key[0])


def host_memory(key: str, row: Mapping) -> str:
    """pinned, mapped or ring: where a row's host experts are copied from."""
    args = [str(a) for a in row.get("server_args") or []]
    env = row.get("env") or {}
    mode = args[args.index("--load-mode") + 1] if "--load-mode" in args else row.get("load_mode")
    log = str(row.get("host_experts_log") or "")
    if "through a staging ring" in log:  # not "copied directly (no staging ring: ...)"
        return "ring"
    if "pageable host memory" in log or "refused pinned" in log:
        return "mapped"
    if "from pinned host memory" in log or "pinned memory (load mode none)" in log:
        return "pinned"
    if mode == "none" and env.get("GGML_CUDA_NO_PINNED") != "1":
        return "pinned"
    return "mapped"  # llama.cpp's default maps the model; the engine before 0014 made no choice


def placement_of(key: str, row: Mapping, shape: Shape) -> Placement:
    base, host = base_of(key, row), host_memory(key, row)
    host_layers = len(row.get("host_expert_layers") or [])
    L = shape.n_moe
    if base == "a":
        return Placement(key, n_dev=L, host=host)
    if base == "b":
        return Placement(key, n_cpu=L, host=host)
    if base == "c":
        return Placement(key, n_dev=L - host_layers, n_cpu=host_layers, host=host)
    if base == "d":
        return Placement(key, n_copy=L, host=host)
    if base == "e":
        through = bool(row.get("host_experts_log"))  # the line came with 0014, after 0013 (prompts through the cache)
        ahead = "copied one expert tensor ahead" in str(row.get("prompt_ahead_log") or "")  # 0017 on
        return Placement(
            key, n_cache=L, slots=slots_of(row, shape), host=host, prompt_through_cache=through, prompt_ahead=ahead
        )
    raise NotModelled(f"unknown placement {base!r}")


@dataclass
class Cell:
    file: str
    row: str
    what: str  # decode | prompt
    measured: float | None
    predicted: float | None = None
    bound: str = ""
    status: str = "checked"  # checked | calibration | not modelled | out of scope
    note: str = ""

    @property
    def error(self) -> float | None:
        if self.predicted is None or not self.measured:
            return None
        return self.predicted / self.measured - 1

    @property
    def fails(self) -> bool:
        return self.status in ("checked", "calibration") and (self.error is None or abs(self.error) > TOLERANCE)


def load_runs(folder: Path) -> dict[str, dict]:
    runs = {}
    for path in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("benchmark") == "expert_offload":
            runs[path.name] = doc
    return runs


def _measured(row: Mapping, what: str) -> float | None:
    v = row.get(f"{what}_tokens_per_s")
    return float(v) if v else None


def a_rows(runs: Mapping[str, dict]) -> list[tuple[str, dict]]:
    return [
        (name, r)
        for name, run in runs.items()
        for key, r in run.get("configs", {}).items()
        if base_of(key, r) == "a" and r.get("status") == "measured" and r.get("decode_tokens_per_s")
    ]


def fit_prompt(rows: Iterable[Mapping]) -> tuple[float, float]:
    """g0, g1 of G(n) = g0 + g1 n by least squares over a's prompt runs."""
    xs, ys = [], []
    for r in rows:
        runs = r.get("runs") or {}
        for n, tps in zip(runs.get("prompt_tokens", []), runs.get("prompt_tokens_per_s", []), strict=False):
            if n and tps:
                xs.append(float(n))
                ys.append(n / tps)
    if len(set(xs)) < 2:
        raise NotModelled("a's prompt runs have one length: g0 and g1 cannot be told apart")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    g1 = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - g1 * mx, g1


def gpu_name(run: Mapping) -> str:
    gpu = (run.get("constants") or {}).get("gpu")
    return str(gpu.get("name", "")) if isinstance(gpu, dict) else ""


def readme_gpu(folder: Path) -> str:
    """The GPU a folder's README names (bench/data/gpu-2026-12-04's JSON files carry no constants)."""
    readme = folder / "README.md"
    text = readme.read_text(errors="replace") if readme.is_file() else ""
    m = re.search(r"NVIDIA (H200|H100|A100|RTX \w+)", text)
    return f"NVIDIA {m[1]} (the folder's README)" if m else ""


def hbm_of(name: str) -> float | None:
    return next((v for k, v in HBM_GBPS.items() if k in name), None)


def machine_for(name: str, run: Mapping, runs: Mapping[str, dict], folder: Path) -> Machine:
    """The constants of one run: its own, else its folder's (same machine), else the H200 defaults."""
    src: dict[str, str] = {}
    h2d = dict((run.get("constants") or {}).get("h2d") or {})
    if "pinned_512MiB_gbps" in h2d:
        src["h2d"] = f"{name}: constants.h2d (gpu_facts, at the run's start)"
    elif (folder / "h2d.txt").is_file():
        h2d = parse_h2d_txt((folder / "h2d.txt").read_text())
        src["h2d"] = "h2d.txt of the folder (torch, same machine and day; the JSON has no constants)"
    needed = ("pinned_512MiB_gbps", "pinned_expert_gbps", "pageable_512MiB_gbps")
    if not all(k in h2d for k in needed):
        raise NotModelled("no host->device rates: neither constants.h2d in the JSON nor h2d.txt in the folder")
    mapped = (run.get("constants") or {}).get("h2d_mapped") or {}
    mapped_gbps = mapped.get("mapped_512MiB_gbps") if isinstance(mapped, dict) else None
    src["h2d_mapped"] = (
        f"{name}: constants.h2d_mapped (the model file, at the run's start)"
        if mapped_gbps
        else f"not measured: pageable x MAPPED_FACTOR {MAPPED_FACTOR}"
    )
    own = [(name, r) for n, r in a_rows(runs) if n == name]
    a_list = own or a_rows(runs)
    gname = gpu_name(run) or next((gpu_name(r) for r in runs.values() if gpu_name(r)), "") or readme_gpu(folder)
    if a_list:
        t_gpu = 1 / statistics.median(float(r["decode_tokens_per_s"]) for _, r in a_list)
        g0, g1 = fit_prompt(r for _, r in a_list)
        files = sorted({n for n, _ in a_list})
        src["gpu"] = f"row a of {', '.join(files)}" + ("" if own else " (same folder: same machine, other run)")
    elif "H200" in gname:
        t_gpu, g0, g1 = H200_GPU["gpu_token_s"], H200_GPU["gpu_prompt_fixed_s"], H200_GPU["gpu_prompt_token_s"]
        src["gpu"] = (
            "no row a in the folder: the H200 of 2026-12-04 (bench/data/gpu-2026-12-04 r50/r25 a rows; same GPU model)"
        )
    else:
        raise NotModelled("no row a (all on the device) in the folder and no measured GPU of this kind")
    hbm = hbm_of(gname) or (hbm_of("H200") if "H200" in src["gpu"] else None)
    base = Machine(
        name=gname or "GPU",
        h2d_pinned_big_gbps=float(h2d["pinned_512MiB_gbps"]),
        h2d_pinned_expert_gbps=float(h2d["pinned_expert_gbps"]),
        h2d_pageable_big_gbps=float(h2d["pageable_512MiB_gbps"]),
        cpu_expert_gbps=1.0,
        gpu_token_s=t_gpu,
        gpu_prompt_fixed_s=g0,
        gpu_prompt_token_s=g1,
        h2d_mapped_gbps=float(mapped_gbps) if mapped_gbps else None,
        ref_bytes=int((h2d.get("bytes") or {}).get("expert", 4_866_048)),
        hbm_gbps=hbm,
        sources=src,
    )
    shape = Shape.from_run(run)
    b = next((run["configs"][k] for k in ("b", "bp") if k in run.get("configs", {})), None)
    if not b or not b.get("decode_tokens_per_s"):
        raise NotModelled("no row b: CPU expert GB/s is derived from it")
    cpu_s = 1 / float(b["decode_tokens_per_s"]) - t_gpu - shape.n_moe * base.t_rt_s
    if cpu_s <= 0:
        raise NotModelled("row b decodes faster than a plus its round trips: CPU GB/s undefined")
    cpu = shape.n_moe * shape.top_k * shape.expert_bytes / cpu_s / 1e9
    src["cpu"] = f"{name}: row b's decode at {run.get('threads')} threads, net of T_gpu and L t_rt"
    return replace(base, cpu_expert_gbps=cpu)


def check_run(name: str, run: dict, runs: Mapping[str, dict], folder: Path) -> list[Cell]:
    """Every cell of one run: predicted against measured, or why not."""
    cells: list[Cell] = []
    try:
        machine: Machine | None = machine_for(name, run, runs, folder)
        shape: Shape | None = Shape.from_run(run)
        why = ""
    except NotModelled as exc:
        machine, shape, why = None, None, str(exc)
    for key, row in run.get("configs", {}).items():
        for what in ("decode", "prompt"):
            cell = Cell(name, key, what, _measured(row, what))
            cells.append(cell)
            if row.get("status") != "measured":
                cell.status, cell.note = "out of scope", f"not measured: {row.get('status')}"
            elif row.get("concurrent") is not None or re.search(r"-np\d+$", key):
                cell.status, cell.note = "out of scope", "-np N: a batched decode of several requests"
            elif machine is None or shape is None:
                cell.status, cell.note = "not modelled", why
            else:
                predict_cell(cell, key, row, shape, machine)
    return cells


def predict_cell(cell: Cell, key: str, row: Mapping, shape: Shape, machine: Machine) -> None:
    pl: Placement | None = None
    try:
        pl = placement_of(key, row, shape)
        stats = stats_from_row(row, shape) if pl.n_cache else None
        base = base_of(key, row)
        if cell.what == "decode":
            est = decode(shape, machine, pl, stats)
            cell.predicted, cell.bound = est.tokens_per_s, est.bound
            if base == "b":
                cell.status, cell.note = "calibration", "B_cpu is derived from this cell"
            elif base == "a" and "row a of " + cell.file in machine.sources.get("gpu", ""):
                cell.status, cell.note = "calibration", "T_gpu is this cell"
            if stats:
                cell.note = f"hit rate {100 * stats.hit_rate:.1f}% ({stats.source})"
        else:
            runs = row.get("runs") or {}
            ns = runs.get("prompt_tokens") or []
            copied = runs.get("prompt_h2d_expert_bytes_derived") or [None] * len(ns)
            ests = [prompt(shape, machine, pl, int(n), b, stats) for n, b in zip(ns, copied, strict=False)]
            if not ests:
                raise NotModelled("no prompt runs")
            cell.predicted = statistics.median(e.tokens_per_s for e in ests)
            cell.bound = ests[0].bound
            if base == "a" and "row a of " + cell.file in machine.sources.get("gpu", ""):
                cell.status, cell.note = "calibration", "g0, g1 are fitted on this row's runs"
    except NotModelled as exc:
        cell.status, cell.note = "not modelled", str(exc)
        if pl is not None and pl.host == "ring" and cell.measured:
            cell.note += "; " + implied_ring_rate(cell, row, shape, machine, pl)


def implied_ring_rate(cell: Cell, row: Mapping, shape: Shape, machine: Machine, pl: Placement) -> str:
    """What a ring row's measured time implies for the ring's copy rate (GB/s), for the record."""
    try:
        if cell.what == "decode":
            stats = stats_from_row(row, shape)
            rest = decode(shape, machine, replace(pl, host="pinned", n_cache=pl.n_cache), stats)
            rest_s = rest.total_s - rest.terms.get("PCIe copies", 0.0)
            nbytes = pl.n_cache * (stats.misses + stats.prefetch) * shape.expert_bytes
            rate = nbytes / (1 / cell.measured - rest_s) / 1e9
        else:
            runs = row.get("runs") or {}
            n, b = runs["prompt_tokens"][0], runs["prompt_h2d_expert_bytes_derived"][0]
            rate = b / (n / runs["prompt_tokens_per_s"][0] - machine.gpu_prompt_s(n)) / 1e9
        return f"the measured cell implies a ring rate of {rate:.1f} GB/s (mapped direct: {machine.mapped_gbps:.1f})"
    except (KeyError, IndexError, ZeroDivisionError, NotModelled):
        return "no implied rate"


def check_folder(folder: Path) -> list[Cell]:
    runs = load_runs(folder)
    cells: list[Cell] = []
    for name, run in runs.items():
        cells += check_run(name, run, runs, folder)
    return cells


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def cells_table(cells: Sequence[Cell]) -> str:
    lines = [
        "| cell | predicted tok/s | measured tok/s | error | bounding term | note |",
        "|---|---|---|---|---|---|",
    ]
    for c in cells:
        err = "-" if c.error is None else f"{100 * c.error:+.1f}%"
        flag = " **FAIL**" if c.fails else ""
        status = "" if c.status == "checked" else f"[{c.status}] "
        lines.append(
            f"| {c.file.removesuffix('.json')} {c.row} {c.what} | {_fmt(c.predicted)} | {_fmt(c.measured)} "
            f"| {err}{flag} | {c.bound} | {status}{c.note} |"
        )
    return "\n".join(lines)


def constants_table(folder: Path) -> str:
    runs = load_runs(folder)
    lines = []
    for name, run in runs.items():
        try:
            m = machine_for(name, run, runs, folder)
        except NotModelled as exc:
            lines.append(f"- {name}: constants not available: {exc}")
            continue
        lines.append(
            f"- {name}: h2d pinned {m.h2d_pinned_big_gbps:.1f} GB/s (512 MiB), {m.h2d_pinned_expert_gbps:.1f} "
            f"(one expert; t_lat {1e6 * m.copy_latency_s:.1f} us); pageable {m.h2d_pageable_big_gbps:.1f}, "
            f"mapped {m.mapped_gbps:.2f}; B_cpu {m.cpu_expert_gbps:.1f} GB/s; T_gpu {1e3 * m.gpu_token_s:.2f} ms; "
            f"G(n) = {1e3 * m.gpu_prompt_fixed_s:.1f} ms + {1e3 * m.gpu_prompt_token_s:.4f} ms x n; "
            f"t_rt {1e6 * m.t_rt_s:.0f} us. Sources: " + "; ".join(f"{k}: {v}" for k, v in m.sources.items())
        )
    return "\n".join(lines)


# -- predictions: the new design on the H200 and on a consumer machine ------------------------------------------


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


def consumer_machine(shape: Shape, h200: Machine) -> Machine:
    """A 24 GB card on PCIe 4.0 x16 (25 GB/s pinned, 12 pageable) and an 8-core desktop CPU with dual-channel
    DDR5 (~60 GB/s; CONSUMER_CPU_GBPS assumed). T_gpu: the H200's per-layer overhead (its step less its weight
    reads, per layer) times the shape's layers, plus the shape's weight reads at the card's bandwidth;
    the prompt's per-token compute 3x the H200's (int8 tensor throughput ~660 against ~1980 TOPS)."""
    ds = KNOWN_SHAPES["ds-v2-lite"]
    h200_read = ds.decode_read_bytes / (h200.hbm_gbps * HBM_EFFICIENCY * 1e9)  # type: ignore[operator]
    per_layer = (h200.gpu_token_s - h200_read) / ds.n_layer
    t_gpu = per_layer * shape.n_layer + shape.decode_read_bytes / (CONSUMER_HBM_GBPS * HBM_EFFICIENCY * 1e9)
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
        hbm_gbps=CONSUMER_HBM_GBPS,
        sources={
            "h2d": "given: PCIe 4.0 x16, 25 GB/s pinned, 12 pageable; one copy's fixed cost the H200's",
            "cpu": f"assumed {CONSUMER_CPU_GBPS} GB/s CPU expert throughput (8 cores, dual-channel DDR5 ~60 GB/s)",
            "gpu": "scaled from the H200 (see consumer_machine)",
        },
    )


@dataclass
class Prediction:
    machine: str
    shape: str
    budget: str
    budget_bytes: int
    row: str
    what: str
    decode_tps: float
    prompt_tps: float
    decode_bound: str
    prompt_bound: str
    note: str = ""


def n_cpu_moe_layers(shape: Shape, budget: int) -> int:
    """Stock --n-cpu-moe at `budget`: the last whole layers that fit on the device."""
    return min(shape.n_moe, budget // shape.layer_bytes)


def design_rows(shape: Shape, machine: Machine, budget: int, label: str) -> list[Prediction]:
    """At one device budget: the best stock row (c pinned), e as built, e+cpu, layers+cache (+cpu). Where the
    host-held experts pass the host's memory, nothing can be pinned: every row copies from the mapping."""
    L, S = shape.n_moe, shape.expert_bytes
    out: list[Prediction] = []
    n = PROMPT_TOKENS[0]

    def add(row: str, what: str, pl: Placement, stats: CacheStats | None, note: str = "") -> None:
        if page_cache_share(shape, machine, pl) < 1.0:
            pl = replace(pl, host="mapped")
            what = what.replace(" pinned", "") + "; from the mapping (more than the host's memory: none pinned)"
        d, p = decode(shape, machine, pl, stats), prompt(shape, machine, pl, n, None, stats)
        out.append(
            Prediction(
                machine.name,
                shape.name,
                label,
                budget,
                row,
                what,
                d.tokens_per_s,
                p.tokens_per_s,
                d.bound,
                p.bound,
                note,
            )
        )

    if budget >= shape.routed_bytes:
        add("a", "everything fits: every expert on the device", Placement("a", n_dev=L), None)
        return out
    n_dev = n_cpu_moe_layers(shape, budget)
    add(
        "cp",
        f"stock --n-cpu-moe pinned: {n_dev} layers on the device",
        Placement("cp", n_dev=n_dev, n_cpu=L - n_dev),
        None,
    )
    slots = min(shape.n_expert, budget // (L * S))
    if slots >= shape.top_k:
        st = esft_stats(slots, shape.top_k, shape.n_expert)
        add(
            "e",
            f"expert cache, {slots} slots, pinned (as built)",
            Placement("e", n_cache=L, slots=slots),
            st,
            st.source,
        )
        pl = Placement("e+cpu", n_cache=L, slots=slots, cpu_misses=True)
        add("e+cpu", f"{slots} slots, misses split PCIe/CPU (choose_split)", pl, st, st.source)
        # patch 0017's two buffers (a full-size expert tensor each) come out of the budget when they take at
        # most an eighth of it
        ahead = 2 * shape.n_expert * S // EXPERT_TENSORS
        slots_a = min(shape.n_expert, (budget - ahead) // (L * S))
        if 8 * ahead <= budget and slots_a >= shape.top_k:
            st_a = esft_stats(slots_a, shape.top_k, shape.n_expert)
            pl = Placement("e+cpu+ahead", n_cache=L, slots=slots_a, cpu_misses=True, prompt_ahead=True)
            add("e+cpu+ahead", f"{slots_a} slots and the prompt's copies one tensor ahead", pl, st_a, st_a.source)
    else:
        out.append(
            Prediction(
                machine.name,
                shape.name,
                label,
                budget,
                "e",
                f"{slots} slots < top-{shape.top_k}: the cache refuses to start",
                0.0,
                0.0,
                "",
                "",
            )
        )
    for cpu in (False, True):
        lc = choose_layers_and_cache(budget, shape, machine, cpu_misses=cpu)
        if lc.n_cache:
            st = esft_stats(lc.slots, shape.top_k, shape.n_expert)
            pl = Placement("lc", n_dev=lc.n_dev, n_cache=lc.n_cache, slots=lc.slots, cpu_misses=cpu)
        else:
            st, pl = None, Placement("lc", n_dev=lc.n_dev, n_cpu=lc.n_cpu)
        add("layers+cache" + ("+cpu" if cpu else ""), lc.why, pl, st, st.source if st else "")
    auto = engine_auto_split(
        shape.n_moe,
        shape.n_expert,
        shape.top_k,
        shape.expert_bytes,
        budget,
        machine.t_rt_s,
        machine.expert_copy_s(shape.expert_bytes, "pinned"),
    )
    rest = shape.n_moe - auto.n_dev
    if auto.n_slot:
        st = esft_stats(auto.n_slot, shape.top_k, shape.n_expert)
        pl = Placement("lc", n_dev=auto.n_dev, n_cache=rest, slots=auto.n_slot, cpu_misses=True)
    elif rest:
        st, pl = None, Placement("c", n_dev=auto.n_dev, n_cpu=rest)
    else:
        st, pl = None, Placement("a", n_dev=shape.n_moe)
    add("auto (engine)", auto.why(shape.n_moe, shape.n_expert), pl, st, st.source if st else "")
    return out


def predictions() -> list[Prediction]:
    h200 = h200_machine()
    out: list[Prediction] = []
    ds = Shape.named("ds-v2-lite")
    for share, label in ((0.5, "50%"), (0.25, "25%"), (0.125, "12.5%")):
        out += design_rows(ds, h200, int(ds.routed_bytes * share), label)
    for name in ("ds-v2-lite", "qwen3-30b-a3b"):
        shape = Shape.named(name)
        consumer = consumer_machine(shape, h200)
        free = 24 * 10**9 - shape.other_bytes - 2 * 10**9  # the card less the dense weights, KV and compute (2 GB)
        out += design_rows(shape, consumer, free, "24 GB card")
        for share, label in ((0.5, "50%"), (0.25, "25%"), (0.125, "12.5%")):
            out += design_rows(shape, consumer, int(shape.routed_bytes * share), label)
    return out


def predictions_table(preds: Sequence[Prediction]) -> str:
    lines = [
        "| machine | shape | budget | row | placement | decode tok/s | bound | prompt tok/s (117 tokens) | bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in preds:
        lines.append(
            f"| {p.machine} | {p.shape} | {p.budget} ({p.budget_bytes / 1e9:.2f} GB) | {p.row} | {p.what} "
            f"| {p.decode_tps:.1f} | {p.decode_bound} | {p.prompt_tps:.0f} | {p.prompt_bound} |"
        )
    return "\n".join(lines)


# -- the real shapes (issue 43): each on the H200 and on the 24 GB desktop ------------------------------------

REAL_SHAPES = (
    "gpt-oss-20b",
    "gpt-oss-120b",
    "mixtral-8x7b",
    "llama-4-scout",
    "glm-4.5-air",
    "qwen3-235b-a22b",
    "deepseek-v3",
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


def real_shape_predictions() -> list[Prediction]:
    """Each real shape with the whole card as its budget (the card less the dense weights and 2 GB), on the
    H200 and on the 24 GB desktop: stock --n-cpu-moe against the project's default and the cache's rows."""
    h200 = h200_machine()
    out: list[Prediction] = []
    for name in REAL_SHAPES:
        shape = Shape.named(name)
        for machine, card in (
            (h200_for(shape, h200), H200_DEVICE_BYTES),
            (
                replace(consumer_machine(shape, h200), host_ram_bytes=CONSUMER_HOST_RAM_BYTES, nvme_gbps=NVME_GBPS),
                24 * 10**9,
            ),
        ):
            free = max(0, card - shape.other_bytes - DEVICE_RESERVE_BYTES)
            out += design_rows(shape, machine, free, f"{card / 1e9:.0f} GB card")
    return out


def real_shapes_table(preds: Sequence[Prediction]) -> str:
    """One line a shape and machine: the routed experts against the card's room, stock --n-cpu-moe (pinned,
    or the mapping) against the project's default (auto) and the best of the cache's rows."""
    lines = [
        "| shape | machine | experts / room on the card | stock --n-cpu-moe tok/s | default (auto) tok/s | "
        "auto / stock | best cache row | its tok/s | decode bound (auto) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list[Prediction]] = {}
    for p in preds:
        groups.setdefault((p.shape, p.machine), []).append(p)
    for (name, machine), rows in groups.items():
        routed = Shape.named(name).routed_bytes
        by = {r.row: r for r in rows}
        auto = by.get("auto (engine)") or by["a"]
        stock = by.get("cp") or by["a"]
        cache = [r for r in rows if r.row.startswith(("e", "layers")) and r.decode_tps > 0]
        best = max(cache, key=lambda r: r.decode_tps, default=auto)
        short = "H200" if "H200" in machine else "24 GB desktop"
        lines.append(
            f"| {name} | {short} | {routed / 1e9:.1f} / {auto.budget_bytes / 1e9:.1f} GB | {stock.decode_tps:.1f} "
            f"| {auto.decode_tps:.1f} | {auto.decode_tps / stock.decode_tps:.2f}x | {best.row} | "
            f"{best.decode_tps:.1f} | {auto.decode_bound} |"
        )
    return "\n".join(lines)


# -- the replay curve ----------------------------------------------------------------------------------------


def replay_curve(
    slot_counts: Iterable[int], runs: int = 3, prompt_tokens: Sequence[int] = PROMPT_TOKENS, decode_tokens: int = 65
) -> dict[int, tuple[float, float, float, tuple[float, ...], float]]:
    """ESFT_CURVE's rows: the project's default policy replaying the bench's requests on the ESFT trace.

    As bench/expert_offload.py sends them (request r replays sequence r from its first evaluated token): a
    warm-up (sequence 0, 10 tokens one at a time), then per run a prompt (sequence 1 + 2i, its first n tokens
    in one micro-batch: a bypass when they use more experts than a layer has slots, counting the used experts
    already resident) and a decode (sequence 2 + 2i, 65 tokens one at a time). Profile: priors and
    transitions fitted on the sequences no run replays, requests tagged with their task.
    """
    import numpy as np

    from moe_l2_cache.policy.prefetch import CrossLayerPrefetch
    from moe_l2_cache.policy.profile import fit_profile
    from moe_l2_cache.policy.registry import DEFAULT_POLICY, make_policy
    from moe_l2_llama.route_trace import esft_sequence_tasks, from_esft_npz

    npz = esft_npz()
    trace, tags = from_esft_npz(npz), esft_sequence_tasks(npz)
    replayed = 1 + 2 * runs
    fit = list(range(replayed, trace.n_seq))
    ids = np.concatenate([trace.sequence(q) for q in fit])
    labels = np.repeat([tags[q] for q in fit], np.diff(trace.offsets)[fit])
    prof = fit_profile(ids, list(labels), trace.n_expert)
    L, k = trace.n_layer, trace.n_used
    out = {}
    for slots in slot_counts:
        cache = make_policy(
            DEFAULT_POLICY,
            L,
            trace.n_expert,
            slots,
            top_k=k,
            domain_freq=dict(prof.domain_freq),
            transitions=prof.transitions,
            domain_transitions=dict(prof.domain_transitions),
        )
        hist = [0] * (k + 1)
        used = copied = 0
        n_tok = 0

        cache.on_domain(tags[0])
        for tok in trace.sequence(0)[:10]:
            for layer in range(L):
                hist[k - cache.access(layer, tuple(sorted(int(x) for x in tok[layer])))] += 1
        for i in range(runs):
            q = 1 + 2 * i
            cache.on_domain(tags[q])
            batch = trace.sequence(q)[: prompt_tokens[i % len(prompt_tokens)]]
            warm = i > 0 or runs == 1  # the share counts prompts after a decode: a warm cache
            for layer in range(L):
                experts = tuple(sorted({int(x) for x in batch[:, layer, :].ravel()}))
                if len(experts) > slots:  # a bypass: residency unchanged, resident experts from slots
                    miss = len(experts) - len(cache.resident(layer).intersection(experts))
                else:
                    miss = len(experts) - cache.access(layer, experts)
                used += len(experts) if warm else 0
                copied += miss if warm else 0
            q += 1
            cache.on_domain(tags[q])
            before = sum(hist)
            for tok in trace.sequence(q)[:decode_tokens]:
                for layer in range(L):
                    hist[k - cache.access(layer, tuple(sorted(int(x) for x in tok[layer])))] += 1
            n_tok += (sum(hist) - before) // L
        decode_hist = hist  # warm-up included: a few tokens of 205
        acc = sum(decode_hist) * k
        misses = sum(m * c for m, c in enumerate(decode_hist))
        prefetch = cache.stats.loads if isinstance(cache, CrossLayerPrefetch) else 0
        tokens = sum(decode_hist) / L
        out[slots] = (
            round(1 - misses / acc, 4),
            round(misses / tokens, 2),
            round(prefetch / tokens, 2),
            tuple(round(c / sum(decode_hist), 4) for c in decode_hist),
            round(copied / used, 4),
        )
    return out


# -- main ---------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, nargs="*", default=[], help="folders of expert_offload JSON files")
    parser.add_argument("--json", type=Path, help="write the predictions (and the --against cells) here")
    parser.add_argument("--replay-curve", action="store_true", help="print ESFT_CURVE from the policy's replay")
    args = parser.parse_args(argv)
    if args.replay_curve:
        curve = replay_curve(range(6, 65))
        print("ESFT_CURVE = {")
        for s, v in curve.items():
            print(f"    {s}: {v!r},")
        print("}")
        return 0
    failed = False
    doc: dict = {"tolerance": TOLERANCE, "free_parameters": free_parameters(), "against": {}}
    for folder in args.against:
        if not folder.is_dir():
            print(f"error: --against {folder}: not a folder", file=sys.stderr)
            return 2
        cells = check_folder(folder)
        if not cells:
            print(f"error: --against {folder}: no expert_offload JSON there", file=sys.stderr)
            return 2
        print(f"## {folder}\n")
        print(constants_table(folder) + "\n")
        print(cells_table(cells))
        bad = [c for c in cells if c.fails]
        checked = [c for c in cells if c.status in ("checked", "calibration")]
        worst = max((abs(c.error) for c in checked if c.error is not None), default=0.0)
        print(
            f"\n{len(checked)} cells checked ({sum(c.status == 'calibration' for c in cells)} calibration), "
            f"{len(cells) - len(checked)} not modelled or out of scope (reasons above); worst error "
            f"{100 * worst:.1f}%; {len(bad)} over {100 * TOLERANCE:.0f}%\n"
        )
        failed |= bool(bad)
        doc["against"][str(folder)] = [asdict(c) | {"error": c.error} for c in cells]
    if not args.against or args.json:
        preds = predictions()
        doc["predictions"] = [asdict(p) for p in preds]
        real = real_shape_predictions()
        doc["real_shapes"] = [asdict(p) for p in real]
        if not args.against:
            print(predictions_table(preds))
            print("\n## The real shapes (issue 43): the whole card as the budget\n")
            print(real_shapes_table(real))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if failed else 0


def free_parameters() -> dict[str, float]:
    return {
        "t_rt_s": T_RT_S,
        "mapped_factor": MAPPED_FACTOR,
        "cpu_token_cost": CPU_TOKEN_COST,
        "hbm_efficiency": HBM_EFFICIENCY,
    }


if __name__ == "__main__":
    sys.exit(main())
