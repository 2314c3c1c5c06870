"""The predictor's HTTP API: POST /v1/predict, /v1/predict/batch, GET /v1/domains, /healthz, /metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.requests import ClientDisconnect

from moe_l2_contracts.schemas.errors import error_body
from moe_l2_contracts.schemas.predict import (
    PredictBatchRequest,
    PredictBatchResponse,
    PredictRequest,
    PredictResponse,
)
from moe_l2_predictor.metrics import PredictorMetrics
from moe_l2_predictor.predictor import Outcome, Predictor
from moe_l2_predictor.prompt import from_request
from moe_l2_predictor.semantic_loader import TierStatus, load_semantic_tier, show
from moe_l2_predictor.settings import PredictorSettings

log = logging.getLogger("moe_l2_predictor")

Model = TypeVar("Model", bound=BaseModel)

# nginx's "client closed request": the client left before its answer, nobody reads this status
CLIENT_CLOSED = 499
TIERS_HEADER = "X-MoE-Tiers"


class BadRequest(Exception):
    def __init__(self, status: int, kind: str, message: str, details: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.details = status, kind, message, details


def error(status: int, kind: str, message: str, details: list[dict[str, Any]] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind, details), status_code=status)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` bytes (announced or streamed)."""
    announced = request.headers.get("content-length")
    if announced and announced.isdigit() and int(announced) > limit:
        raise BadRequest(413, "too_large", f"request body over {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, "too_large", f"request body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse(model: type[Model], raw: bytes) -> Model:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False, include_context=False)
        if any(e["type"] == "json_invalid" for e in errors):
            raise BadRequest(400, "invalid_json", "the request body is not valid JSON") from exc
        details = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in errors][:20]
        raise BadRequest(422, "invalid_request", "the request does not match the schema", details) from exc


def record(metrics: PredictorMetrics, outcomes: list[Outcome], total_s: float) -> None:
    per_prompt = total_s / max(1, len(outcomes))
    for outcome in outcomes:
        if outcome.response.tier == "hybrid":
            metrics.latency.labels("hybrid").observe(per_prompt)
        for tier in outcome.tiers_run:
            metrics.tier_runs.labels(tier).inc()
            if tier in outcome.timings:
                metrics.latency.labels(tier).observe(outcome.timings[tier])
        metrics.predictions.labels(outcome.response.domain, outcome.response.tier).inc()
        metrics.confidence.observe(outcome.response.confidence)


def health(predictor: Predictor, status: TierStatus) -> dict[str, Any]:
    """/healthz: alive and answering with `tiers` (those answering now); `tier_status` says each
    configured tier's state, `unavailable` why a tier is off."""
    body: dict[str, Any] = {"status": "ok", **predictor.describe()}
    body["unavailable"] = {**status.failures(), **body["unavailable"]}
    body["tier_status"] = dict(status.states)
    return body


def tiers_header(outcomes: list[Outcome]) -> dict[str, str]:
    """X-MoE-Tiers: the tiers each answer came from (`;` between a batch's answers); the body's
    `tier` says only `hybrid` when several were combined."""
    return {TIERS_HEADER: ";".join(",".join(o.tiers_run) for o in outcomes)}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads its body itself (to bound its size first)."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def openapi_document(app: FastAPI, request_models: list[type[BaseModel]]) -> dict[str, Any]:
    """FastAPI's document plus the schemas of the request bodies, as components: each `$ref`
    resolves inside the document (a model's own JSON schema keeps its parts under a `$defs` of
    its own, which a `#/$defs/...` reference inside the document cannot reach)."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    _, defs = models_json_schema(
        [(m, "validation") for m in request_models], ref_template="#/components/schemas/{model}"
    )
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in defs.get("$defs", {}).items():
        components.setdefault(name, schema)
    return doc


def create_app(settings: PredictorSettings | None = None, predictor: Predictor | None = None) -> FastAPI:
    """The app. Unless a predictor is given, the lifespan builds one of the cheap tiers, which
    serves at once, and loads the semantic tier in the background (semantic_loader.py)."""
    settings = settings or PredictorSettings()
    app = FastAPI(title="moe-l2 predictor", version="0.1.0", lifespan=_lifespan(settings, predictor))
    app.state.settings = settings
    _prediction_routes(app)
    _ops_routes(app)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, [PredictRequest, PredictBatchRequest])
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _lifespan(
    settings: PredictorSettings, predictor: Predictor | None
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # a given predictor's configuration: the tiers it runs and those it had to leave off
        configured = settings.tier_list if predictor is None else (*predictor.tiers, *predictor.unavailable)
        later = predictor is None and "semantic" in configured
        if predictor is not None:
            serving = predictor
        elif later:
            serving = await anyio.to_thread.run_sync(Predictor.stand_in, settings)
        else:
            serving = await anyio.to_thread.run_sync(Predictor.from_settings, settings)
        app.state.predictor = serving
        app.state.tier_status = TierStatus(configured, serving.tiers, serving.unavailable)
        app.state.limiter = anyio.CapacityLimiter(settings.concurrency)
        app.state.metrics = PredictorMetrics()
        show(app.state.metrics, serving, app.state.tier_status)
        log.info(
            "predictor ready: tiers %s%s, taxonomy %s",
            ",".join(serving.tiers),
            " (semantic loading in the background)" if later else "",
            serving.taxonomy.source,
        )
        async with anyio.create_task_group() as tasks:
            if later:
                tasks.start_soon(load_semantic_tier, app.state, settings)
            yield
            tasks.cancel_scope.cancel()

    return lifespan


async def _run(request: Request, fn: Callable[[], list[Outcome]]) -> list[Outcome]:
    """The prediction on a worker thread, at most `concurrency` at once, recorded in the metrics."""
    started = time.perf_counter()
    outcomes = await anyio.to_thread.run_sync(fn, limiter=request.app.state.limiter)
    record(request.app.state.metrics, outcomes, time.perf_counter() - started)
    return outcomes


async def _handle(request: Request, endpoint: str, work: Callable[[bytes], Awaitable[Response]]) -> Response:
    """Reads the bounded body, runs `work` on it and counts the answer; a bad request is an error body."""
    metrics: PredictorMetrics = request.app.state.metrics
    try:
        raw = await read_body(request, request.app.state.settings.max_body_bytes)
        response = await work(raw)
    except BadRequest as exc:
        metrics.requests.labels(endpoint, str(exc.status)).inc()
        return error(exc.status, exc.kind, exc.message, exc.details)
    except ClientDisconnect:
        # the client left while sending its body (a gateway whose budget ran out, a killed
        # client): routine, not a server error, and there is no one to answer
        metrics.requests.labels(endpoint, str(CLIENT_CLOSED)).inc()
        return Response(status_code=CLIENT_CLOSED)
    metrics.requests.labels(endpoint, "200").inc()
    return response


def _prediction_routes(app: FastAPI) -> None:
    @app.post("/v1/predict", response_model=PredictResponse, openapi_extra=request_body(PredictRequest))
    async def predict(request: Request) -> Response:
        async def work(raw: bytes) -> Response:
            body = parse(PredictRequest, raw)
            prompt = from_request(body)
            predictor: Predictor = request.app.state.predictor
            [outcome] = await _run(request, lambda: predictor.predict_many([prompt]))
            if log.isEnabledFor(logging.DEBUG):
                log.debug("predict %r -> %s", prompt.main[:80], outcome.response.domain)
            return JSONResponse(outcome.response.model_dump(), headers=tiers_header([outcome]))

        return await _handle(request, "/v1/predict", work)

    @app.post("/v1/predict/batch", response_model=PredictBatchResponse, openapi_extra=request_body(PredictBatchRequest))
    async def predict_batch(request: Request) -> Response:
        async def work(raw: bytes) -> Response:
            body = parse(PredictBatchRequest, raw)
            prompts = [from_request(item) for item in body.items]
            predictor: Predictor = request.app.state.predictor
            outcomes = await _run(request, lambda: predictor.predict_many(prompts)) if prompts else []
            body = PredictBatchResponse(results=[o.response for o in outcomes]).model_dump()
            return JSONResponse(body, headers=tiers_header(outcomes))

        return await _handle(request, "/v1/predict/batch", work)


def _ops_routes(app: FastAPI) -> None:
    @app.get("/v1/domains")
    async def domains(request: Request) -> dict[str, Any]:
        predictor: Predictor = request.app.state.predictor
        request.app.state.metrics.requests.labels("/v1/domains", "200").inc()
        return {
            "fallback": predictor.taxonomy.fallback,
            "domains": [
                {
                    "name": d.name,
                    "description": d.description,
                    "languages": list(d.languages),
                    "absorbs": list(d.absorbs),
                    "keywords": len(d.keywords),
                    "examples": len(d.examples),
                }
                for d in predictor.taxonomy.domains
            ],
        }

    @app.get("/healthz")
    async def healthz(request: Request) -> dict[str, Any]:
        return health(request.app.state.predictor, request.app.state.tier_status)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
