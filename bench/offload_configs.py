"""bench/expert_offload.py's placements: the configs (a-e and their variants) and what chooses their experts'
place, the model's expert bytes (ExpertLayout), the --n-cpu-moe that holds no more than the cache's budget on the
device, the layers whose experts stay in host memory. Pure functions, no server."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from harness.servers import BenchError

from moe_l2_gguf.index import ExpertIndex
from moe_l2_llama.build import built_with_patch

BACKENDS = ("vulkan", "cuda", "cpu", "rpc")

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
            "device and the cache (patch 0020; compose's default)",
            "e",
            auto=True,
        ),
        Config(
            "eh",
            "expert-cache prompt not ahead",
            "e with --moe-cache-prompt-ahead off: each prompt tensor's misses copied before it computes, the two "
            "buffers of the copies ahead (patch 0021) back in the cache's slots",
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
            "e with --moe-cache-cpu-misses off: every miss copied before the device computes it (0017-0018 alone)",
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


def cache_patch_present(binary: Path) -> bool:
    """Whether `binary` has the expert cache."""
    return built_with_patch(binary, lambda p: p.name[4:] == CACHE_PATCH_SUFFIX)


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


def concurrency(config: Config) -> int:
    """-np of a config's server: N for the `<key>-npN` servers of --concurrent, else 1."""
    m = re.search(r"-np(\d+)$", config.key)
    return int(m[1]) if m else 1


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
        raise BenchError("--moe-cache-bytes auto logged no choice (a build without patch 0020?)")
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
