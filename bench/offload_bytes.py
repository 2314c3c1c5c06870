"""Host→device expert bytes per request: derived from the routing telemetry for the stock rows, measured by the
expert cache's own counters for e and its variants.

llama.cpp counts no such thing for the stock rows, so it is *derived* from what is measured. ggml's scheduler
copies a host-resident expert tensor to the device only for a matrix product whose batch (the rows of that layer
in the micro-batch) reaches the device's offload minimum (GGML_OP_OFFLOAD_MIN_BATCH, 32 by default), and then
only the experts that micro-batch used. The routing telemetry (GET /moe/routing?reset=1 after each request) gives
per layer which experts were used and how often; a prompt that fits in one micro-batch is one step, so its
distinct experts per layer are the experts copied; a decode step has one row, so each count is one copy.
Copies x the expert's bytes from the GGUF (gate + up + down) / tokens. llama.cpp's padding (at most 512 bytes
per run of consecutive experts) is left out. Activations and the other weights are not counted: they are the
same in every configuration.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx
from harness.servers import BenchError

from moe_l2_contracts.admin import ADMIN_TOKEN_HEADER
from moe_l2_ops.stats import parse_metrics

Counts = dict[int, dict[int, int]]  # layer -> expert -> activations


def merge_domains(routing: Mapping) -> Counts:
    """GET /moe/routing's `domains: {tag: {layer: {expert: count}}}` summed over the tags."""
    merged: Counts = {}
    for layers in routing.get("domains", {}).values():
        for layer, experts in layers.items():
            row = merged.setdefault(int(layer), {})
            for expert, count in experts.items():
                row[int(expert)] = row.get(int(expert), 0) + int(count)
    return merged


def prompt_step_bytes(
    counts: Counts, host_layers: list[int], expert_bytes: Mapping[int, int], n_expert_used: int, min_batch: int
) -> int:
    """Expert bytes copied host→device for one micro-batch (a prompt that fits in one).

    A layer's matrix product is offloaded only when its batch, the rows of the micro-batch at that
    layer (sum of counts / top-k; the last layer sees only the output rows), reaches `min_batch`;
    then each distinct expert the micro-batch used is copied once.
    """
    total = 0
    for layer in host_layers:
        row = counts.get(layer, {})
        rows = sum(row.values()) / n_expert_used
        if rows >= min_batch:
            total += sum(1 for c in row.values() if c > 0) * expert_bytes[layer]
    return total


def decode_bytes(counts: Counts, host_layers: list[int], expert_bytes: Mapping[int, int], min_batch: int) -> int:
    """Expert bytes copied host→device over single-token steps: each step's top-k experts are
    distinct, so every activation is one copy, when a batch of one reaches `min_batch`."""
    if min_batch > 1:
        return 0
    return sum(sum(counts.get(layer, {}).values()) * expert_bytes[layer] for layer in host_layers)


def pull_counts(client: httpx.Client, url: str, token: str) -> Counts:
    """The routing counts since the last pull, reset: pulled after each request, that request's routing."""
    resp = client.get(f"{url}/moe/routing", params={"reset": "1"}, headers={ADMIN_TOKEN_HEADER: token})
    return merge_domains(resp.raise_for_status().json())


CACHE_COUNTERS = ("accesses", "hits", "loads", "h2d_bytes", "bypass", "bypass_bytes")


def moe_cache_metrics(client: httpx.Client, url: str) -> dict[str, int]:
    """Every llamacpp:moe_cache_* value of /metrics, by name without the prefix (e.g. hits_total, slots)."""
    samples = parse_metrics(client.get(f"{url}/metrics").raise_for_status().text)
    prefix = "llamacpp:moe_cache_"
    cache = {name: values for name, values in samples.items() if name.startswith(prefix)}
    return {name[len(prefix) :]: int(sum(v for _, v in values)) for name, values in cache.items()}


def cache_counters(client: httpx.Client, url: str) -> dict[str, int]:
    """The expert cache's counters from /metrics (llamacpp:moe_cache_<name>_total)."""
    found = moe_cache_metrics(client, url)
    missing = [name for name in CACHE_COUNTERS if f"{name}_total" not in found]
    if missing:
        raise BenchError(f"/metrics of {url} lacks the expert cache's counters {missing}: is the cache on?")
    return {name: found[f"{name}_total"] for name in CACHE_COUNTERS}


def counters_delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in CACHE_COUNTERS}
