"""Prometheus metrics of one predictor process (its own registry, kept in app.state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# From 10 µs (keyword tier) to 1 s (a batch on a loaded core).
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)
CONFIDENCE_BUCKETS = (0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


class PredictorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "moe_l2_predictor_requests_total",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "moe_l2_predictor_latency_seconds",
            "time per prompt in each tier; `hybrid` is the whole prediction when tiers are combined",
            ["tier"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.predictions = Counter(
            "moe_l2_predictor_predictions_total",
            "predictions by domain and by the tier that answered",
            ["domain", "tier"],
            registry=self.registry,
        )
        self.tier_runs = Counter(
            "moe_l2_predictor_tier_runs_total",
            "prompts each tier ran on (the semantic tier is skipped when the cheap tiers are confident)",
            ["tier"],
            registry=self.registry,
        )
        self.confidence = Histogram(
            "moe_l2_predictor_confidence",
            "confidence of the answers",
            buckets=CONFIDENCE_BUCKETS,
            registry=self.registry,
        )
        self.info = Gauge(
            "moe_l2_predictor_info",
            "the tiers answering now and the taxonomy (value 1)",
            ["tiers", "taxonomy"],
            registry=self.registry,
        )
        self.tier_ready = Gauge(
            "moe_l2_predictor_tier_ready",
            "1 when the configured tier answers, 0 while it loads in the background or after it failed",
            ["tier"],
            registry=self.registry,
        )
