"""Cross-layer transitions: which expert follows which at the next layer, per domain, learned from llama.

llama-server with LLAMA_ARG_MOE_TRANSITIONS (patch 0032) counts, per domain tag, every pair (expert a at
MoE layer l, expert b at the next MoE layer) of a token's top-k selections, as pair l, and hands the
counts over with each routing snapshot. The next MoE layer is l+1 where every layer routes, and l+2
in llama4, which interleaves dense layers (before, only l+1 was counted, and llama4 got no pair). The
flywheel adds them to Redis (`moe:{model}:transitions:{domain}:{l}`, field "a:b"), and the
engine-cache feeder turns them into the prefetch tables of llama's expert cache: P(b at the next MoE
layer | a at l) = count(a, b) x k / sum over b of count(a, b), what `fit_profile` computes from a
per-token trace (each a at l co-occurs with k experts at the next layer, so a row sums to k).

Unlike the activation counts they are not decayed. The decay makes a domain's table follow the
traffic (which experts a domain's requests use shifts with what its users ask); a transition is a
conditional probability of the model's routers, which the traffic's mix moves far less, and decaying
it would rewrite n_layer x n_expert^2 fields at every flush (106,496 a domain for DeepSeek-V2-Lite,
every 5 s) instead of the few the new tokens touch.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Collection, Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from moe_l2_cache.buffer import PairCell
from moe_l2_cache.keyspace import domain_problem
from moe_l2_cache.policy.profile import transitions_from_counts
from moe_l2_cache.skips import SkipCounter
from moe_l2_contracts.schemas.llama import RoutingSnapshot

_FIELD = re.compile(r"([0-9]{1,9}):([0-9]{1,9})")


def field_name(a: int, b: int) -> str:
    return f"{a}:{b}"


def parse_field(text: str, n_expert: int) -> tuple[int, int] | None:
    """(a, b) of a transitions hash field, None unless both are experts of the model."""
    m = _FIELD.fullmatch(text)
    if m is None:
        return None
    a, b = int(m[1]), int(m[2])
    return (a, b) if a < n_expert and b < n_expert else None


def next_moe_layers(moe_layers: Collection[int]) -> dict[int, int]:
    """Each MoE layer but the last, to the MoE layer after it: the pairs llama counts."""
    ordered = sorted(moe_layers)
    return dict(itertools.pairwise(ordered))


def pair_layers(moe_layers: Collection[int]) -> list[int]:
    """The layers l that start a pair (l, the next MoE layer): the only pairs counted and stored."""
    return sorted(next_moe_layers(moe_layers))


def pair_cells(
    snapshot: RoutingSnapshot,
    moe_layers: Collection[int],
    n_expert: int,
    accepted: frozenset[str],
    skips: SkipCounter,
) -> dict[PairCell, int]:
    """The snapshot's transition counts of accepted domains and of pairs of the model's MoE layers;
    the rest is skipped and counted, like the activations (flywheel.Flywheel._cells)."""
    cells: dict[PairCell, int] = {}
    for domain, counts in snapshot.transitions.items():
        if (why := domain_problem(domain, accepted)) is not None:
            skips.skip("snapshot_domain", None, f"{why}; its transitions are not stored")
            continue
        try:
            tables = counts.tables(n_expert)
        except ValueError as e:
            skips.skip("snapshot_cell", None, f"transitions that do not fit the model: {e}")
            continue
        starts = next_moe_layers(moe_layers)
        for layer, block in tables.items():
            if layer not in starts:
                skips.skip("snapshot_cell", None, "transitions of a layer pair without routed experts")
                continue
            for a, b in zip(*np.nonzero(block), strict=True):
                cells[(domain, layer, int(a), int(b))] = int(block[a, b])
    return cells


def cache_transitions(
    counts: Mapping[int, NDArray[np.floating]], layers: Sequence[int], top_k: int, moe_layers: Collection[int]
) -> NDArray[np.float64] | None:
    """The expert cache's `transitions` table, [len(layers) - 1][n_expert][n_expert], for the model layers
    it holds (GET /moe/cache's `layers`, in order), from one domain's pair counts by model layer; None
    when no pair of cached layers has counts. Between two cached layers with a MoE layer between them
    (one kept on the device by an -ot placement or `auto`) nothing is counted: that row stays 0 and the
    cache prefetches nothing into the second. Dense layers between them do not count (llama4)."""
    if len(layers) < 2 or not counts:
        return None
    n_expert = next(iter(counts.values())).shape[-1]
    table = np.zeros((len(layers) - 1, n_expert, n_expert))
    following = next_moe_layers(moe_layers)
    seen = False
    for i, (here, after) in enumerate(itertools.pairwise(layers)):
        block = counts.get(here)
        if following.get(here) != after or block is None or not block.any():
            continue
        table[i] = transitions_from_counts(block, top_k)
        seen = True
    return table if seen else None
