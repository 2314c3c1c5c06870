"""Probes and figures: /healthz (alive), /readyz (llama reachable), /metrics (Prometheus), /moe/stats (JSON),
and the published API (/openapi.json)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from moe_l2_proxy.errors import GatewayError
from moe_l2_proxy.gateway import gateway
from moe_l2_proxy.openapi import build_document
from moe_l2_proxy.upstream import LlamaUpstream

router = APIRouter()


# llama-server's MoE counters (patch 0023): `llamacpp:moe_hot_hits_total{domain="codegen"} 123`
@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/openapi.json")
async def openapi(request: Request) -> JSONResponse:
    state = request.app.state
    # built once: the domains and settings it lists are fixed at startup
    if getattr(state, "openapi_document", None) is None:
        gw = gateway(request)
        state.openapi_document = build_document(
            gw.domains.header.known, request.app.version, api_keys=bool(gw.settings.api_key_list)
        )
    return JSONResponse(state.openapi_document)


async def replica_ready(llama: LlamaUpstream) -> str:
    """Why the replica cannot serve, or "" when its /health answers 200."""
    try:
        resp = await llama.get("/health", timeout_s=2.0)
    except httpx.HTTPError as exc:
        return f"llama-server unreachable ({type(exc).__name__})"
    return "" if resp.status_code == 200 else f"llama-server /health answered {resp.status_code}"


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Ready while at least one llama replica is."""
    gw = gateway(request)
    replicas = gw.llamas.replicas
    reasons = await asyncio.gather(*(replica_ready(r.upstream) for r in replicas))
    ready = any(not reason for reason in reasons)
    body: dict[str, Any] = {
        "status": "ready" if ready else "not ready",
        "llama": replicas[0].url if replicas else None,
        "replicas": [
            {"replica": r.key, "ready": not reason, **({"reason": reason} if reason else {})}
            for r, reason in zip(replicas, reasons, strict=True)
        ],
    }
    if not ready:
        body["reason"] = (
            reasons[0]
            if len(reasons) == 1
            else (
                f"no llama replica is ready ({len(replicas)} configured)"
                if replicas
                else "no llama replica is configured"
            )
        )
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(gateway(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


def parse_llama_moe_metrics(text: str) -> dict[str, Any]:
    """llama's hot-set hit/miss counters per domain and the overall hit rate."""
    per_metric: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("llamacpp:").removesuffix("_total")
            if sample.name.startswith("llamacpp:moe_") and set(sample.labels) <= {"domain"}:
                per_metric.setdefault(name, {})[sample.labels.get("domain", "")] = sample.value
    hits = per_metric.get("moe_hot_hits", {})
    misses = per_metric.get("moe_hot_misses", {})
    total_hits, total_misses = sum(hits.values()), sum(misses.values())
    counted = total_hits + total_misses
    return {
        "hits": hits,
        "misses": misses,
        "hit_rate": round(total_hits / counted, 4) if counted else None,
        "routed_tokens": per_metric.get("moe_routed_tokens", {}),
        "hot_set_experts": per_metric.get("moe_hot_set_experts", {}).get(""),
        "hot_set_switches": per_metric.get("moe_hot_set_switches", {}).get(""),
    }


async def llama_summary(llama: LlamaUpstream) -> dict[str, Any]:
    async def hot_set() -> dict[str, Any] | None:
        try:
            return await llama.get_json("/moe/hot-set", timeout_s=2.0)
        except GatewayError:
            return None

    async def moe_metrics() -> dict[str, Any] | None:
        try:
            resp = await llama.get("/metrics", timeout_s=2.0)
        except httpx.HTTPError:
            return None
        return parse_llama_moe_metrics(resp.text) if resp.status_code == 200 else None

    hot, counters = await asyncio.gather(hot_set(), moe_metrics())
    summary: dict[str, Any] = {"url": llama.url, "reachable": hot is not None or counters is not None}
    if hot is not None:
        # the experts themselves are long lists; the summary keeps their count per layer
        layers = hot.get("layers") or {}
        summary["hot_set"] = {
            "domain": hot.get("domain"),
            "version": hot.get("version"),
            "applied_version": hot.get("applied_version"),
            "n_experts": hot.get("n_experts"),
            "experts_per_layer": {layer: len(experts) for layer, experts in layers.items()},
        }
    if counters is not None:
        summary.update(counters)
    return summary


@router.get("/moe/stats")
async def stats(request: Request) -> dict[str, Any]:
    gw = gateway(request)
    summary = gw.metrics.summary()
    summary["predictor"]["endpoints"] = gw.predictors.describe() if gw.predictors else []
    summary["predictor"]["budget_ms"] = gw.settings.predict_budget_ms
    summary["hints"]["queued"] = gw.llamas.hints_queued()
    replicas = gw.llamas.describe()
    summaries = await asyncio.gather(*(llama_summary(r.upstream) for r in gw.llamas.replicas))
    for replica, llama in zip(replicas, summaries, strict=True):
        replica.update({key: llama.get(key) for key in ("reachable", "hits", "misses", "hit_rate")})
    summary["routing"] = {"policy": gw.llamas.policy.name, "epsilon": gw.settings.routing_epsilon}
    summary["replicas"] = replicas
    summary["llama"] = summaries[0] if summaries else {"url": None, "reachable": False}
    return summary
