"""Where the experts live: decode and prompt tokens/s, and host→device expert bytes per token, for the
ways llama-server can place a MoE model's experts on a device, side by side in one run.

One llama-server per configuration, all on the same model and device, every one with -ngl 99:
  a  all-device    everything on the device (only when it fits in the device's free memory)
  b  cpu-moe       --cpu-moe: the routed experts stay in host memory and are computed on the CPU
  c  n-cpu-moe     --n-cpu-moe N: the experts of the last layers on the device, N chosen so that the
                   device holds no more expert bytes than the expert cache's budget (--cache-bytes)
  d  copy-used     --cpu-moe with GGML_OP_OFFLOAD_MIN_BATCH=1: the scheduler copies the experts each
                   micro-batch uses to the device and computes them there (the path the cache sits on)
  e  expert-cache  --cpu-moe with the expert cache (--moe-cache-bytes) at the device expert bytes of c:
                   used experts computed on the device, only the misses copied (docs/expert-cache.md)
Variants: bp, cp, dp, ep are b, c, d, e with `--load-mode none` (no mmap: llama.cpp keeps host-resident
weights in the device's pinned host buffer), so that the best stock row is the best a llama.cpp user
could configure; em is e with `--load-mode mmap` forced, el e with `--moe-cache-policy lru`; e itself
names no load mode (the engine chooses, and its "expert cache: host experts" line goes into the JSON).
The project's rows are set against the best stock row at no more device expert bytes (vs_best_stock).
--concurrent N measures N concurrent requests on servers of their own (-np N; domains mixed);
--constants puts bench/gpu_facts.py's machine constants into the JSON beside those the runs give
(CPU expert GB/s from b, GPU time per token from a), and on CUDA the copy rate from the mapped model
file itself (constants.h2d_mapped); bench/placement_model.py --against checks a folder of these JSON
files against its cost model; --gauges reads the NVML gauges against nvidia-smi.
Requests take turns over the servers (one generates at a time, the order rotated each run) so that
machine noise hits all alike. Every run is two requests per server: the prompt alone (n_predict 1,
no prompt cache: prompt tokens/s) and then the same prompt with the cache (one token re-evaluated,
then --tokens decode steps: decode tokens/s).

Host→device expert bytes per token: llama.cpp counts no such thing, so it is *derived* from what is
measured. ggml's scheduler copies a host-resident expert tensor to the device only for a matrix
product whose batch (the rows of that layer in the micro-batch) reaches the device's offload
minimum (GGML_OP_OFFLOAD_MIN_BATCH, 32 by default), and then only the experts that micro-batch
used. The routing telemetry (GET /moe/routing?reset=1 after each request) gives per layer which
experts were used and how often; a prompt that fits in one micro-batch is one step, so its distinct
experts per layer are the experts copied; a decode step has one row, so each count is one copy.
Copies x the expert's bytes from the GGUF (gate + up + down) / tokens. llama.cpp's padding (at most
512 bytes per run of consecutive experts) is left out. Activations and the other weights are not
counted: they are the same in every configuration.

With a route trace (LLAMA_MOE_ROUTE_TRACE, the telemetry patch's test override) every server routes
exactly the experts DeepSeek-V2-Lite routed on the ESFT prompts; without one the model's own
(random) router picks them, which the JSON and the table say.

    python bench/expert_offload.py [--backend vulkan|cuda|cpu|rpc] [--binary PATH] [--model PATH | --full]
        [--cache-bytes 50%|4GiB|N] [--configs a,b,bp,c,cp,d,dp,e,ep,em,el] [--runs 5] [--tokens 32]
        [--trace FILE|auto|none] [--concurrent 4 --concurrent-configs cp,e] [--constants FILE|measure]
        [--gauges] [--start-jobs N] [--out bench/results/expert_offload.json] [--log-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from moe_l2_contracts.admin import ADMIN_TOKEN_HEADER
from moe_l2_gguf.index import ExpertIndex, GGUFIndexError, load_index
from moe_l2_llama.build import built_with_patch
from moe_l2_llama.cpu_features import cpu_has_amx
from moe_l2_llama.route_trace import ROUTE_TRACE_ENV, esft_sequence_tasks
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.llama_service import llama_service_spec
from moe_l2_ops.stats import parse_metrics
from moe_l2_ops.supervisor import Supervisor, SupervisorError, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own modules: harness, data_paths
import data_paths
from harness.output import machine, write_json
from harness.prompts import make_prompt
from harness.servers import (
    BenchError,
    Interrupted,
    on_sigterm,
    resolve_binary,
    start_rpc_device,
    trace_patch_present,
)
from harness.timing import median, paired_ratio, rotated
from harness.traces import interleave_domains, subset_trace
from offload_tables import fmt_num, table, versus_best_stock, versus_table

REPO = Path(__file__).resolve().parent.parent
BACKENDS = ("vulkan", "cuda", "cpu", "rpc")
DEFAULT_OFFLOAD_MIN_BATCH = 32  # ggml-cuda's and ggml-vulkan's default for GGML_OP_OFFLOAD_MIN_BATCH
ALL_LAYERS = 99  # -ngl 99: every layer's non-expert weights on the device
DEVICE_MARGIN_BYTES = 1 << 30  # KV cache, compute buffers and the driver's own, per server
TRACE_ENV = ROUTE_TRACE_ENV

# -- the configurations ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """A placement. `base` (a-e) decides the experts' place; a variant of a base adds llama.cpp's
    load mode (`none`: no mmap, host-resident weights in the device's pinned host buffer; `mmap`), or
    another expert-cache policy."""

    key: str
    name: str
    what: str
    base: str = ""
    load_mode: str | None = None  # --load-mode; None: the server's default (the engine chooses)
    policy: str | None = None  # --moe-cache-policy (e only); None: the project's default
    args: tuple[str, ...] = ()  # more llama-server arguments
    env: tuple[tuple[str, str], ...] = ()  # more environment
    auto: bool = False  # e only: --moe-cache-bytes auto:<the budget>, whole layers and the cache split by the engine

    def __post_init__(self) -> None:
        if not self.base:
            object.__setattr__(self, "base", self.key)

    @property
    def stock(self) -> bool:
        """What a llama.cpp user can configure without this project (b, c, d and their load modes)."""
        return self.base in ("b", "c", "d")


PINNED = "--load-mode none: no mmap, llama.cpp keeps host-resident weights in the pinned host buffer"
CONFIGS: dict[str, Config] = {
    c.key: c
    for c in (
        Config("a", "all-device", "-ngl 99: everything on the device"),
        Config("b", "cpu-moe", "-ngl 99 --cpu-moe: experts computed on the CPU"),
        Config("bp", "cpu-moe pinned", f"b with {PINNED}", "b", "none"),
        Config("c", "n-cpu-moe", "-ngl 99 --n-cpu-moe N: the last layers' experts on the device"),
        Config("cp", "n-cpu-moe pinned", f"c with {PINNED}", "c", "none"),
        Config("d", "copy-used", "-ngl 99 --cpu-moe, GGML_OP_OFFLOAD_MIN_BATCH=1: used experts copied each step"),
        Config("dp", "copy-used pinned", f"d with {PINNED}", "d", "none"),
        Config("e", "expert-cache", "-ngl 99 --cpu-moe --moe-cache-bytes (c's expert bytes): misses copied"),
        Config("ep", "expert-cache pinned", f"e with {PINNED} (forced)", "e", "none"),
        Config("em", "expert-cache mmap", "e with --load-mode mmap (forced): misses from the mapping", "e", "mmap"),
        Config("el", "expert-cache lru", "e with --moe-cache-policy lru", "e", None, "lru"),
        Config(
            "ea",
            "expert-cache auto",
            "e with --moe-cache-bytes auto:(the same bytes): the engine splits them between whole layers on the "
            "device and the cache (patch 0016; compose's default)",
            "e",
            auto=True,
        ),
        Config(
            "eh",
            "expert-cache prompt not ahead",
            "e with --moe-cache-prompt-ahead off: each prompt tensor's misses copied before it computes, the two "
            "buffers of the copies ahead (patch 0017) back in the cache's slots",
            "e",
            args=("--moe-cache-prompt-ahead", "off"),
        ),
        Config(
            "ed",
            "expert-cache mmap direct",
            "em without the staging ring: misses copied from the mapping by the driver",
            "e",
            "mmap",
            args=("--moe-cache-staging", "off"),
        ),
        Config(
            "en",
            "expert-cache one queue",
            "e with the prefetch's copies on the compute queue (--no-moe-cache-copy-stream): what the "
            "second stream's overlap gains",
            "e",
            env=(("LLAMA_ARG_MOE_CACHE_COPY_STREAM", "0"),),
        ),
        Config(
            "eo",
            "expert-cache misses copied",
            "e with --moe-cache-cpu-misses off: every miss copied before the device computes it (0013-0014 alone)",
            "e",
            args=("--moe-cache-cpu-misses", "off"),
        ),
        Config(
            "ec",
            "expert-cache misses on the CPU",
            "e with --moe-cache-cpu-misses on: every decode miss on the CPU while the device computes the hits",
            "e",
            args=("--moe-cache-cpu-misses", "on"),
        ),
        Config(
            "ecm",
            "expert-cache mmap, misses on the CPU",
            "em with --moe-cache-cpu-misses on: a mapped model's decode misses read by the CPU instead of copied",
            "e",
            "mmap",
            args=("--moe-cache-cpu-misses", "on"),
        ),
        Config(
            "er",
            "expert-cache pinned refused",
            "ep with pinned memory refused (GGML_CUDA_NO_PINNED=1): the fallback, and its one line",
            "e",
            "none",
            env=(("GGML_CUDA_NO_PINNED", "1"),),
        ),
    )
}
NOT_BUILT = "not in this binary: its build has no expert cache (the series' NNNN-expert-cache.patch)"
# by name, not number: the series is renumbered when it is reordered (docs/llama-fork.md)
CACHE_PATCH_SUFFIX = "-expert-cache.patch"


def parse_configs(text: str) -> list[Config]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CONFIGS]
    if unknown or not keys:
        known = ", ".join(f"{c.key} ({c.name})" for c in CONFIGS.values())
        raise BenchError(f"unknown config {', '.join(unknown) or '(none given)'}; known: {known}")
    if "b" not in keys:
        raise BenchError("--configs must include b: the ratios are against stock --cpu-moe")
    return [CONFIGS[k] for k in dict.fromkeys(keys)]


def parse_concurrent(text: str, n: int) -> list[Config]:
    """The configs measured again with `-np n` concurrent requests, each on a server of its own
    (keyed `<key>-np<n>`), so that the single-request rows keep `-np 1`."""
    keys = [k.strip() for k in text.split(",") if k.strip()]
    if n < 2 or not keys:
        return []
    unknown = [k for k in keys if k not in CONFIGS]
    if unknown:
        raise BenchError(f"--concurrent-configs: unknown config {', '.join(unknown)}")
    return [
        Config(
            f"{c.key}-np{n}", f"{c.name} -np {n}", f"{c.what}; -np {n}", c.base, c.load_mode, c.policy, c.args, c.env
        )
        for c in (CONFIGS[k] for k in dict.fromkeys(keys))
    ]


# -- the model's expert bytes and the choice of N --------------------------------------------------


@dataclass(frozen=True)
class ExpertLayout:
    """What the benchmark needs of the GGUF: per MoE layer the bytes of one expert (gate+up+down)."""

    n_layer: int
    n_expert: int
    n_expert_used: int
    expert_bytes: dict[int, int]  # MoE layer -> bytes of one expert
    other_bytes: int  # every tensor that is not a routed expert
    file_bytes: int

    @classmethod
    def from_index(cls, index: ExpertIndex) -> ExpertLayout:
        return cls(
            n_layer=index.n_layer,
            n_expert=index.n_expert,
            n_expert_used=index.n_expert_used,
            expert_bytes={layer: index.expert_bytes(layer) for layer in index.moe_layers},
            other_bytes=index.other_bytes,
            file_bytes=sum(index.file_sizes),
        )

    def layer_bytes(self, layer: int) -> int:
        """All the routed experts of one layer (0 for a dense layer)."""
        return self.expert_bytes.get(layer, 0) * self.n_expert

    @property
    def routed_bytes(self) -> int:
        return sum(self.layer_bytes(layer) for layer in self.expert_bytes)


def choose_n_cpu_moe(layout: ExpertLayout, cache_bytes: int) -> tuple[int, int]:
    """(N, device expert bytes): the smallest N for which `--n-cpu-moe N` keeps at most `cache_bytes`
    of routed experts on the device.

    --n-cpu-moe N keeps the experts of layers 0..N-1 in host memory, so the device holds those of
    layers N..n_layer-1: walk down from the last layer while the next layer's experts still fit.
    N = n_layer is --cpu-moe; N = 0 puts every expert on the device.
    """
    if cache_bytes < 0:
        raise BenchError(f"--cache-bytes must be at least 0, not {cache_bytes}")
    n, used = layout.n_layer, 0
    for layer in reversed(range(layout.n_layer)):
        cost = layout.layer_bytes(layer)
        if used + cost > cache_bytes:
            break
        used += cost
        n = layer
    return n, used


def host_expert_layers(config: Config, layout: ExpertLayout, n_cpu_moe: int) -> list[int]:
    """The MoE layers whose experts live in host memory under `config`."""
    if config.base in ("b", "d", "e"):
        return sorted(layout.expert_bytes)
    if config.base == "c":
        return [layer for layer in sorted(layout.expert_bytes) if layer < n_cpu_moe]
    return []


AUTO_LINE = re.compile(r"expert cache auto: (?:(\d+) of (\d+) MoE layers on the device|every expert fits)")


def auto_host_layers(log: str, moe_layers: list[int]) -> list[int]:
    """The MoE layers `--moe-cache-bytes auto` left in host memory, from its log line: the first ones, as
    --n-cpu-moe leaves them (none when every expert fits)."""
    found = AUTO_LINE.search(log)
    if not found:
        raise BenchError("--moe-cache-bytes auto logged no choice (a build without patch 0016?)")
    if found[1] is None:
        return []
    return moe_layers[: int(found[2]) - int(found[1])]


def parse_bytes(text: str, routed_bytes: int) -> int:
    """`4GiB`, `512M`, `4000000000` or `50%` (of the model's routed expert bytes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%|[kKmMgGtT]i?[bB]?|[bB])?\s*", text)
    if not m:
        raise BenchError(f"--cache-bytes {text!r} is not a size (e.g. 4GiB, 512M, 50%)")
    value, unit = float(m[1]), (m[2] or "").lower().rstrip("b")
    if unit == "%":
        return int(routed_bytes * value / 100)
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30}
    if unit not in scale:
        raise BenchError(f"--cache-bytes {text!r}: unknown unit")
    return int(value * scale[unit])


# -- host→device bytes derived from the routing telemetry -----------------------------------------

Counts = dict[int, dict[int, int]]  # layer -> expert -> activations


def merge_domains(routing: Mapping) -> Counts:
    """GET /moe/routing's `domains: {tag: {layer: {expert: count}}}` summed over the tags."""
    merged: Counts = {}
    for layers in routing.get("domains", {}).values():
        for layer, experts in layers.items():
            row = merged.setdefault(int(layer), {})
            for expert, count in experts.items():
                row[int(expert)] = row.get(int(expert), 0) + int(count)
    return merged


def prompt_step_bytes(
    counts: Counts, host_layers: list[int], expert_bytes: Mapping[int, int], n_expert_used: int, min_batch: int
) -> int:
    """Expert bytes copied host→device for one micro-batch (a prompt that fits in one).

    A layer's matrix product is offloaded only when its batch, the rows of the micro-batch at that
    layer (sum of counts / top-k; the last layer sees only the output rows), reaches `min_batch`;
    then each distinct expert the micro-batch used is copied once.
    """
    total = 0
    for layer in host_layers:
        row = counts.get(layer, {})
        rows = sum(row.values()) / n_expert_used
        if rows >= min_batch:
            total += sum(1 for c in row.values() if c > 0) * expert_bytes[layer]
    return total


def decode_bytes(counts: Counts, host_layers: list[int], expert_bytes: Mapping[int, int], min_batch: int) -> int:
    """Expert bytes copied host→device over single-token steps: each step's top-k experts are
    distinct, so every activation is one copy, when a batch of one reaches `min_batch`."""
    if min_batch > 1:
        return 0
    return sum(sum(counts.get(layer, {}).values()) * expert_bytes[layer] for layer in host_layers)


# -- device memory ----------------------------------------------------------------------------------


def device_free_bytes(backend: str) -> int | None:
    """Free memory of the device the servers will use: the GPU's (nvidia-smi) for CUDA; host memory
    for Vulkan, whose llvmpipe device allocates from it (a real Vulkan GPU is not checked); None for
    the CPU backend, which has no device."""
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
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
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
    """CUDA0, Vulkan0: device memory. CPU, CPU_Mapped, CUDA_Host (pinned host memory): not."""
    return re.fullmatch(r"(CUDA|Vulkan|ROCm|SYCL|Metal)\d+|RPC\d+\[[^\]]*\]", name) is not None


# -- the servers ----------------------------------------------------------------------------------


@dataclass
class Server:
    config: Config
    url: str
    log_path: Path
    n_cpu_moe: int | None
    host_layers: list[int]
    min_batch: int
    device_expert_bytes: int
    env: dict[str, str]
    args: list[str]
    prompt_tps: list[float] = field(default_factory=list)
    decode_tps: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    decode_tokens: list[int] = field(default_factory=list)
    prompt_h2d: list[int] = field(default_factory=list)  # derived expert bytes per prompt step
    decode_h2d: list[int] = field(default_factory=list)  # derived expert bytes per decode request
    decode_steps: list[int] = field(default_factory=list)  # graph evaluations of the decode request
    reevaluated: list[int] = field(default_factory=list)  # prompt tokens the decode request evaluated (1)
    # the expert cache's own counters (e only), per decode request: measured, not derived
    decode_cache: list[dict[str, int]] = field(default_factory=list)
    final_cache: dict[str, int] = field(default_factory=dict)  # e only: every counter at the end
    sent: int = 0  # requests sent (the trace sequence the next one replays)
    start_seconds: float | None = None
    concurrent: dict | None = None  # -np N servers only: concurrent_run's figures
    lock: threading.Lock = field(default_factory=threading.Lock)  # next_domain from several threads


def cache_patch_present(binary: Path) -> bool:
    """Whether `binary` has the expert cache."""
    return built_with_patch(binary, lambda p: p.name[4:] == CACHE_PATCH_SUFFIX)


def server_plan(
    config: Config, n_cpu_moe: int, args: argparse.Namespace
) -> tuple[list[str], dict[str, str], int | None, int]:
    """(extra llama-server arguments, extra environment, --n-cpu-moe, offload minimum) of a config."""
    # -lv 4: libllama's info lines (its buffer sizes: the device memory each server holds) reach the log
    extra = ["--ubatch-size", str(args.ubatch), "-lv", "4"]
    env: dict[str, str] = {}
    if args.backend == "vulkan":
        # ggml-vulkan skips CPU-type devices (llvmpipe) unless they are listed
        env["GGML_VK_VISIBLE_DEVICES"] = os.environ.get("GGML_VK_VISIBLE_DEVICES", "0")
    if args.trace_file:
        env[TRACE_ENV] = str(args.trace_file)
        if concurrency(config) > 1 and getattr(args, "concurrent_trace", None):
            env[TRACE_ENV] = str(args.concurrent_trace)
    if getattr(args, "seq_tags", None):
        env["LLAMA_ARG_MOE_DOMAINS"] = ",".join(sorted(set(args.seq_tags)))
    min_batch = int(os.environ.get("GGML_OP_OFFLOAD_MIN_BATCH", DEFAULT_OFFLOAD_MIN_BATCH))
    n: int | None = None
    if config.base in ("b", "d", "e"):
        extra.append("--cpu-moe")
    if config.base == "c":
        n = n_cpu_moe
    if config.base == "d":
        min_batch = 1
    if config.load_mode:
        extra += ["--load-mode", config.load_mode]
    extra += list(config.args)
    env.update(dict(config.env))
    if config.base == "e" and getattr(args, "cache_log_dir", None):
        # what the replay below checks the counters against, one log per cache server
        env["LLAMA_ARG_MOE_CACHE_LOG"] = str(args.cache_log_dir / f"{config.key}-access.log")
    env["GGML_OP_OFFLOAD_MIN_BATCH"] = str(min_batch)
    return extra, env, n, min_batch


def concurrency(config: Config) -> int:
    """-np of a config's server: N for the `<key>-npN` servers of --concurrent, else 1."""
    m = re.search(r"-np(\d+)$", config.key)
    return int(m[1]) if m else 1


def start_server(
    supervisor: Supervisor,
    binary: Path,
    model: Path,
    config: Config,
    layout: ExpertLayout,
    n_cpu_moe: int,
    device_expert_bytes: int,
    args: argparse.Namespace,
    token: str,
) -> Server:
    extra, env, n, min_batch = server_plan(config, n_cpu_moe, args)
    if args.backend == "rpc":
        # the RPC build is a CPU build: --no-repack, as the engine's tests give it (repacked host experts cannot
        # be copied to a device)
        device = start_rpc_device(supervisor, binary, f"{config.key}-rpc", args.rpc_threads)
        extra = ["--rpc", device, "--no-repack", *extra]
    parallel = concurrency(config)
    settings = LlamaSettings(
        port=free_port(),
        parallel=parallel,
        ctx_size=args.ctx * parallel,  # every slot the context of the -np 1 servers
        threads=args.threads,
        telemetry=True,
        admin_token=token,
        gpu_layers=ALL_LAYERS,
        n_cpu_moe=n,
        extra_args=" ".join(extra),
        expert_cache_bytes=(("auto:" if config.auto else "") + str(getattr(args, "e_bytes", 0) or device_expert_bytes))
        if config.base == "e"
        else "",
    )
    if config.base == "e":
        settings.expert_cache_policy = config.policy or "default"
    if "cpu_repack" in LlamaSettings.model_fields:  # the settings decide --no-repack themselves
        settings.cpu_repack = not args.no_repack
    spec = llama_service_spec(
        f"{config.key}-{config.name}", binary, model, settings, start_timeout_s=args.start_timeout
    )
    spec.env.update(env)
    if args.no_repack and "--no-repack" not in spec.argv:
        spec.argv.append("--no-repack")
    running = supervisor.start(spec)
    host_layers = host_expert_layers(config, layout, n_cpu_moe)
    if config.auto:
        host_layers = auto_host_layers(running.log_path.read_text(errors="replace"), host_layers)
    return Server(
        config=config,
        url=running.spec.url,
        log_path=running.log_path,
        n_cpu_moe=n,
        host_layers=host_layers,
        min_batch=min_batch,
        device_expert_bytes={
            "a": layout.routed_bytes,
            "c": device_expert_bytes,
            "e": getattr(args, "e_bytes", 0) or device_expert_bytes,
        }.get(config.base, 0),
        env=env,
        args=spec.argv[1:],
    )


# -- one run --------------------------------------------------------------------------------------


def complete(
    client: httpx.Client, url: str, prompt: str, n_predict: int, cache_prompt: bool, domain: str | None = None
) -> dict:
    body = {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0,
        "cache_prompt": cache_prompt,
        "ignore_eos": True,
    }
    headers = {"X-MoE-Domain": domain} if domain else None
    return client.post(f"{url}/completion", json=body, headers=headers).raise_for_status().json()["timings"]


def next_domain(s: Server, args: argparse.Namespace) -> str | None:
    """The domain tag of the server's next request: the ESFT task of the trace sequence it replays
    (request r replays sequence r), with --domains esft; else none."""
    tags = getattr(args, "concurrent_tags", None) if concurrency(s.config) > 1 else None
    tags = tags or getattr(args, "seq_tags", None)
    with s.lock:
        s.sent += 1
        r = s.sent - 1
    return tags[r % len(tags)] if tags else None


def pull_counts(client: httpx.Client, url: str, token: str) -> Counts:
    resp = client.get(f"{url}/moe/routing", params={"reset": "1"}, headers={ADMIN_TOKEN_HEADER: token})
    return merge_domains(resp.raise_for_status().json())


CACHE_COUNTERS = ("accesses", "hits", "loads", "h2d_bytes", "bypass", "bypass_bytes")


def moe_cache_metrics(client: httpx.Client, url: str) -> dict[str, int]:
    """Every llamacpp:moe_cache_* value of /metrics, by name without the prefix (e.g. hits_total, slots)."""
    samples = parse_metrics(client.get(f"{url}/metrics").raise_for_status().text)
    prefix = "llamacpp:moe_cache_"
    cache = {name: values for name, values in samples.items() if name.startswith(prefix)}
    return {name[len(prefix) :]: int(sum(v for _, v in values)) for name, values in cache.items()}


def cache_counters(client: httpx.Client, url: str) -> dict[str, int]:
    """The expert cache's counters from /metrics (llamacpp:moe_cache_<name>_total)."""
    found = moe_cache_metrics(client, url)
    missing = [name for name in CACHE_COUNTERS if f"{name}_total" not in found]
    if missing:
        raise BenchError(f"/metrics of {url} lacks the expert cache's counters {missing}: is the cache on?")
    return {name: found[f"{name}_total"] for name in CACHE_COUNTERS}


def counters_delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in CACHE_COUNTERS}


def push_profile(url: str, body: dict, token: str) -> None:
    resp = httpx.post(f"{url}/moe/cache/profile", json=body, headers={ADMIN_TOKEN_HEADER: token}, timeout=60)
    if resp.status_code != 200:
        raise BenchError(f"POST /moe/cache/profile: {resp.status_code} {resp.text[:300]}")


def held_out_profile(
    trace_file: Path, n_requests: int, n_expert: int, seq_tags: list[str] | None, exclude: frozenset[int] = frozenset()
) -> tuple[list[dict], object, str]:
    """The tables of the trace's sequences that no request of this run replays (request r replays
    sequence r; `exclude`: those the -np N servers replay): the transitions of them all as the profile
    of no domain and, with `seq_tags` (each sequence's domain), each domain's prior and transitions.
    (POST bodies, decoded tables for the replay, a note.)"""
    from moe_l2_cache.policy.profile import fit_profile
    from moe_l2_cache.policy.replay import DomainTables
    from moe_l2_contracts.schemas.llama import ExpertCacheProfile, decode_f32
    from moe_l2_llama.route_trace import read_route_trace

    trace = read_route_trace(trace_file)
    if trace.n_seq <= n_requests:
        raise BenchError(f"the trace has {trace.n_seq} sequences, the run replays {n_requests}: none left to fit on")
    fit = [q for q in range(n_requests, trace.n_seq) if q not in exclude]
    ids = np.concatenate([trace.sequence(q) for q in fit])
    lengths = np.diff(trace.offsets)[fit]
    labels = np.repeat([seq_tags[q] for q in fit], lengths) if seq_tags else np.full(len(ids), "all")
    fitted = fit_profile(ids, list(labels), n_expert)
    bodies = [ExpertCacheProfile.from_tables(None, transitions=fitted.transitions)]
    if seq_tags:
        for tag in sorted(fitted.domain_freq):
            freq, trans = fitted.domain_freq[tag], fitted.domain_transitions[tag]
            bodies.append(ExpertCacheProfile.from_tables(tag, freq=freq, transitions=trans))
    freq_shape, trans_shape = (trace.n_layer, n_expert), (trace.n_layer - 1, n_expert, n_expert)
    tables = {
        b.domain: DomainTables(freq=decode_f32(b.freq, freq_shape), transitions=decode_f32(b.transitions, trans_shape))
        for b in bodies
    }
    note = (
        f"tables fitted on the trace's sequences {n_requests}..{trace.n_seq - 1}"
        + (f" less the {len(exclude)} the -np servers replay" if exclude else "")
        + f" ({len(ids)} tokens), none of which this run replays; "
        + (
            "requests tagged with their sequence's ESFT task: per-domain priors and transitions"
            if seq_tags
            else "requests untagged (no domain prior)"
        )
    )
    return [b.model_dump() for b in bodies], tables, note


def keep_access_log(log_file: Path, out: Path, key: str) -> Path:
    """An access log whose replay differs from the engine's counters, xz-compressed next to the JSON
    (`<json stem>-<key>-access.log.xz`), so that what comes back from a GPU machine holds what it takes
    to find the difference (the CUDA runs of 2026-12-04 differed by a hit and a few prefetches, and
    their logs stayed on the machine)."""
    kept = out.parent / f"{out.stem}-{key}-access.log.xz"
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_bytes(lzma.compress(log_file.read_bytes()))
    return kept


def replay_check(s: Server, args: argparse.Namespace, layout: ExpertLayout) -> dict:
    """The Python policy's replay of e's access log, with the same profile, against e's counters."""
    from moe_l2_cache.policy.replay import read_access_log, replay_accesses

    engine = s.final_cache
    replay = replay_accesses(
        read_access_log(Path(s.env["LLAMA_ARG_MOE_CACHE_LOG"])),
        s.config.policy or "default",
        len(layout.expert_bytes),
        layout.n_expert,
        engine["slots"],
        layout.n_expert_used,
        args.profile_tables,
    )
    pairs = {
        "accesses": (replay.accesses, engine.get("accesses_total")),
        "hits": (replay.hits, engine.get("hits_total")),
        "loads": (replay.loads, engine.get("loads_total")),
        "prefetch": (replay.prefetch, engine.get("prefetch_total")),
        "prefetch_used": (replay.prefetch_used, engine.get("prefetch_used_total")),
    }
    return {
        "slots": engine["slots"],
        "replay": {k: r for k, (r, _) in pairs.items()},
        "engine": {k: e for k, (_, e) in pairs.items()},
        "equal": all(r == e for r, e in pairs.values()),
        "hit_rate_all_accesses": replay.hit_rate,
    }


def one_run(client: httpx.Client, s: Server, prompt: str, layout: ExpertLayout, args: argparse.Namespace) -> None:
    """The prompt alone, then the same prompt from the cache and --tokens decode steps; each followed
    by a reset pull, so each pull holds one request's routing."""
    pull_counts(client, s.url, args.token)  # drop anything before (a warm-up)
    cached = s.config.base == "e"
    before = cache_counters(client, s.url) if cached else {}
    t = complete(client, s.url, prompt, 1, cache_prompt=False, domain=next_domain(s, args))
    prompt_counts = pull_counts(client, s.url, args.token)
    if t["prompt_n"] > args.ubatch:
        raise BenchError(
            f"a prompt of {t['prompt_n']} tokens is more than one micro-batch (--ubatch {args.ubatch}): "
            "the bytes derivation needs one step per prompt; use a shorter --prompt-words"
        )
    s.prompt_tps.append(t["prompt_per_second"])
    s.prompt_tokens.append(t["prompt_n"])
    if cached:
        after = cache_counters(client, s.url)
        delta = counters_delta(after, before)
        s.prompt_h2d.append(delta["h2d_bytes"] + delta["bypass_bytes"])
        before = after
    else:
        s.prompt_h2d.append(
            prompt_step_bytes(prompt_counts, s.host_layers, layout.expert_bytes, layout.n_expert_used, s.min_batch)
        )

    t = complete(client, s.url, prompt, args.tokens, cache_prompt=True, domain=next_domain(s, args))
    counts = pull_counts(client, s.url, args.token)
    if t["prompt_n"] > 1:
        # the slot lost the prompt: that step had many rows and the decode derivation counts it wrong
        print(f"  warning: {s.config.key} re-evaluated {t['prompt_n']} prompt tokens", file=sys.stderr, flush=True)
    s.reevaluated.append(t["prompt_n"])
    s.decode_tps.append(t["predicted_per_second"])
    s.decode_tokens.append(t["predicted_n"])
    first_moe = min(layout.expert_bytes)
    s.decode_steps.append(round(sum(counts.get(first_moe, {}).values()) / layout.n_expert_used))
    if cached:
        delta = counters_delta(cache_counters(client, s.url), before)
        s.decode_cache.append(delta)
        s.decode_h2d.append(delta["h2d_bytes"] + delta["bypass_bytes"])
    else:
        s.decode_h2d.append(decode_bytes(counts, s.host_layers, layout.expert_bytes, s.min_batch))


def trim_to_complete_runs(servers: list[Server]) -> None:
    """Keep the runs that every server finished, so that the paired ratios stay paired."""
    n = min(len(s.decode_h2d) for s in servers)
    for s in servers:
        for name in ("prompt_tps", "decode_tps", "prompt_tokens", "decode_tokens", "prompt_h2d", "decode_h2d"):
            setattr(s, name, getattr(s, name)[:n])
        s.decode_steps, s.reevaluated = s.decode_steps[:n], s.reevaluated[:n]
        s.decode_cache = s.decode_cache[:n]


# -- results --------------------------------------------------------------------------------------


def summarize(s: Server, base: Server, log_text: str) -> dict:
    buffers = buffer_sizes(log_text)
    device = {name: sum(kinds.values()) for name, kinds in buffers.items() if is_device_buffer(name)}
    prompt_per_token = [b / n for b, n in zip(s.prompt_h2d, s.prompt_tokens, strict=True) if n]
    decode_per_token = [b / n for b, n in zip(s.decode_h2d, s.decode_steps, strict=True) if n]
    cache = None
    if s.decode_cache:
        total = {k: sum(d[k] for d in s.decode_cache) for k in CACHE_COUNTERS}
        cache = {
            "decode_hit_rate": total["hits"] / total["accesses"] if total["accesses"] else None,
            "decode_totals": total,
            "h2d_bytes": "measured: the cache's own counters (loads and bypassed copies), not derived",
        }
    return {
        "config": s.config.name,
        "what": s.config.what,
        "status": "measured",
        "base": s.config.base,
        "load_mode": s.config.load_mode,
        "policy": s.config.policy,
        "host_experts_log": host_experts_line(log_text),
        "prompt_ahead_log": prompt_ahead_line(log_text),
        "start_seconds": s.start_seconds,
        "concurrent": s.concurrent,
        "expert_cache": cache,
        "server_args": s.args,
        "env": s.env,
        "n_cpu_moe": s.n_cpu_moe,
        "host_expert_layers": s.host_layers,
        "offload_min_batch": s.min_batch,
        "device_expert_bytes": s.device_expert_bytes,
        "device_buffers_bytes": device,
        "device_memory_bytes": sum(device.values()) if device else None,
        "buffers": buffers,
        "prompt_tokens_per_s": median(s.prompt_tps),
        "decode_tokens_per_s": median(s.decode_tps),
        "prompt_ratio_vs_b": paired_ratio(s.prompt_tps, base.prompt_tps),
        "decode_ratio_vs_b": paired_ratio(s.decode_tps, base.decode_tps),
        "h2d_expert_bytes_per_token_derived": {
            "prompt": median(prompt_per_token),
            "decode": median(decode_per_token),
        },
        "runs": {
            "prompt_tokens_per_s": s.prompt_tps,
            "decode_tokens_per_s": s.decode_tps,
            "prompt_tokens": s.prompt_tokens,
            "decode_tokens": s.decode_tokens,
            "decode_steps": s.decode_steps,
            "decode_request_prompt_tokens": s.reevaluated,
            "prompt_h2d_expert_bytes_derived": s.prompt_h2d,
            "decode_h2d_expert_bytes_derived": s.decode_h2d,
            "decode_expert_cache": s.decode_cache,
        },
    }


# -- against the best stock placement, and the cost model's constants -------------------------------

HOST_EXPERTS_LOG = "expert cache: host experts"  # the engine's one line saying where it keeps the experts
MISSES_FROM_LOG = "expert cache: misses are copied from"  # the cache's line: pinned, or pageable and why
PROMPT_AHEAD_LOG = "a prompt's misses copied one expert tensor ahead"  # patch 0017 on
NO_PROMPT_AHEAD_LOG = "no copies one tensor ahead for prompts"  # patch 0017 off, and why


def prompt_ahead_line(log_text: str) -> str | None:
    """The engine's line saying whether a prompt's copies run one expert tensor ahead (patch 0017), and why
    not, if any."""
    found = [line.strip() for line in log_text.splitlines() if PROMPT_AHEAD_LOG in line or NO_PROMPT_AHEAD_LOG in line]
    return " | ".join(found) or None


def host_experts_line(log_text: str) -> str | None:
    """The engine's lines naming its choice of host memory for the experts (pinned or mapped) and where
    the cache's misses come from (pinned, or pageable: mapped or refused; through the ring or not),
    joined by " | ", if any."""
    found = [line.strip() for line in log_text.splitlines() if HOST_EXPERTS_LOG in line or MISSES_FROM_LOG in line]
    return " | ".join(found) or None


def derived_constants(rows: Mapping[str, dict], layout: ExpertLayout) -> dict:
    """Constants of the cost model (issue 32) that the runs themselves measure.

    CPU expert GB/s: a decode step of b (--cpu-moe) reads top-k experts per MoE layer from host memory
    on the CPU threads; bytes per token / seconds per token. `raw` divides by the whole step, `net`
    by the step less a's (all on the device: the non-expert work b's step also does on the GPU), which
    bounds the CPU's share from above: a's step also holds the experts' own GPU time.
    GPU time per token: a's decode step; per activated expert, that step over the activations, an
    upper bound (it holds the attention and the rest too).
    """
    per_token = sum(layout.expert_bytes.values()) * layout.n_expert_used  # every MoE layer's top-k experts
    activations = len(layout.expert_bytes) * layout.n_expert_used
    out: dict = {"expert_bytes_read_per_token": per_token, "activations_per_token": activations}
    a = (rows.get("a") or {}).get("decode_tokens_per_s")
    if a:
        out["gpu_ms_per_token"] = 1e3 / a
        out["gpu_ms_per_activation_upper_bound"] = 1e3 / a / activations
    for key in ("b", "bp"):
        tps = (rows.get(key) or {}).get("decode_tokens_per_s")
        if not tps:
            continue
        step = 1 / tps
        entry = {"raw_gbps": per_token / step / 1e9, "step_ms": step * 1e3}
        if a and step > 1 / a:
            entry["net_of_a_gbps"] = per_token / (step - 1 / a) / 1e9
        out[f"cpu_expert_{key}"] = entry
    return out


def load_constants(args: argparse.Namespace) -> dict | str | None:
    """--constants: a JSON file of bench/gpu_facts.py, `measure` (run it now, before any server holds
    the device), or `none`."""
    if args.constants == "none":
        return None
    if args.constants == "measure":
        from gpu_facts import DS_V2_LITE_EXPERT_BYTES, constants

        return constants(DS_V2_LITE_EXPERT_BYTES)
    path = Path(args.constants)
    if not path.is_file():
        raise BenchError(f"--constants {path} does not exist")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise BenchError(f"--constants {path} is not JSON: {exc}") from exc


# Run in a child process, so that no CUDA context stays in the bench's (it would hold device memory the
# fit check does not count). Standard library, numpy and torch; prints one JSON object.
MAPPED_H2D_SCRIPT = """
import json, sys, time
import numpy as np
path, size = sys.argv[1], int(sys.argv[2])
try:
    import torch
except ImportError as exc:
    print(json.dumps({"skipped": f"torch does not import: {exc}"})); sys.exit()
if not torch.cuda.is_available():
    print(json.dumps({"skipped": "torch sees no CUDA device"})); sys.exit()
m = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: writable for torch, pages still the mapping's
n = min(size, m.size)
src = torch.from_numpy(m[m.size - n:])  # the file's end: expert tensors, as llama.cpp maps them
dst = torch.empty(n, dtype=torch.uint8, device="cuda")
dst.copy_(src); torch.cuda.synchronize()  # the first copy faults the pages in
times = []
for _ in range(3):
    t0 = time.perf_counter(); dst.copy_(src); torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
times.sort()
print(json.dumps({"mapped_512MiB_gbps": round(n / times[1] / 1e9, 2), "bytes": n, "ms": round(times[1] * 1e3, 2)}))
"""


def mapped_h2d(model: Path, size: int = 512 << 20, timeout_s: float = 120.0) -> dict:
    """Host->device GB/s from the mapped model file itself (torch, in a child process): the rate a miss of a
    mapped model is copied at. On the H200 of 2026-12-04 the mapped rows copied at about 0.85x torch's
    pageable rate (an anonymous buffer: bench/placement_model.py's MAPPED_FACTOR), so it is measured, not
    assumed. {"skipped": why} without torch or a CUDA device."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", MAPPED_H2D_SCRIPT, str(model), str(size)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"skipped": f"the measurement did not finish: {exc}"}
    lines = out.stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if lines else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        why = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"skipped": f"exit {out.returncode}: {why[:200]}"}
    return doc


# -- inputs ---------------------------------------------------------------------------------------


def resolve_model(args: argparse.Namespace, tmp: Path) -> tuple[Path, dict]:
    if args.model is not None:
        if not args.model.is_file():
            raise BenchError(f"--model {args.model} does not exist")
        return args.model, {"path": str(args.model), "generated": False}
    from moe_l2_gguf.model_shapes import DemoModelError, get_shape, write_shape_model

    try:
        shape = get_shape(args.shape)
        if not args.full:
            shape = shape.reduced(args.layers, args.vocab)
    except ValueError as exc:
        raise BenchError(str(exc)) from exc
    path = (args.model_dir or tmp) / f"{shape.name}-{shape.n_layer}l.gguf"
    print(f"writing the {shape.name} shape ({shape.n_layer} layers) to {path} ...", file=sys.stderr, flush=True)
    try:
        result = write_shape_model(path, shape, seed=0, progress=False)
    except DemoModelError as exc:
        raise BenchError(str(exc)) from exc
    info = {"path": str(path), "generated": True, "shape": shape.name, "layers": shape.n_layer}
    info |= {"vocab": shape.n_vocab, "write_seconds": round(result.seconds, 1)}
    return path, info


def resolve_trace(args: argparse.Namespace, binary: Path, layout: ExpertLayout, tmp: Path) -> tuple[Path | None, str]:
    """(the trace file or None, a note for the JSON and the table)."""
    if args.trace == "none":
        return None, "the model's own router (--trace none)"
    present = trace_patch_present(binary)
    if args.trace != "auto":
        path = Path(args.trace)
        if not path.is_file():
            raise BenchError(f"--trace {path} does not exist")
        if not present:
            raise BenchError(f"--trace given but {binary} was built without the {TRACE_ENV} patch")
        return path.resolve(), f"route trace {path.name} ({TRACE_ENV})"
    if not present:
        return None, f"the model's own (random) router: this llama-server lacks the {TRACE_ENV} patch"
    src = data_paths.esft_npz()
    if not src.is_file():
        return None, f"the model's own (random) router: no ESFT routing data at {src} (set MOE_L2_ROUTING_DATA)"
    out = tmp / "esft.trace"
    cmd = [sys.executable, "-m", "moe_l2_ops.cli", "make-route-trace", "--from", str(src), "--out", str(out)]
    cmd += ["--layers", str(len(layout.expert_bytes)), "--experts", str(layout.n_expert)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not out.is_file():
        why = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchError(f"cannot make the ESFT route trace ({why}); pass --trace FILE or --trace none")
    return out, f"ESFT route trace of DeepSeek-V2-Lite ({TRACE_ENV}, moe-l2 make-route-trace)"


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, default=os.environ.get("MOE_L2_BENCH_BACKEND", "vulkan"))
    parser.add_argument("--binary", type=Path, help="llama-server built with the patches for --backend")
    parser.add_argument("--cuda-arch", default="90", help="CMAKE_CUDA_ARCHITECTURES when building for cuda")
    parser.add_argument("--model", type=Path, help="a MoE GGUF (default: generate the --shape)")
    parser.add_argument("--shape", default="ds-v2-lite")
    parser.add_argument("--full", action="store_true", help="the whole shape (else --layers and --vocab reduce it)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--model-dir", type=Path, help="where to write the generated model (default: a temp dir)")
    parser.add_argument("--cache-bytes", default="50%", help="the expert cache's device budget: 4GiB, 512M, 50%%")
    parser.add_argument(
        "--configs",
        default="a,b,c,d,e",
        help="of " + ",".join(CONFIGS) + " (b is the baseline; p: pinned, m: mmap, l: lru)",
    )
    parser.add_argument("--trace", default="auto", help="a route trace file, auto (ESFT if the patch exists), none")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="decode tokens per run")
    parser.add_argument("--prompt-words", type=int, default=40, help="about 4 tokens each (the shapes' vocabulary)")
    parser.add_argument("--ubatch", type=int, default=512, help="llama-server --ubatch-size")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds for a server to load")
    parser.add_argument("--request-timeout", type=float, default=900.0, help="seconds for one request")
    parser.add_argument(
        "--repack",
        dest="no_repack",
        action="store_false",
        help="let llama.cpp repack CPU weights (default off on AMX CPUs, where it crashes on these models)",
    )
    parser.add_argument(
        "--no-repack",
        dest="force_no_repack",
        action="store_true",
        help="never repack the host's weights: the expert cache cannot read repacked experts (gpt-oss's MXFP4)",
    )
    parser.add_argument(
        "--cache-slots",
        type=int,
        help="e's budget as slots per cached layer (e.g. 16) instead of c's device expert bytes",
    )
    parser.add_argument(
        "--profile",
        choices=("auto", "none"),
        default="auto",
        help="auto: with the ESFT trace, push e the transitions of the sequences the run does not replay",
    )
    parser.add_argument(
        "--domains",
        choices=("esft", "none"),
        default="esft",
        help="esft: with the ESFT trace, tag each request with its sequence's task (e gets per-domain tables)",
    )
    parser.add_argument(
        "--concurrent", type=int, default=0, help="-np N: also measure N concurrent requests on own servers"
    )
    parser.add_argument(
        "--concurrent-configs",
        dest="concurrent_configs_text",
        default="cp,e",
        help="the configs --concurrent measures (default cp,e: the best stock at 50%% on the H200, the default)",
    )
    parser.add_argument(
        "--constants",
        default="none",
        help="the machine's constants for the JSON: a bench/gpu_facts.py constants FILE, measure, or none",
    )
    parser.add_argument("--gauges", action="store_true", help="read the NVML gauges against nvidia-smi once")
    parser.add_argument("--start-jobs", type=int, default=1, help="servers started at once")
    parser.add_argument("--rpc-threads", type=int, default=2, help="--backend rpc: each ggml-rpc-server's threads")
    parser.add_argument(
        "--device-margin-mib",
        type=int,
        default=DEVICE_MARGIN_BYTES >> 20,
        help="device memory per server beyond its weights, for the fit check (KV, compute, driver)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/expert_offload.json"))
    parser.add_argument("--log-dir", type=Path, help="the server logs (default: <out>-logs beside the JSON)")
    args = parser.parse_args(argv)
    if args.cache_slots is not None and args.cache_slots < 1:
        parser.error("--cache-slots must be at least 1")
    if args.no_repack:
        args.no_repack = cpu_has_amx()
    args.no_repack = args.no_repack or args.force_no_repack
    if args.runs < 1 or args.tokens < 2:
        parser.error("--runs must be at least 1 and --tokens at least 2")
    return args


# -- main -----------------------------------------------------------------------------------------


def start_all(
    supervisor: Supervisor,
    binary: Path,
    model: Path,
    layout: ExpertLayout,
    configs: list[Config],
    n_cpu_moe: int,
    device_expert_c: int,
    args: argparse.Namespace,
) -> dict[str, Server]:
    """Every config's server, `--start-jobs` at a time. Loading is most of a server's start (9.5 GB
    from the page cache, and with --load-mode none into freshly pinned memory), and loads of
    separate servers overlap well on a many-core host; the measurements start only when all are up."""

    def one(c: Config) -> Server:
        print(f"starting {c.key} ({c.name}) ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            s = start_server(supervisor, binary, model, c, layout, n_cpu_moe, device_expert_c, args, args.token)
        except SupervisorError as exc:
            raise BenchError(f"llama-server for {c.key} ({c.name}) did not start: {exc}".splitlines()[0]) from exc
        s.start_seconds = round(time.monotonic() - t0, 1)
        print(f"  {c.key} ready in {s.start_seconds:.0f}s", file=sys.stderr, flush=True)
        if c.base == "e":
            for body in getattr(args, "profile_bodies", None) or []:
                push_profile(s.url, body, args.token)
        return s

    wanted = [c for c in configs if c.base != "e" or cache_patch_present(binary)]
    jobs = max(1, getattr(args, "start_jobs", 1))
    if jobs == 1:
        started = [one(c) for c in wanted]
    else:
        pool = ThreadPoolExecutor(jobs)
        try:
            started = list(pool.map(one, wanted))  # the first failure is raised, in config order
        finally:
            # not waiting for the other starts: on a failure or SIGTERM the caller's supervisor.stop()
            # ends their servers, and their threads end with them (a wait would last the start timeout)
            pool.shutdown(wait=False, cancel_futures=True)
    return {s.config.key: s for s in started}


def measure(
    binary: Path,
    model: Path,
    layout: ExpertLayout,
    configs: list[Config],
    n_cpu_moe: int,
    device_expert_c: int,
    args: argparse.Namespace,
    logs: Path,
) -> tuple[dict[str, Server], dict[str, str]]:
    supervisor = Supervisor(logs)
    servers: dict[str, Server] = {}
    try:
        all_configs = configs + getattr(args, "concurrent_configs", [])
        servers = start_all(supervisor, binary, model, layout, all_configs, n_cpu_moe, device_expert_c, args)
        order = [s for s in servers.values() if concurrency(s.config) == 1]
        with httpx.Client(timeout=args.request_timeout) as client:
            try:
                for s in order:  # warm-up: every server the same requests, so a trace cursor stays aligned
                    print(f"  warm-up {s.config.key} ...", file=sys.stderr, flush=True)
                    warm = make_prompt(0, min(8, args.prompt_words))
                    complete(client, s.url, warm, 2, cache_prompt=False, domain=next_domain(s, args))
                for i in range(args.runs):
                    prompt = make_prompt(i, args.prompt_words)
                    for s in rotated(order, i):
                        one_run(client, s, prompt, layout, args)
                    done = ", ".join(f"{s.config.key} {s.decode_tps[-1]:.2f}" for s in order)
                    print(f"  run {i + 1}/{args.runs}: decode tok/s {done}", file=sys.stderr, flush=True)
                if getattr(args, "gauges", False):
                    args.gauges_read = read_gauges()
                for s in servers.values():
                    if concurrency(s.config) > 1:
                        s.concurrent = concurrent_run(s, args)
                        print(f"  {s.config.key}: {s.concurrent['summary']}", file=sys.stderr, flush=True)
            except httpx.HTTPError as exc:
                raise BenchError(f"a request failed: {exc!r} (see the server logs under {logs})") from exc
            except (Interrupted, KeyboardInterrupt):
                args.interrupted = True
                print("  interrupted: reporting the runs every server finished", file=sys.stderr, flush=True)
                trim_to_complete_runs(order)
            for s in order:
                if s.config.base == "e":
                    s.final_cache = moe_cache_metrics(client, s.url)
        logs_text = {k: s.log_path.read_text(errors="replace") for k, s in servers.items()}
    finally:
        supervisor.stop()
    return servers, logs_text


def read_gauges() -> dict:
    """bench/gpu_facts.py's read of the cache-manager's NVML gauges against nvidia-smi, while the
    servers hold their device memory."""
    from gpu_facts import gauges

    return gauges()


def concurrent_run(s: Server, args: argparse.Namespace) -> dict:
    """-np N: N requests at once, distinct prompts, each tagged with the domain of the trace sequence
    it replays (the r-th request assigned to a slot replays sequence r, so the tags follow the send
    order), --tokens decode tokens each, twice (the first fills the slots' caches of nothing: it is
    the warm-up). Aggregate decode tok/s = all decode tokens / the longest request's decode time
    (the slots decode in one batch); the wall figure divides by the whole round, prompts included."""
    n = concurrency(s.config)
    rounds = []
    with httpx.Client(timeout=args.request_timeout) as client, ThreadPoolExecutor(n) as pool:
        for r in range(2):
            prompts = [make_prompt(r * n + i, args.prompt_words) for i in range(n)]
            domains = [next_domain(s, args) for _ in range(n)]
            t0 = time.monotonic()
            futures = [
                pool.submit(complete, client, s.url, p, args.tokens, False, d)
                for p, d in zip(prompts, domains, strict=True)
            ]
            timings = [f.result() for f in futures]
            rounds.append({"wall_s": time.monotonic() - t0, "timings": timings, "domains": domains})
    return concurrent_summary(rounds[-1], n) | {"warm_up_round": concurrent_summary(rounds[0], n)}


def concurrent_summary(round_: dict, n: int) -> dict:
    """One round of N concurrent requests in figures (see concurrent_run)."""
    timings = round_["timings"]
    tokens = sum(t["predicted_n"] for t in timings)
    decode_s = max(t["predicted_ms"] for t in timings) / 1e3
    prompt_tokens = sum(t["prompt_n"] for t in timings)
    agg = tokens / decode_s if decode_s > 0 else None
    return {
        "requests": n,
        "domains": round_["domains"],
        "decode_tokens": tokens,
        "aggregate_decode_tokens_per_s": agg,
        "wall_tokens_per_s": tokens / round_["wall_s"] if round_["wall_s"] > 0 else None,
        "wall_s": round(round_["wall_s"], 3),
        "prompt_tokens": prompt_tokens,
        "per_request_decode_tokens_per_s": [t["predicted_per_second"] for t in timings],
        "summary": f"{n} concurrent: {tokens} decode tokens, aggregate {fmt_num(agg, '.1f')} tok/s",
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.token = secrets.token_hex(16)
    args.interrupted = False
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        configs = parse_configs(args.configs)
        args.concurrent_configs = parse_concurrent(args.concurrent_configs_text, args.concurrent)
        args.constants_doc = load_constants(args)
        # the route-trace hook replays a trace: a test build; with --trace none the serving build does
        binary = resolve_binary(args.binary, args.backend, test_hooks=args.trace != "none", cuda_arch=args.cuda_arch)
        with tempfile.TemporaryDirectory(prefix="expert-offload-") as tmp_name:
            tmp = Path(tmp_name)
            model, model_info = resolve_model(args, tmp)
            if isinstance(args.constants_doc, dict) and args.backend == "cuda":
                # before any server holds the device; bench/placement_model.py reads it for mapped rows
                args.constants_doc["h2d_mapped"] = mapped_h2d(model)
            try:
                layout = ExpertLayout.from_index(load_index(model))
            except GGUFIndexError as exc:
                raise BenchError(str(exc)) from exc
            cache_bytes = parse_bytes(args.cache_bytes, layout.routed_bytes)
            n_cpu_moe, device_expert_c = choose_n_cpu_moe(layout, cache_bytes)
            margin = args.device_margin_mib << 20
            everything = configs + args.concurrent_configs
            fitting, skipped = check_fits(everything, layout, device_expert_c, args.backend, margin)
            configs = [c for c in fitting if concurrency(c) == 1]
            args.concurrent_configs = [c for c in fitting if concurrency(c) > 1]
            args.trace_file, trace_note = resolve_trace(args, binary, layout, tmp)
            slot_bytes = max(layout.expert_bytes.values())
            args.e_bytes = args.cache_slots * slot_bytes * len(layout.expert_bytes) if args.cache_slots else 0
            if not args.e_bytes and device_expert_c == 0 and cache_bytes >= slot_bytes * len(layout.expert_bytes):
                # a budget under one layer's experts: c keeps none on the device, and e at c's bytes
                # would be off; e gets the budget itself, against the stock rows' 0 (a reduced model's
                # 25% and 12.5%, as in the rehearsal; the full ds-v2-lite's 12.5% is 3 whole layers)
                args.e_bytes = cache_bytes
            args.profile_bodies, args.profile_tables, profile_note = None, None, "none"
            esft = args.trace_file is not None and args.trace == "auto"
            args.seq_tags = esft_sequence_tasks(data_paths.esft_npz()) if esft and args.domains == "esft" else None
            replayed = 1 + 2 * args.runs  # the warm-up and two requests a run: sequences 0..2 runs
            concurrent_seqs: list[int] = []
            if args.concurrent_configs and args.trace_file is not None and args.seq_tags:
                # the trace's sequences come grouped by task (127 intent first): the -np servers get a
                # trace of their own, sequences taken round-robin over the tasks, so that every round
                # of N concurrent requests mixes domains
                concurrent_seqs = interleave_domains(args.seq_tags, replayed, 2 * args.concurrent)
                args.concurrent_trace = tmp / "concurrent.trace"
                args.concurrent_tags = subset_trace(
                    args.trace_file, concurrent_seqs, args.concurrent_trace, args.seq_tags
                )
            if args.profile == "auto" and esft:
                args.profile_bodies, args.profile_tables, profile_note = held_out_profile(
                    args.trace_file, replayed, layout.n_expert, args.seq_tags, frozenset(concurrent_seqs)
                )
            t0 = time.monotonic()
            # kept: a failed start or request points here
            log_dir = args.log_dir or args.out.parent / f"{args.out.stem}-logs"
            shutil.rmtree(log_dir, ignore_errors=True)
            log_dir.mkdir(parents=True)
            args.cache_log_dir = log_dir
            servers, logs = measure(binary, model, layout, configs, n_cpu_moe, device_expert_c, args, log_dir)
            seconds = time.monotonic() - t0
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Interrupted:
        print("error: interrupted (SIGTERM) before any run", file=sys.stderr)
        return 124

    rows: dict[str, dict] = {}
    for c in configs + args.concurrent_configs:
        key = c.key
        if key in servers and concurrency(c) > 1:
            s = servers[key]
            rows[key] = {"config": c.name, "what": c.what, "status": "measured", "base": c.base}
            rows[key] |= {"concurrent": s.concurrent, "server_args": s.args, "env": s.env}
            rows[key] |= {"host_experts_log": host_experts_line(logs[key]), "start_seconds": s.start_seconds}
            rows[key] |= {"prompt_ahead_log": prompt_ahead_line(logs[key])}
        elif key in servers:
            s = servers[key]
            rows[key] = summarize(s, servers["b"], logs[key])
            log_file = Path(s.env.get("LLAMA_ARG_MOE_CACHE_LOG", "/nonexistent"))
            if rows[key]["expert_cache"] and s.final_cache and log_file.is_file():
                check = replay_check(s, args, layout)
                if not check["equal"]:
                    check["access_log_kept"] = keep_access_log(log_file, args.out, key).name
                rows[key]["expert_cache"]["replay_check"] = check
                rows[key]["expert_cache"]["profile"] = profile_note
        elif key in skipped:
            rows[key] = {"config": c.name, "what": c.what, "status": skipped[key]}
        elif c.base == "e":
            rows[key] = {"config": c.name, "what": c.what, "status": NOT_BUILT, "device_expert_bytes": device_expert_c}
    versus = versus_best_stock(rows)
    device_note = {
        "vulkan": "Vulkan device (llvmpipe when no GPU: device memory is host memory, absolute speeds mean little)",
        "cuda": "CUDA device 0",
        "cpu": "no device: the CPU build runs every config on the CPU (checks the plumbing only)",
        "rpc": "ggml's RPC device: a ggml-rpc-server per llama-server, its CPU backend as the device (plumbing)",
    }[args.backend]
    results = {
        "benchmark": "expert_offload",
        "machine": machine(),
        "backend": args.backend,
        "device": device_note,
        "binary": str(binary),
        "model": model_info
        | {
            "n_layer": layout.n_layer,
            "n_expert": layout.n_expert,
            "n_expert_used": layout.n_expert_used,
            "expert_bytes_per_layer": {str(k): v for k, v in layout.expert_bytes.items()},
            "routed_bytes": layout.routed_bytes,
            "other_bytes": layout.other_bytes,
            "file_bytes": layout.file_bytes,
        },
        "cache_bytes": cache_bytes,
        "e_cache_bytes": args.e_bytes or device_expert_c,
        "n_cpu_moe": n_cpu_moe,
        "routing": trace_note,
        "no_repack": args.no_repack,
        "runs": args.runs,
        "runs_done": len(servers["b"].decode_tps),
        "interrupted": args.interrupted,
        "tokens": args.tokens,
        "prompt_words": args.prompt_words,
        "ubatch": args.ubatch,
        "threads": args.threads,
        "seconds": round(seconds, 1),
        "h2d_bytes_method": (
            "derived, not measured: per request, GET /moe/routing?reset=1 gives each layer's expert counts; "
            "a layer whose experts are in host memory is copied when its rows in the micro-batch reach the "
            "offload minimum (GGML_OP_OFFLOAD_MIN_BATCH); a prompt (one micro-batch) copies its distinct "
            "experts, a decode step (one row) each activation; times one expert's bytes from the GGUF; "
            "llama.cpp's padding (<= 512 B per run of consecutive experts) is left out; config e (the expert "
            "cache) is measured instead: its counters' loaded and bypassed bytes per request"
        ),
        "configs": rows,
        "vs_best_stock": versus,
        "constants": args.constants_doc,
        "derived_constants": derived_constants(rows, layout),
        "gpu_gauges": getattr(args, "gauges_read", None),
    }
    write_json(args.out, results)
    print(
        f"\n{args.backend}: {model_info.get('shape', model.name)}, {layout.n_layer} layers x {layout.n_expert} "
        f"experts, one expert {max(layout.expert_bytes.values()) / 1e6:.2f} MB; cache budget "
        f"{cache_bytes / 1e6:.0f} MB -> --n-cpu-moe {n_cpu_moe}; routing: {trace_note}"
    )
    print(table(rows))
    print()
    print(versus_table(versus))
    for key, row in rows.items():
        check = (row.get("expert_cache") or {}).get("replay_check")
        if check:
            print(
                f"{key}: {check['slots']} slots per layer; engine vs Python replay of its access log "
                f"{'EQUAL' if check['equal'] else 'DIFFERENT'}: {check['engine']} vs {check['replay']}; "
                f"profile: {row['expert_cache']['profile']}"
            )
        if row.get("host_experts_log"):
            print(f"{key}: {row['host_experts_log']}")
        if row.get("prompt_ahead_log"):
            print(f"{key}: {row['prompt_ahead_log']}")
        if row.get("concurrent"):
            print(f"{key}: {row['concurrent']['summary']}")
    print(
        "H2D: host->device expert bytes, derived from the routing telemetry (see h2d_bytes_method in "
        f"{args.out}); for e, measured by the expert cache's own counters"
    )
    return 124 if args.interrupted else 0  # as timeout(1) says it: the table holds only the runs done


if __name__ == "__main__":
    sys.exit(main())
