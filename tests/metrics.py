"""Reading a /metrics page in the tests: prometheus_client's parser, through the project's
`parse_metrics`, as `moe-l2 stats` reads it, never a regex of our own."""

from __future__ import annotations

from moe_l2_ops.stats import parse_metrics


def sample_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels` (0 when there are none)."""
    return sum(
        value
        for found, value in parse_metrics(text).get(name, [])
        if all(found.get(key) == wanted for key, wanted in labels.items())
    )
