"""The gateway application: FastAPI routes, pure-ASGI layers around them, one httpx client per upstream."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp

from moe_l2_domains.keywords import KeywordClassifier
from moe_l2_proxy import ollama_api, openai_api, ops_api
from moe_l2_proxy.auth import ApiKeyAuth
from moe_l2_proxy.cors import Cors, OriginPolicy
from moe_l2_proxy.dispatch import GenerationDispatch
from moe_l2_proxy.domain import DomainResolver
from moe_l2_proxy.errors import install_error_handlers
from moe_l2_proxy.gateway import Gateway, on_client_disconnect
from moe_l2_proxy.hints import HintSender
from moe_l2_proxy.limits import BodyLimit
from moe_l2_proxy.metrics import GatewayMetrics, RequestMetrics
from moe_l2_proxy.predictor_pool import PredictorPool
from moe_l2_proxy.settings import ProxySettings
from moe_l2_proxy.upstream import LlamaUpstream

log = logging.getLogger("moe_l2_proxy")


def predictor_client(settings: ProxySettings) -> httpx.AsyncClient:
    # The budget bounds every call (asyncio.wait_for); these only stop a call that outlives it.
    budget_s = max(settings.predict_budget_ms / 1000, 0.001)
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=budget_s, read=budget_s, write=budget_s, pool=budget_s),
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64, keepalive_expiry=30.0),
    )


def cache_client(settings: ProxySettings) -> httpx.AsyncClient:
    timeout = settings.hint_timeout_s
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=timeout, read=timeout, write=timeout, pool=timeout),
        limits=httpx.Limits(max_connections=4, max_keepalive_connections=2),
    )


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: ProxySettings = app.state.settings
    metrics: GatewayMetrics = app.state.metrics
    llama = LlamaUpstream(settings, metrics)
    predictors: PredictorPool | None = None
    predict_http: httpx.AsyncClient | None = None
    if settings.predictor_url_list and settings.predict_budget_ms > 0:
        predict_http = predictor_client(settings)
        predictors = PredictorPool(
            settings.predictor_url_list,
            predict_http,
            metrics,
            cooldown_s=settings.predictor_cooldown_s,
            dns_refresh_s=settings.predictor_dns_refresh_s,
        )
        await predictors.start()
    hints: HintSender | None = None
    hint_http: httpx.AsyncClient | None = None
    if settings.cache_url:
        hint_http = cache_client(settings)
        hints = HintSender(settings.cache_url, hint_http, metrics, settings.hint_queue_size)
        hints.start()
    resolver = DomainResolver(predictors, settings.predict_budget_ms / 1000, KeywordClassifier())
    app.state.gateway = Gateway(settings, metrics, llama, resolver, predictors, hints)
    settle_heap()
    log.info(
        "gateway ready: llama %s, predictors %s, cache-manager %s",
        llama.url,
        ", ".join(settings.predictor_url_list) or "none",
        settings.cache_url or "none",
    )
    try:
        yield
    finally:
        if hints is not None:
            await hints.stop()
        if predictors is not None:
            await predictors.stop()
        for client in (predict_http, hint_http):
            if client is not None:
                await client.aclose()
        await llama.aclose()


class GatewayApp(FastAPI):
    """FastAPI with the gateway's own ASGI layers around it: metrics outermost (they see every answer),
    then CORS (preflights carry no credentials), auth (before any body is read), the body limit, and
    the generation routes' dispatch."""

    def build_middleware_stack(self) -> ASGIApp:
        settings: ProxySettings = self.state.settings
        routes = {
            "/v1/chat/completions": openai_api.chat_completions,
            "/v1/completions": openai_api.completions,
            "/api/chat": ollama_api.chat,
            "/api/generate": ollama_api.generate,
        }
        app = GenerationDispatch(super().build_middleware_stack(), routes)
        app = BodyLimit(app, max_bytes=settings.max_body_bytes)
        app = ApiKeyAuth(app, keys=settings.api_key_list)
        app = Cors(app, OriginPolicy(settings.origin_list))
        return RequestMetrics(app, metrics=self.state.metrics)


def settle_heap() -> None:
    """Moves everything built at startup (modules, FastAPI's routes, pydantic schemas, the keyword
    tier: most of the heap) out of the garbage collector's reach. Requests allocate many short-lived
    objects, and every older-generation collection would otherwise walk that whole startup heap: on
    the demo model that was ~7% of the gateway's CPU per streamed token."""
    gc.collect()
    gc.freeze()


def create_app(settings: ProxySettings | None = None) -> FastAPI:
    settings = settings or ProxySettings()
    app = GatewayApp(
        title="moe-l2 gateway",
        description="OpenAI- and Ollama-compatible gateway in front of the patched llama-server",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.settings = settings
    app.state.metrics = GatewayMetrics()
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnect, on_client_disconnect)
    app.include_router(ops_api.router)
    app.include_router(openai_api.router)
    app.include_router(ollama_api.router)
    return app
