"""Figures of repeated runs: medians and paired ratios, and the order a round sends its requests in."""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


def median(xs: Sequence[float]) -> float | None:
    """The median, or None for no runs (a config that measured nothing reports null, not an error)."""
    return statistics.median(xs) if xs else None


def paired_ratio(xs: Sequence[float], base: Sequence[float]) -> float | None:
    """The median of xs[i] / base[i]: each pair ran back to back (or in the same rotation), so the median of
    the pairs' ratios cancels a shared machine's slow drifts better than the ratio of the medians. Pairs whose
    base is not positive are left out; None when none is left."""
    pairs = [x / b for x, b in zip(xs, base, strict=True) if b > 0]
    return statistics.median(pairs) if pairs else None


def rotated(items: Sequence[T], i: int) -> Iterator[T]:
    """items starting at i (mod len): round i of a benchmark starts with another server each time, so no
    server always runs first (warm caches, turbo) or last."""
    k = i % len(items)
    yield from [*items[k:], *items[:k]]
