"""/metrics: Prometheus families read from the service's own state at scrape time (one source of truth)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from moe_l2_cache.service import Service

_P = "moe_l2_cache_"


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(_P + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(_P + name, doc, value=value)


class ServiceCollector(Collector):
    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        s = self.service
        yield _gauge(
            "passthrough", "1 when the service runs in pass-through mode (see /v1/stats)", float(s.index is None)
        )
        yield from self._pool()
        yield from self._ram_tier()
        yield from self._flywheel()
        yield from self._hints()
        yield from self._engine_cache()

    def _pool(self) -> Iterator[Metric]:
        if self.service.pool is None:
            return
        p = self.service.pool.stats()
        yield _gauge("pool_budget_bytes", "host-memory budget of the expert pool", p.budget_bytes)
        yield _gauge("pool_pinned_bytes", "bytes of the pinned hot set", p.pinned_bytes)
        yield _gauge("pool_locked_bytes", "bytes held by mlock", p.locked_bytes)
        yield _gauge("pool_tracked_bytes", "bytes of every expert the pool holds", p.tracked_bytes)
        yield _gauge(
            "pool_resident_bytes", "of the tracked bytes, resident in the page cache (mincore)", p.resident_bytes
        )
        yield _gauge(
            "pool_prefetch_only", "1 when mlock failed and the pool only prefetches", float(p.lock_mode != "mlock")
        )
        yield _counter("pool_prefetch_bytes", "bytes prefetched (madvise WILLNEED)", p.prefetch_bytes_total)
        yield _counter("pool_evicted_bytes", "bytes evicted (munlock + DONTNEED)", p.evicted_bytes_total)
        yield _counter("pool_lock_failures", "mlock calls that failed", p.lock_failures)

    def _ram_tier(self) -> Iterator[Metric]:
        if self.service.ram_tier is None:
            return
        t = self.service.ram_tier.stats()
        yield _gauge("ram_budget_bytes", "MOE_L2_RAM_BUDGET: the model file's resident bytes at most", t.budget_bytes)
        resident = GaugeMetricFamily(
            _P + "ram_resident_bytes", "the model file's pages in the page cache (mincore)", labels=["kind"]
        )
        resident.add_metric(["expert"], t.resident_expert_bytes)
        resident.add_metric(["non_expert"], t.resident_non_expert_bytes)
        yield resident
        yield _counter("ram_paged_out_bytes", "expert bytes paged out of llama's mapping", t.paged_out_bytes_total)
        yield _counter("ram_misses", "experts llama faulted in that the pool did not hold", t.misses_seen_total)
        yield _counter("ram_over_budget_sweeps", "sweeps that found more than the budget", t.over_budget_sweeps)

    def _flywheel(self) -> Iterator[Metric]:
        if self.service.flywheel is None:
            return
        f = self.service.flywheel.stats()
        yield _counter("flywheel_pulls", "routing pulls from llama", f.pulls)
        yield _counter("flywheel_pull_errors", "routing pulls that failed", f.pull_errors)
        yield _counter("flywheel_activations", "expert activations received from llama", f.activations_pulled)
        yield _counter("flywheel_tokens", "routed tokens received from llama", f.tokens_pulled)
        yield _counter(
            "flywheel_transitions", "expert pairs of consecutive layers received from llama", f.transitions_pulled
        )
        yield _counter("flywheel_flushes", "batches of counts written to Redis", f.flushes)
        yield _counter("redis_errors", "Redis operations that failed", f.redis_errors)
        yield _gauge("redis_up", "1 when the last Redis operation succeeded", float(f.redis_ok))
        yield _gauge("buffered_cells", "(domain, layer, expert) counts waiting for Redis", f.buffered_cells)
        yield _gauge("buffered_activations", "activations waiting for Redis", f.buffered_activations)
        yield _counter("buffer_dropped_activations", "activations dropped: buffer full", f.dropped_activations)
        yield _counter("buffer_dropped_snapshots", "routing snapshots dropped: buffer full", f.dropped_snapshots)
        skipped = CounterMetricFamily(
            _P + "skipped_entries",
            "entries of Redis or of llama's routing snapshots skipped as unusable (see moe_l2_cache.skips)",
            labels=["kind"],
        )
        for kind, n in f.skipped.items():
            skipped.add_metric([kind], n)
        yield skipped

    def _hints(self) -> Iterator[Metric]:
        h = self.service.hints.stats()
        yield _counter("hints", "hints received", h.hints)
        yield _counter("hotset_switches", "active-domain switches", h.switches)
        yield _counter("hints_held_by_dwell", "hints for another domain within the dwell time", h.held_by_dwell)
        yield _counter("hotset_pushes", "hot sets posted to llama", h.pushes)
        yield _counter("hotset_push_errors", "hot-set posts to llama that failed", h.push_errors)
        active = GaugeMetricFamily(_P + "active_domain", "the active domain (value 1)", labels=["domain"])
        if h.active_domain:
            active.add_metric([h.active_domain], 1.0)
        yield active
        if h.traffic is not None:
            share = GaugeMetricFamily(
                _P + "traffic_share", "hot-set scope traffic: a domain's decayed share of the hints", labels=["domain"]
            )
            for domain, value in h.traffic.items():
                share.add_metric([domain], value)
            yield share

    def _engine_cache(self) -> Iterator[Metric]:
        if self.service.engine_cache is None:
            return
        e = self.service.engine_cache.stats()
        yield _counter("engine_profile_pushes", "domain priors llama's expert cache accepted", e.pushes)
        yield _counter(
            "engine_profile_transition_pushes", "of those, the ones with learned transitions", e.transition_pushes
        )
        yield _counter("engine_profile_errors", "failed rounds of sending priors to llama", e.errors)
        yield _gauge("engine_cache_layers", "layers llama's expert cache holds (0: off or not yet asked)", e.layers)
