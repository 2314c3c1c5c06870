"""Routing counts waiting for Redis: merged in memory, bounded, and flushed exactly once.

Every pull resets llama's counters, so counts that do not reach Redis exist only here. They are
merged per (domain, layer, expert) cell, and transitions per (domain, layer, expert, next layer's
expert), which keeps the memory bounded by the model's shape; past
`max_cells` a whole snapshot is dropped and counted, never half of one.

A flush whose transaction fails may still have been applied (the connection can die after EXEC
and before its reply). Each batch therefore carries an id that the transaction records in Redis;
a batch that failed stays "uncertain" until that marker says whether it landed, so a retry never
counts twice.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

Cell = tuple[str, int, int]  # (domain, layer, expert)
PairCell = tuple[str, int, int, int]  # (domain, layer, expert a at layer, expert b at layer + 1)


@dataclass
class Batch:
    """Merged counts of one or more routing snapshots."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    counts: dict[Cell, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    pairs: dict[PairCell, int] = field(default_factory=dict)

    @property
    def activations(self) -> int:
        return sum(self.counts.values())

    @property
    def cells(self) -> int:
        return len(self.counts) + len(self.pairs)

    def __bool__(self) -> bool:
        return bool(self.counts) or bool(self.pairs) or any(self.tokens.values())

    def merge(self, counts: dict[Cell, int], tokens: dict[str, int], pairs: dict[PairCell, int] | None = None) -> None:
        for cell, n in counts.items():
            self.counts[cell] = self.counts.get(cell, 0) + n
        for domain, n in tokens.items():
            self.tokens[domain] = self.tokens.get(domain, 0) + n
        for pair, n in (pairs or {}).items():
            self.pairs[pair] = self.pairs.get(pair, 0) + n

    def domains(self) -> set[str]:
        return {d for d, _, _ in self.counts} | {d for d, *_ in self.pairs} | {d for d, n in self.tokens.items() if n}

    def pairs_by_layer(self, domain: str) -> Iterator[tuple[int, dict[tuple[int, int], int]]]:
        layers: dict[int, dict[tuple[int, int], int]] = {}
        for (d, layer, a, b), n in self.pairs.items():
            if d == domain:
                layers.setdefault(layer, {})[(a, b)] = n
        yield from sorted(layers.items())

    def by_layer(self, domain: str) -> Iterator[tuple[int, dict[int, int]]]:
        layers: dict[int, dict[int, int]] = {}
        for (d, layer, expert), n in self.counts.items():
            if d == domain:
                layers.setdefault(layer, {})[expert] = n
        yield from sorted(layers.items())


class CountBuffer:
    """Single-threaded (the service's event loop); the flywheel serialises flushes."""

    def __init__(self, max_cells: int) -> None:
        self.max_cells = max_cells
        self.current = Batch()
        self.uncertain: Batch | None = None
        self.dropped_activations = 0
        self.dropped_snapshots = 0

    @property
    def cells(self) -> int:
        return self.current.cells + (self.uncertain.cells if self.uncertain else 0)

    @property
    def activations(self) -> int:
        return self.current.activations + (self.uncertain.activations if self.uncertain else 0)

    def add(self, counts: dict[Cell, int], tokens: dict[str, int], pairs: dict[PairCell, int] | None = None) -> bool:
        """Merge one snapshot; False (and counted) when it would take the buffer past its bound."""
        pairs = pairs or {}
        new_cells = sum(1 for cell in counts if cell not in self.current.counts)
        new_cells += sum(1 for pair in pairs if pair not in self.current.pairs)
        if self.cells + new_cells > self.max_cells:
            self.dropped_snapshots += 1
            self.dropped_activations += sum(counts.values())
            return False
        self.current.merge(counts, tokens, pairs)
        return True

    def take(self) -> Batch | None:
        """The batch to write next (the caller reports back with `landed` or `failed`)."""
        if not self.current:
            return None
        batch, self.current = self.current, Batch()
        return batch

    def failed(self, batch: Batch) -> None:
        """The write of `batch` failed: maybe applied, maybe not, until its marker is checked."""
        self.uncertain = batch

    def resolve(self, applied: bool) -> None:
        """The uncertain batch's marker was checked: drop it if it landed, else count it again."""
        if self.uncertain is None:
            return
        if not applied:
            self.current.merge(self.uncertain.counts, self.uncertain.tokens, self.uncertain.pairs)
        self.uncertain = None
