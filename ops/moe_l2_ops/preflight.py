"""`moe-l2 up`'s checks of the machine before any build: does the model with its KV cache fit the RAM and the
GPU, and how long may llama-server take to start with it.

All of it from what is cheap to read: MemAvailable (/proc/meminfo), the model's bytes (the GGUF index,
moe_l2_gguf.index) and its attention shape (the GGUF metadata), the context setting, and for a CUDA build
nvidia-smi's free memory. Figures are estimates, so only what is certain to fail stops `up` (an error
line); the rest is a warning line with the figures, and llama-server's own load has the last word.

Why a model larger than the RAM is a warning, not an error: llama-server maps the model file, so it starts
and serves while the kernel reads the weights that do not fit from the disk again as they are used (slowly);
the RAM tier (MOE_L2_RAM_BUDGET, docs/ram-tier.md) is that same situation chosen on purpose. The KV cache is
not mapped from a file: llama-server allocates and clears all of it at load, so a KV cache larger than the
available RAM of a CPU build is an error (the kernel would kill llama-server for memory after the build).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from moe_l2_placement.here import nvidia_gpus

# A test hook: the meminfo file the fit check reads, so a test can plant a small MemAvailable.
MEMINFO_ENV = "MOE_L2_TEST_MEMINFO"
PROC_MEMINFO = Path("/proc/meminfo")
# f16, llama.cpp's default type of the K and V caches (-ctk/-ctv change it)
KV_ELEMENT_BYTES = 2
CACHE_TYPE_FLAGS = ("-ctk", "--cache-type-k", "-ctv", "--cache-type-v")
CONTEXT_FLAGS = ("-c", "--ctx-size")
# The llama start timeout's assumption: the model file read once at 200 MB/s (a SATA SSD or a cloud block
# volume; NVMe reads several times faster, a network disk may read slower), plus a margin for the rest of the
# load (the device's buffers, the warm-up). The setting (MOE_L2_START_TIMEOUT_S) stays the floor.
ASSUMED_READ_BYTES_PER_S = 200e6
START_MARGIN_S = 60.0
NVIDIA_SMI_TIMEOUT_S = 10.0

Level = Literal["error", "warning"]


@dataclass(frozen=True)
class ModelFacts:
    """What the fit check needs of a model: from the GGUF index and the attention metadata."""

    tensor_bytes: int  # every weight: what llama-server maps
    routed_bytes: int  # the routed experts: host memory under the GPU defaults (--cpu-moe)
    kv_bytes_per_token: int  # the K and V caches of every layer, f16; 0 when the metadata does not say
    context_length: int  # the model's own: the KV cache's length when llama-server's -c is 0
    sliding_window: bool  # some layers keep a window only: the KV estimate is an upper bound

    @property
    def other_bytes(self) -> int:
        """The weights besides the routed experts: the device's share under the GPU defaults."""
        return self.tensor_bytes - self.routed_bytes


@dataclass(frozen=True)
class Finding:
    level: Level
    message: str  # one line, with the figures and what to change


def _per_layer(value: Any, n_layer: int) -> list[int] | None:
    """A metadata number, or one per layer (a hybrid model's head_count_kv, 0 for its recurrent layers)."""
    if isinstance(value, list) and value and all(isinstance(v, int | float) for v in value):
        return [int(v) for v in value]
    if isinstance(value, int | float):
        return [int(value)] * n_layer
    return None


def kv_bytes_per_token(fields: Mapping[str, Any], arch: str) -> int:
    """The f16 K and V caches' bytes for one token of context, over every layer, as llama.cpp allocates them:
    head_count_kv x (key_length + value_length) per layer (the lengths default to embedding / head_count), and
    for multi-head latent attention (DeepSeek-V2/V3, Kimi: key_length_mla present) the compressed K alone,
    since llama.cpp keeps no V cache there (llama-kv-cache.cpp, has_v = !is_mla). 0 where the metadata lacks
    the shape: no estimate rather than a wrong one."""
    a = f"{arch}.attention."
    n_layer = int(fields.get(f"{arch}.block_count") or 0)
    heads = _per_layer(fields.get(a + "head_count"), n_layer)
    heads_kv = _per_layer(fields.get(a + "head_count_kv", fields.get(a + "head_count")), n_layer)
    if not n_layer or not heads or not heads_kv:
        return 0
    n_embd = int(fields.get(f"{arch}.embedding_length") or 0)
    head_dim = n_embd // max(heads) if max(heads) else 0
    key = int(fields.get(a + "key_length") or head_dim)
    value = 0 if a + "key_length_mla" in fields else int(fields.get(a + "value_length") or head_dim)
    return sum(h * (key + value) for h in heads_kv) * KV_ELEMENT_BYTES


def read_metadata(path: Path) -> dict[str, Any]:
    """The GGUF's scalar metadata and per-layer arrays (the vocabulary left out: only numbers are wanted)."""
    import gguf  # deferred, as moe_l2_gguf.index does: numpy and gguf only when a model is read

    try:
        reader = gguf.GGUFReader(path, "r")
    except (OSError, ValueError):
        return {}  # the index read it a moment ago; nothing to estimate from, and llama-server will say why
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith(("GGUF.", "tokenizer.")) or not field.types:
            continue
        value = field.contents()
        if isinstance(value, int | float | str) or (isinstance(value, list) and len(value) <= 512):
            out[name] = value
    return out


def model_facts(path: Path, tensor_bytes: int, routed_bytes: int) -> ModelFacts:
    """`path`'s facts; tensor_bytes and routed_bytes from its index (moe_l2_gguf.index.load_index)."""
    fields = read_metadata(path)
    arch = str(fields.get("general.architecture") or "")
    return ModelFacts(
        tensor_bytes=tensor_bytes,
        routed_bytes=routed_bytes,
        kv_bytes_per_token=kv_bytes_per_token(fields, arch),
        context_length=int(fields.get(f"{arch}.context_length") or 0),
        sliding_window=f"{arch}.attention.sliding_window" in fields,
    )


def mem_available(meminfo: Path | None = None) -> int | None:
    """MemAvailable in bytes: what the kernel can give without swapping (the page cache it can drop
    included). None where the file is unreadable or has no such line (not Linux)."""
    meminfo = meminfo or Path(os.environ.get(MEMINFO_ENV) or PROC_MEMINFO)
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            number, _, unit = value.strip().partition(" ")
            return int(number) * (1024 if unit.strip() == "kB" else 1) if number.isdigit() else None
    return None


def nvidia_free_bytes() -> int | None:
    """The free memory of every NVIDIA GPU, summed (llama.cpp splits the layers over them); None without
    nvidia-smi or an answer from it."""
    gpus, _ = nvidia_gpus(NVIDIA_SMI_TIMEOUT_S)
    return sum(gpu.free_bytes for gpu in gpus) if gpus else None


def _flag(arg: str) -> str:
    return arg.split("=", 1)[0]


def context_of(argv: list[str]) -> int:
    """The context llama-server is started with: its last -c (the extra arguments' win, as in llama.cpp);
    0 (the model's own) when none is given."""
    values = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in CONTEXT_FLAGS]
    values += [arg.split("=", 1)[1] for arg in argv if "=" in arg and _flag(arg) in CONTEXT_FLAGS]
    try:
        return int(values[-1]) if values else 0
    except ValueError:
        return 0  # llama-server will refuse it itself


def kv_type_given(argv: list[str]) -> bool:
    """Whether the command sets the K or V cache's type (the estimate assumes f16)."""
    return any(_flag(arg) in CACHE_TYPE_FLAGS for arg in argv)


def human(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class FitInputs:
    """The machine, the model and the settings the fit check weighs."""

    facts: ModelFacts
    backend: str  # the build that serves: cpu, cuda, vulkan, or what a given binary's build-info.json says
    ctx_size: int  # llama-server's -c (context_of); 0: the model's context
    replicas: int  # each llama replica has its own KV cache; the mapped model is shared in the page cache
    ram_available: int | None  # MemAvailable; None: unknown, nothing checked against it
    device_free: int | None = None  # a CUDA build's free GPU memory; None: not known
    kv_typed: bool = False  # -ctk/-ctv given (kv_type_given): the f16 estimate is an upper bound
    ram_budget: str = ""  # MOE_L2_RAM_BUDGET: a model larger than the RAM, served on purpose

    @property
    def context(self) -> int:
        return self.ctx_size or self.facts.context_length

    @property
    def kv_bytes(self) -> int:
        """Every replica's KV cache."""
        return self.facts.kv_bytes_per_token * self.context * self.replicas

    @property
    def kv_exact(self) -> bool:
        """Whether the KV figure is what llama.cpp allocates, not an upper bound."""
        return not self.facts.sliding_window and not self.kv_typed

    @property
    def on_gpu(self) -> bool:
        return self.backend in ("cuda", "vulkan")

    def kv_line(self) -> str:
        per = f"{self.context} tokens of context" + (f" x {self.replicas} replicas" if self.replicas > 1 else "")
        kind = "f16" if self.kv_exact else "as f16: an upper bound"  # a sliding window, or -ctk/-ctv given
        return f"the KV cache ({human(self.kv_bytes)} for {per}, {kind})"


def fit_findings(fit: FitInputs) -> list[Finding]:
    """What does not fit, one line each: an error only for a CPU build's KV cache beyond the available RAM
    (when the figure is exact), warnings for the rest."""
    findings = []
    if fit.ram_available is not None:
        findings += _ram_findings(fit, fit.ram_available)
    if fit.backend == "cuda" and fit.device_free is not None:
        findings += _device_findings(fit, fit.device_free)
    return findings


def _ram_findings(fit: FitInputs, ram: int) -> list[Finding]:
    ram_line = f"{human(ram)} of RAM available (MemAvailable)"
    if fit.backend == "cpu" and fit.kv_bytes > ram:
        level: Level = "error" if fit.kv_exact else "warning"
        return [
            Finding(
                level,
                f"{fit.kv_line()} does not fit the {ram_line}: it is allocated whole at load, and llama-server "
                f"would be killed for memory; lower the context (-c {fit.context}: MOE_L2_LLAMA_CTX_PER_REQUEST "
                "times MOE_L2_LLAMA_PARALLEL)",
            )
        ]
    # a GPU build keeps the routed experts in host memory (--cpu-moe) and the rest, KV included, on the device
    host = fit.facts.routed_bytes if fit.on_gpu else fit.facts.tensor_bytes + fit.kv_bytes
    if host <= ram or fit.ram_budget.strip():
        return []
    what = (
        f"the routed experts ({human(fit.facts.routed_bytes)})"
        if fit.on_gpu
        else f"the model ({human(fit.facts.tensor_bytes)}) and {fit.kv_line()}"
    )
    return [
        Finding(
            "warning",
            f"{what} need {human(host)} and there is {ram_line}: llama-server maps the model, so it starts, "
            "but rereads from disk what does not fit (slowly); MOE_L2_RAM_BUDGET serves a model larger than the "
            "RAM on purpose (docs/ram-tier.md)",
        )
    ]


def _device_findings(fit: FitInputs, free: int) -> list[Finding]:
    # each replica places its own copy of the non-expert weights and its KV cache on the device
    need = (fit.facts.other_bytes + fit.facts.kv_bytes_per_token * fit.context) * fit.replicas
    if need <= free:
        return []
    return [
        Finding(
            "warning",
            f"the weights besides the routed experts ({human(fit.facts.other_bytes)}) and {fit.kv_line()} need "
            f"{human(need)} of GPU memory and nvidia-smi reports {human(free)} free: with the GPU defaults "
            "(every layer on the GPU) llama-server will fail to load; lower the context (MOE_L2_LLAMA_CTX_PER_REQUEST) "
            "or set MOE_L2_LLAMA_GPU_LAYERS",
        )
    ]


def llama_start_timeout(setting_s: float, model_bytes: int) -> float:
    """How long llama-server may take to become healthy: the setting (MOE_L2_START_TIMEOUT_S), or longer for a
    model whose first read at ASSUMED_READ_BYTES_PER_S takes longer, so a large model's load is not taken for a
    hung server (and restarted, to read it all again)."""
    return max(setting_s, START_MARGIN_S + model_bytes / ASSUMED_READ_BYTES_PER_S)
