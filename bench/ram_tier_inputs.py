"""bench/ram_tier.py's inputs: the model and the budgets defined on its bytes (ModelBytes), the ESFT route trace
with its tasks taking turns, and the flywheel's routing tables seeded from the sequences no request replays."""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import data_paths
import numpy as np
from harness.models import given_model, model_shape, write_model
from harness.servers import BenchError, trace_patch_present
from harness.traces import interleave_domains, write_sequences

from moe_l2_cache.ram_tier import kept_page_bytes
from moe_l2_gguf.index import ExpertIndex
from moe_l2_llama.route_trace import ROUTE_TRACE_ENV

ESFT_TASKS = ("intent", "law", "summary", "translation")
ESFT_N_EXPERT = 64


@dataclass(frozen=True)
class ModelBytes:
    """The split the budget is defined on: routed expert bytes vs everything else in the file(s)."""

    files: tuple[Path, ...]
    file_bytes: int
    expert_bytes: int  # every routed expert slice (gate + up + down) of every MoE layer
    non_expert_bytes: int  # the rest of the file(s): always needed, always kept by moe-l2
    kept_bytes: int  # the pages those bytes and the experts' shared boundaries occupy: what the tier always keeps
    n_layer: int
    n_moe_layers: int
    n_expert: int
    n_expert_used: int
    model_id: str

    @classmethod
    def from_index(cls, index: ExpertIndex) -> ModelBytes:
        file_bytes = sum(index.file_sizes)
        return cls(
            files=tuple(index.files),
            file_bytes=file_bytes,
            expert_bytes=index.routed_bytes,
            non_expert_bytes=file_bytes - index.routed_bytes,
            kept_bytes=kept_page_bytes(index),
            n_layer=index.n_layer,
            n_moe_layers=len(index.layers),
            n_expert=index.n_expert,
            n_expert_used=index.n_expert_used,
            model_id=index.model_id,
        )

    def budget(self, pct: float) -> int:
        """RAM_BUDGET for `pct`% of the expert bytes: the pages always kept are in it (the non-expert bytes and
        the pages two experts share: 0.25% more on ds-v2-lite, twice them on the demo model's 8 KiB slices)."""
        return self.kept_bytes + int(self.expert_bytes * pct / 100)


def parse_budgets(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--budgets {text!r}: expected percentages of the expert bytes, e.g. 50,75") from None
    if not values or any(not 0 < v <= 100 for v in values):
        raise BenchError(f"--budgets {text!r}: each must be in (0, 100]")
    return values


def shape_size_estimate(name: str) -> int | None:
    """The generated file's tensor bytes (the header adds a few MB)."""
    from moe_l2_gguf.model_shapes import get_shape, sizes

    try:
        return sizes(get_shape(name)).tensor_bytes
    except ValueError:
        return None


def resolve_model(args: argparse.Namespace) -> tuple[Path, dict]:
    """--model, else the whole --shape written once under --model-dir (and reused by later runs)."""
    if args.model is not None:
        return args.model, given_model(args.model)
    shape = model_shape(args.shape)
    path = args.model_dir / f"{shape.name}-full.gguf"
    info = {"path": str(path), "generated": True, "shape": shape.name, "layers": shape.n_layer}
    if path.is_file():
        return path, info | {"reused": True}
    args.model_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.model_dir).free
    need = shape_size_estimate(args.shape) or 11 * 10**9  # ds-v2-lite with Q4 experts: about 9-10 GB
    if free < need + (2 << 30):
        raise BenchError(
            f"{args.model_dir} has {free / 1e9:.1f} GB free; the {shape.name} model needs about {need / 1e9:.1f} GB"
        )
    print(
        f"writing the full {shape.name} shape to {path} (about {need / 1e9:.0f} GB, {free / 1e9:.0f} GB free) ...",
        file=sys.stderr,
        flush=True,
    )
    seconds = write_model(path, shape, progress=True)
    return path, info | {"reused": False, "write_seconds": round(seconds, 1)}


def resolve_trace(args: argparse.Namespace, binary: Path, mb: ModelBytes, tmp: Path) -> tuple[Path | None, str]:
    """(trace file or None, a note). auto: the ESFT trace when the binary replays traces and the
    model's experts match DeepSeek-V2-Lite's (64 per layer, at most its 26 MoE layers)."""
    if args.trace == "none":
        return None, "the model's own router (--trace none)"
    if args.trace != "auto":
        path = Path(args.trace)
        if not path.is_file():
            raise BenchError(f"--trace {path} does not exist")
        return path.resolve(), f"route trace {path.name}"
    if not trace_patch_present(binary):
        return None, f"the model's own router: this llama-server lacks the {ROUTE_TRACE_ENV} patch"
    if mb.n_expert != ESFT_N_EXPERT or mb.n_moe_layers > 26:
        return None, f"the model's own router: {mb.n_moe_layers} x {mb.n_expert} experts is not the ESFT traces' shape"
    src = data_paths.esft_npz()
    if not src.is_file():
        return None, f"the model's own router: no ESFT routing data at {src}"
    out = tmp / "esft.trace"
    try:
        args.seq_tags = write_interleaved_trace(src, out, mb.n_moe_layers, mb.n_expert)
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot make the ESFT route trace ({exc}); pass --trace FILE or --trace none") from exc
    return out, (
        f"ESFT route trace of DeepSeek-V2-Lite ({ROUTE_TRACE_ENV}), sequences reordered so the tasks take turns; "
        "request i replays sequence i"
    )


def write_interleaved_trace(src: Path, out: Path, layers: int, n_expert: int) -> list[str]:
    """The ESFT trace with its sequences reordered so that the four tasks take turns (the npz holds
    them task by task: the first requests would all be `intent`); returns each sequence's task."""
    from moe_l2_llama.route_trace import esft_sequence_tasks, from_esft_npz

    tags = esft_sequence_tasks(src)
    order = interleave_domains(tags, order=ESFT_TASKS)
    write_sequences(from_esft_npz(src, layers=layers, n_expert=n_expert), order, out)
    return [tags[s] for s in order]


def held_out_seed(trace_file: Path, n_requests: int, seq_tags: list[str], moe_layers: list[int]) -> tuple[dict, str]:
    """Per-domain routing counts of the trace's sequences no request replays (sequences >= n_requests)."""
    from moe_l2_llama.route_trace import read_route_trace

    trace = read_route_trace(trace_file)
    if trace.n_seq <= n_requests:
        return {}, "none: the trace has no sequence the run does not replay"
    seed: dict[str, dict] = {}
    for s in range(n_requests, trace.n_seq):
        table = seed.setdefault(seq_tags[s], {"tokens": 0, "layers": {}})
        seq = trace.sequence(s)
        table["tokens"] += len(seq)
        for i, layer in enumerate(moe_layers[: trace.n_layer]):
            row = table["layers"].setdefault(layer, {})
            ids, counts = np.unique(seq[:, i, :], return_counts=True)
            for e, c in zip(ids.tolist(), counts.tolist(), strict=True):
                row[e] = row.get(e, 0) + c
    note = (
        f"Redis routing tables seeded from trace sequences {n_requests}..{trace.n_seq - 1} (none replayed): "
        + ", ".join(f"{d} {t['tokens']} tokens" for d, t in sorted(seed.items()))
    )
    return seed, note
