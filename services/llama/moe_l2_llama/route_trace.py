"""Route traces: recorded per-token expert selections that llama-server replays (LLAMA_MOE_ROUTE_TRACE).

A model with a real model's shape but random weights routes at random. With a route trace, the
patched llama-server (patch 0034) replaces every MoE layer's selected experts by those a real model
selected, token by token, so the experts moved are the real model's. `moe-l2 make-route-trace`
converts the ESFT traces (DeepSeek-V2-Lite on four task domains, an npz) into the server's format,
which is simple enough to read in C++ without a zip or npy parser (all little-endian):

    char    magic[8] = "MOEL2RT1"
    int32   n_layer, n_expert, n_used, n_seq, n_token   (n_layer counts MoE layers only)
    int32   offsets[n_seq + 1]                          (sequence s: tokens offsets[s] .. offsets[s+1]-1)
    uint16  ids[n_token][n_layer][n_used]

docs/model-shapes.md ("Route trace override") says how the server maps requests and tokens onto it.
"""

from __future__ import annotations

import argparse
import os
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"MOEL2RT1"
ROUTE_TRACE_ENV = "LLAMA_MOE_ROUTE_TRACE"  # the variable that makes a patched llama-server replay a trace
HEADER = np.dtype([("n_layer", "<i4"), ("n_expert", "<i4"), ("n_used", "<i4"), ("n_seq", "<i4"), ("n_token", "<i4")])

# the ESFT npz's `task` codes, in order (see bench/data/routing/deepseek-ai__ESFT/README.md)
ESFT_TASKS = ("intent", "law", "summary", "translation")
# DeepSeek-V2-Lite, the model the ESFT traces come from, has 64 routed experts
ESFT_N_EXPERT = 64


class RouteTraceError(Exception):
    """Bad input for a route trace; the message is one line meant for the user."""


@dataclass(frozen=True)
class RouteTrace:
    ids: np.ndarray  # [n_token, n_layer, n_used] uint16
    offsets: np.ndarray  # [n_seq + 1] int32
    n_expert: int

    @property
    def n_layer(self) -> int:
        return int(self.ids.shape[1])

    @property
    def n_used(self) -> int:
        return int(self.ids.shape[2])

    @property
    def n_seq(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_token(self) -> int:
        return int(self.ids.shape[0])

    def sequence(self, s: int) -> np.ndarray:
        """The [tokens, n_layer, n_used] selections of sequence s."""
        return self.ids[self.offsets[s] : self.offsets[s + 1]]

    def shape_text(self) -> str:
        return f"{self.n_layer} MoE layers x {self.n_expert} experts, top-{self.n_used}"


def parse_seqs(spec: str) -> slice:
    """`N` (the first N sequences) or `A:B` (sequences A to B-1, either end may be left out)."""
    try:
        if ":" not in spec:
            n = int(spec)
            if n < 1:
                raise ValueError
            return slice(0, n)
        start, stop = spec.split(":", 1)
        return slice(int(start) if start else None, int(stop) if stop else None)
    except ValueError:
        raise RouteTraceError(f"--seqs {spec!r}: expected N (the first N sequences) or A:B") from None


def _load_arrays(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise RouteTraceError(f"{path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in ("experts", "task", "seq", "pos") if k not in npz.files]
            if missing:
                raise RouteTraceError(f"{path} lacks the array(s) {', '.join(missing)} of the ESFT routing npz")
            return {k: npz[k] for k in ("experts", "task", "seq", "pos")}
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise RouteTraceError(f"{path} is not an npz file ({type(exc).__name__}: {exc})") from None


def from_esft_npz(
    path: Path,
    *,
    tasks: list[str] | None = None,
    seqs: slice | None = None,
    layers: int | None = None,
    n_expert: int = ESFT_N_EXPERT,
) -> RouteTrace:
    """The sequences of the given tasks (all by default, in file order), then the `seqs` slice of them,
    cut to the first `layers` MoE layers (to fit a reduced-depth model)."""
    arrays = _load_arrays(path)
    experts, task, seq, pos = arrays["experts"], arrays["task"], arrays["seq"], arrays["pos"]
    if experts.ndim != 3 or not (len(task) == len(seq) == len(pos) == len(experts)):
        raise RouteTraceError(f"{path}: expected experts[token, layer, slot] and task/seq/pos per token")

    for name in tasks or []:
        if name not in ESFT_TASKS:
            raise RouteTraceError(f"unknown task {name!r}: expected one of {', '.join(ESFT_TASKS)}")
    n_layer_all = experts.shape[1]
    if layers is not None and not 1 <= layers <= n_layer_all:
        raise RouteTraceError(f"--layers {layers}: the trace has MoE layers 1 to {n_layer_all}")
    if not 1 <= n_expert <= 65536:
        raise RouteTraceError(f"--experts {n_expert}: expected 1 to 65536")

    keep = np.ones(len(seq), dtype=bool) if not tasks else np.isin(task, [ESFT_TASKS.index(t) for t in tasks])
    order = np.flatnonzero(keep)
    order = order[np.lexsort((pos[order], seq[order]))]  # sequence by sequence, tokens in order
    seq_ids, starts = np.unique(seq[order], return_index=True)
    chosen = np.arange(len(seq_ids))[seqs] if seqs is not None else np.arange(len(seq_ids))
    if len(chosen) == 0:
        raise RouteTraceError(f"no sequence selected (the selection has {len(seq_ids)})")

    bounds = np.append(starts, len(order))
    rows = np.concatenate([order[bounds[i] : bounds[i + 1]] for i in chosen])
    lengths = np.array([bounds[i + 1] - bounds[i] for i in chosen])
    ids = experts[rows][:, : layers or n_layer_all, :]
    if int(ids.max()) >= n_expert:
        raise RouteTraceError(f"expert id {int(ids.max())} out of range for --experts {n_expert}")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return RouteTrace(ids=ids.astype(np.uint16), offsets=offsets, n_expert=n_expert)


def esft_sequence_tasks(path: Path) -> list[str]:
    """The task of every sequence of `from_esft_npz(path)` (all tasks, all sequences), in trace order."""
    arrays = _load_arrays(path)
    task, seq, pos = arrays["task"], arrays["seq"], arrays["pos"]
    order = np.lexsort((pos, seq))
    _, starts = np.unique(seq[order], return_index=True)
    return [ESFT_TASKS[int(t)] for t in task[order][starts]]


def write_route_trace(trace: RouteTrace, path: Path) -> None:
    """Writes atomically: beside the target, then renamed."""
    if not path.parent.is_dir():
        raise RouteTraceError(f"{path.parent} is not a directory")
    header = np.array([(trace.n_layer, trace.n_expert, trace.n_used, trace.n_seq, trace.n_token)], dtype=HEADER)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(MAGIC)
            f.write(header.tobytes())
            f.write(trace.offsets.astype("<i4").tobytes())
            f.write(np.ascontiguousarray(trace.ids, dtype="<u2").tobytes())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def read_route_trace(path: Path) -> RouteTrace:
    raw = path.read_bytes()
    if raw[: len(MAGIC)] != MAGIC:
        raise RouteTraceError(f"{path} is not a route trace (no {MAGIC.decode()} header)")
    h = np.frombuffer(raw, dtype=HEADER, count=1, offset=len(MAGIC))[0]
    n_layer, n_expert, n_used, n_seq, n_token = (int(h[k]) for k in HEADER.names)
    at = len(MAGIC) + HEADER.itemsize
    offsets = np.frombuffer(raw, dtype="<i4", count=n_seq + 1, offset=at).astype(np.int32)
    at += 4 * (n_seq + 1)
    ids = np.frombuffer(raw, dtype="<u2", count=n_token * n_layer * n_used, offset=at)
    return RouteTrace(ids=ids.reshape(n_token, n_layer, n_used).astype(np.uint16), offsets=offsets, n_expert=n_expert)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moe-l2 make-route-trace",
        description="Convert recorded routing (the ESFT npz) into a trace llama-server replays with "
        "LLAMA_MOE_ROUTE_TRACE (test only, docs/model-shapes.md).",
    )
    parser.add_argument("--from", dest="src", type=Path, required=True, help="the ESFT routing npz")
    parser.add_argument("--out", type=Path, required=True, help="the trace file to write")
    parser.add_argument(
        "--task",
        action="append",
        metavar="NAME",
        help=f"only this task's sequences (repeatable): {', '.join(ESFT_TASKS)}",
    )
    parser.add_argument("--seqs", metavar="N|A:B", help="the first N of the selected sequences, or A to B-1")
    parser.add_argument("--layers", type=int, metavar="N", help="only the first N MoE layers (a reduced-depth model)")
    parser.add_argument(
        "--experts", type=int, default=ESFT_N_EXPERT, help=f"routed experts per layer (default {ESFT_N_EXPERT})"
    )
    args = parser.parse_args(argv)
    try:
        trace = from_esft_npz(
            args.src,
            tasks=args.task,
            seqs=parse_seqs(args.seqs) if args.seqs else None,
            layers=args.layers,
            n_expert=args.experts,
        )
        write_route_trace(trace, args.out)
    except RouteTraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB): {trace.n_seq} sequences, {trace.n_token} tokens, "
        f"{trace.shape_text()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
