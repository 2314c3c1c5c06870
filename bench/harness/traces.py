"""Route traces a benchmark replays (the route-trace hook, moe_l2_llama.route_trace): the order its requests
take the trace's sequences in, so that the domains take turns, and a trace of some sequences in that order.

numpy and moe_l2_llama inside the functions: bench/harness imports with the standard library alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_l2_llama.route_trace import RouteTrace


def interleave_domains(
    tags: Sequence[str], first: int = 0, n: int | None = None, order: Sequence[str] = ()
) -> list[int]:
    """n sequence indices (all when None) from `first` on, round-robin over the domains, each domain's
    sequences in order; fewer when the domains run out. The domains take turns in `order`, then the others
    in order of first appearance (the ESFT npz holds its sequences task by task: in file order the first
    requests would all be one task)."""
    queues: dict[str, list[int]] = {tag: [] for tag in order}
    for q in range(first, len(tags)):
        queues.setdefault(tags[q], []).append(q)
    limit = len(tags) if n is None else n
    out: list[int] = []
    while len(out) < limit and any(queues.values()):
        for queue in queues.values():
            if queue and len(out) < limit:
                out.append(queue.pop(0))
    return out


def write_sequences(trace: RouteTrace, seqs: Sequence[int], out: Path) -> None:
    """A route trace of `trace`'s sequences `seqs`, in that order, at `out`."""
    import numpy as np

    from moe_l2_llama.route_trace import RouteTrace, write_route_trace

    parts = [trace.sequence(q) for q in seqs]
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int32)
    write_route_trace(RouteTrace(ids=np.concatenate(parts), offsets=offsets, n_expert=trace.n_expert), out)


def subset_trace(trace_file: Path, seqs: Sequence[int], out: Path, tags: Sequence[str]) -> list[str]:
    """A route trace of the sequences `seqs` of `trace_file`, in that order; their domain tags."""
    from moe_l2_llama.route_trace import read_route_trace

    write_sequences(read_route_trace(trace_file), seqs, out)
    return [tags[q] for q in seqs]
