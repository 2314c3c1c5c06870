"""Prometheus metrics of the gateway (`moe_l2_*`), one registry per app, and the per-request ASGI probe."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Routes with their own label; anything else under /v1 or /api shares one, so clients cannot
# grow the label set by inventing paths.
KNOWN_ROUTES = frozenset(
    {
        "/",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/embeddings",
        "/api/chat",
        "/api/generate",
        "/api/tags",
        "/api/version",
        "/api/ps",
        "/api/show",
        "/healthz",
        "/readyz",
        "/metrics",
        "/moe/stats",
    }
)
# Client-chosen domain tags (X-MoE-Domain) are free-form: beyond this many distinct ones they are
# counted together, as llama's telemetry does.
MAX_DOMAIN_LABELS = 64
OTHER_DOMAIN = "_other"
DISCONNECTED_STATUS = "499"  # nginx's "client closed request": the client left before the end
TIMED_OUT_STATUS = "408"  # the client stalled while sending its body (connections.GuardedProtocol)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_PREDICT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


def route_of(path: str) -> str:
    if path in KNOWN_ROUTES:
        return path
    if path.startswith("/v1/"):
        return "/v1/*"
    if path.startswith("/api/"):
        return "/api/*"
    return "other"


class GatewayMetrics:
    def __init__(self) -> None:
        self.started = time.time()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("moe_l2_requests", "Requests by route and status", ["route", "status"], registry=r)
        self.request_duration = Histogram(
            "moe_l2_request_duration_seconds",
            "End-to-end request latency (to the last byte of a stream)",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "moe_l2_ttft_seconds", "Time to the first generated token", ["route"], buckets=_TTFT_BUCKETS, registry=r
        )
        self.tokens = Counter("moe_l2_tokens", "Tokens by kind (prompt, completion)", ["kind"], registry=r)
        self.domains = Counter(
            "moe_l2_domain", "Requests by domain and where it came from", ["domain", "source"], registry=r
        )
        self.predictor_seconds = Histogram(
            "moe_l2_predictor_request_seconds",
            "Predictor calls by replica",
            ["endpoint"],
            buckets=_PREDICT_BUCKETS,
            registry=r,
        )
        self.predictor_failures = Counter(
            "moe_l2_predictor_failures", "Failed predictor calls", ["endpoint", "reason"], registry=r
        )
        self.upstream_errors = Counter(
            "moe_l2_upstream_errors", "Errors talking to llama", ["upstream", "kind"], registry=r
        )
        self.hints = Counter("moe_l2_hints", "Hints to the cache-manager by outcome", ["outcome"], registry=r)
        self.hints_dropped = Counter("moe_l2_hints_dropped", "Hints dropped because the queue was full", registry=r)
        self.in_flight = Gauge("moe_l2_requests_in_flight", "Requests being served", registry=r)
        self.client_connections = Gauge("moe_l2_client_connections", "Open client connections", registry=r)
        self.connections_closed = Counter(
            "moe_l2_client_connections_closed",
            "Client connections the gateway closed itself, by reason "
            "(head_timeout, body_timeout, head_too_large, over_limit)",
            ["reason"],
            registry=r,
        )
        # the llama replicas (replicas.py); `replica` is host:port as dialled, Prometheus' `instance`
        # for its scrape of that llama
        self.replica_requests = Counter(
            "moe_l2_replica_requests",
            "Requests routed to each llama replica, by domain",
            ["replica", "domain"],
            registry=r,
        )
        self.replica_in_flight = Gauge(
            "moe_l2_replica_in_flight", "Requests in flight on each llama replica", ["replica"], registry=r
        )
        self.replica_healthy = Gauge(
            "moe_l2_replica_healthy",
            "1 while a llama replica is in rotation, 0 while it cools down",
            ["replica"],
            registry=r,
        )
        self.replica_failures = Counter(
            "moe_l2_replica_failures",
            "Failed requests to a llama replica, by reason",
            ["replica", "reason"],
            registry=r,
        )
        self.routing_decisions = Counter(
            "moe_l2_routing_decisions",
            "Replica choices by policy and outcome (home, spill, least_loaded, round_robin, retry)",
            ["policy", "outcome"],
            registry=r,
        )
        self._domain_labels: set[str] = set()
        self._children: dict[tuple[object, ...], Any] = {}

    def labelled(self, metric: Any, *values: str) -> Any:
        """`metric.labels(*values)`, looked up once: prometheus_client validates the labels on every
        call, and a streamed request takes five of them. Every label here has few values."""
        key = (id(metric), *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def domain_label(self, domain: str) -> str:
        if domain in self._domain_labels:
            return domain
        if len(self._domain_labels) >= MAX_DOMAIN_LABELS:
            return OTHER_DOMAIN
        self._domain_labels.add(domain)
        return domain

    def count_domain(self, domain: str, source: str) -> None:
        self.labelled(self.domains, self.domain_label(domain), source).inc()

    def count_tokens(self, prompt: int, completion: int) -> None:
        if prompt:
            self.labelled(self.tokens, "prompt").inc(prompt)
        if completion:
            self.labelled(self.tokens, "completion").inc(completion)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def summary(self) -> dict[str, Any]:
        """The figures of GET /moe/stats, read back from the registry."""
        by_route: dict[str, dict[str, float]] = {}
        by_status: dict[str, float] = {}
        for labels, value in _samples(self.requests, "_total"):
            route = by_route.setdefault(labels["route"], {})
            route[labels["status"]] = value
            by_status[labels["status"]] = by_status.get(labels["status"], 0) + value
        durations: dict[str, dict[str, float]] = {}
        for labels, value in _samples(self.request_duration, "_sum"):
            durations.setdefault(labels["route"], {})["sum"] = value
        for labels, value in _samples(self.request_duration, "_count"):
            durations.setdefault(labels["route"], {})["count"] = value
        domains: dict[str, dict[str, float]] = {}
        for labels, value in _samples(self.domains, "_total"):
            domains.setdefault(labels["domain"], {})[labels["source"]] = value
        total_domains = sum(sum(d.values()) for d in domains.values())
        return {
            "uptime_s": round(time.time() - self.started, 1),
            "requests": {
                "total": sum(by_status.values()),
                "in_flight": _single(self.in_flight, ""),
                "by_status": by_status,
                "by_route": by_route,
                "mean_latency_s": {
                    route: round(d["sum"] / d["count"], 6) for route, d in durations.items() if d.get("count")
                },
            },
            "domains": {
                "by_source": domains,
                "share": {
                    domain: round(sum(sources.values()) / total_domains, 4) for domain, sources in domains.items()
                }
                if total_domains
                else {},
            },
            "tokens": {labels["kind"]: value for labels, value in _samples(self.tokens, "_total")},
            "predictor": {
                "calls": {labels["endpoint"]: value for labels, value in _samples(self.predictor_seconds, "_count")},
                "failures": _sum_by(self.predictor_failures, "reason"),
            },
            "hints": {
                **{labels["outcome"]: value for labels, value in _samples(self.hints, "_total")},
                "dropped": _single(self.hints_dropped, "_total"),
            },
            "upstream_errors": _sum_by(self.upstream_errors, "kind"),
        }


def _samples(metric: Any, suffix: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for family in metric.collect():
        for sample in family.samples:
            if sample.name == family.name + suffix:
                out.append((sample.labels, sample.value))
    return out


def _single(metric: Any, suffix: str) -> float:
    samples = _samples(metric, suffix)
    return samples[0][1] if samples else 0.0


def _sum_by(metric: Any, label: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for labels, value in _samples(metric, "_total"):
        totals[labels[label]] = totals.get(labels[label], 0) + value
    return totals


def request_started(scope: Scope) -> float:
    """When the gateway received the request (set by RequestMetrics), for TTFT and durations."""
    state = scope.get("state") or {}
    return float(state.get("t0", time.perf_counter()))


def mark_disconnected(scope: Scope) -> None:
    scope.setdefault("state", {})["disconnected"] = True


class RequestMetrics:
    """Pure ASGI (no buffering, no extra task): counts each request and times it to its last byte."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        scope.setdefault("state", {})["t0"] = t0
        status = "500"
        finished = False

        async def send_probe(message: Message) -> None:
            nonlocal status, finished
            if message["type"] == "http.response.start":
                status = str(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        route = route_of(scope["path"])
        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_probe)
        finally:
            self.metrics.in_flight.dec()
            if scope["state"].get("timed_out"):
                status = TIMED_OUT_STATUS
            elif scope["state"].get("disconnected") or (not finished and status != "500"):
                status = DISCONNECTED_STATUS
            self.metrics.labelled(self.metrics.requests, route, status).inc()
            self.metrics.labelled(self.metrics.request_duration, route).observe(time.perf_counter() - t0)
