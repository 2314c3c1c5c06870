"""Choosing a hot set from routing counts, and writing it as a router map.

An expert's usefulness is the share of its layer's activations it takes: holding it saves that
fraction of the layer's expert loads per token. Shares are per layer, so a layer that saw fewer
tokens (the last one only sees output rows) weighs the same as the others. Experts are taken by
usefulness per byte until the byte budget is spent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HotSetChoice:
    layers: dict[int, list[int]]  # most useful first
    bytes: int
    activations: float  # all activations in the tables
    coverage: float  # share of them inside the hot set

    @property
    def n_experts(self) -> int:
        return sum(len(ids) for ids in self.layers.values())


def select_hot_set(
    counts: Mapping[int, Mapping[int, float]], expert_bytes: Mapping[int, int], budget_bytes: int
) -> HotSetChoice:
    candidates: list[tuple[float, float, int, int]] = []  # (-share per byte, -share, layer, expert)
    total = 0.0
    for layer, per_expert in counts.items():
        layer_total = sum(c for c in per_expert.values() if c > 0)
        if layer_total <= 0 or layer not in expert_bytes:
            continue
        total += layer_total
        for expert, c in per_expert.items():
            if c > 0:
                share = c / layer_total
                candidates.append((-share / expert_bytes[layer], -share, layer, expert))
    candidates.sort()
    chosen: dict[int, list[tuple[float, int]]] = {}
    used = 0
    covered = 0.0
    for _, neg_share, layer, expert in candidates:
        size = expert_bytes[layer]
        if used + size > budget_bytes:
            continue  # a smaller expert of another layer may still fit
        used += size
        chosen.setdefault(layer, []).append((neg_share, expert))
        covered += counts[layer][expert]
    layers = {layer: [e for _, e in sorted(items)] for layer, items in sorted(chosen.items())}
    return HotSetChoice(layers, used, total, covered / total if total else 0.0)


def router_map_text(layers: Mapping[int, Sequence[int]]) -> str:
    """The reference project's router-map format: `# EXPERT_TOTAL <n>`, then `<layer> <id> <id> ...` per line."""
    lines = [f"# EXPERT_TOTAL {sum(len(ids) for ids in layers.values())}"]
    lines += [" ".join(str(x) for x in (layer, *ids)) for layer, ids in sorted(layers.items()) if ids]
    return "\n".join(lines) + "\n"


def sum_tables(tables: Sequence[Mapping[int, Mapping[int, float]]]) -> dict[int, dict[int, float]]:
    """Every domain's counts together: the table the global hot set is chosen from."""
    out: dict[int, dict[int, float]] = {}
    for table in tables:
        for layer, per_expert in table.items():
            acc = out.setdefault(layer, {})
            for expert, c in per_expert.items():
                acc[expert] = acc.get(expert, 0.0) + c
    return out


def mix_tables(
    tables: Mapping[str, Mapping[int, Mapping[int, float]]], weights: Mapping[str, float]
) -> dict[int, dict[int, float]]:
    """Several domains' tables as one, each domain by its weight: per layer, every domain's counts are
    first made shares of that layer (as usefulness is, above), so a domain with ten times the tokens
    weighs what its weight says, not ten times more. A weight without a table adds nothing."""
    out: dict[int, dict[int, float]] = {}
    for domain, weight in weights.items():
        for layer, per_expert in tables.get(domain, {}).items():
            layer_total = sum(c for c in per_expert.values() if c > 0)
            if layer_total <= 0 or weight <= 0:
                continue
            acc = out.setdefault(layer, {})
            for expert, c in per_expert.items():
                if c > 0:
                    acc[expert] = acc.get(expert, 0.0) + weight * c / layer_total
    return out
