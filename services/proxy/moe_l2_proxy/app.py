"""The gateway application: FastAPI routes, pure-ASGI layers around them, one httpx client per upstream."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http.cookiejar import Cookie, CookieJar

import httpx
from fastapi import FastAPI
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp

from moe_l2_domains.keywords import KeywordClassifier
from moe_l2_proxy import generation_routes, ollama_api, openai_api, ops_api
from moe_l2_proxy.auth import ApiKeyAuth
from moe_l2_proxy.cors import Cors, OriginPolicy
from moe_l2_proxy.dispatch import GenerationDispatch
from moe_l2_proxy.domain import DomainResolver
from moe_l2_proxy.drain import Drain, DrainGuard
from moe_l2_proxy.errors import install_error_handlers
from moe_l2_proxy.gateway import Gateway, on_client_disconnect
from moe_l2_proxy.http1_transport import Http1Transport
from moe_l2_proxy.limits import BodyLimit
from moe_l2_proxy.metrics import GatewayMetrics, RequestMetrics
from moe_l2_proxy.predictor_pool import PredictorPool
from moe_l2_proxy.replicas import LlamaPool
from moe_l2_proxy.settings import ProxySettings

log = logging.getLogger("moe_l2_proxy")


def llama_transport(settings: ProxySettings, metrics: GatewayMetrics) -> httpx.AsyncBaseTransport:
    """The transport under the llama client: the only place that knows which one it is."""
    limits = httpx.Limits(
        max_connections=settings.llama_max_connections,
        max_keepalive_connections=min(settings.llama_max_connections, 128),
        keepalive_expiry=4.0,  # under llama-server's keep-alive timeout (5 s), so it never closes first
    )
    if settings.llama_transport == "httpx":
        return httpx.AsyncHTTPTransport(limits=limits)
    # the per-token relay path: httptools instead of httpcore/h11/anyio (see http1_transport)
    return Http1Transport(limits, on_retry=lambda: metrics.upstream_errors.labels("llama", "retried").inc())


class NoCookies(CookieJar):
    """A jar that keeps nothing. The llama client is shared by every user: a cookie set on one answer
    must never ride on another request. httpx still offers every response to the jar, and reading
    its Set-Cookie headers for nothing cost ~13 µs of CPU per request here."""

    def extract_cookies(self, response: object, request: object) -> None:
        return

    def set_cookie(self, cookie: Cookie) -> None:
        return


def llama_client(settings: ProxySettings, transport: httpx.AsyncBaseTransport) -> httpx.AsyncClient:
    """The one client of every llama replica (requests name the replica's URL)."""
    return httpx.AsyncClient(
        cookies=NoCookies(),
        timeout=httpx.Timeout(
            connect=settings.llama_connect_timeout_s,
            read=settings.llama_read_timeout_s,
            write=60.0,
            # waiting for a free connection: relayed requests wait in the gateway's admission queue
            # (limits.Admission) instead, so this is only a backstop for the gateway's own requests
            pool=settings.wait_timeout_s,
        ),
        transport=transport,
    )


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
    transport = llama_transport(settings, metrics)
    llama_http = llama_client(settings, transport)
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
    hint_http = cache_client(settings) if settings.cache_url_list else None
    resolver = DomainResolver(predictors, settings.predict_budget_ms / 1000, KeywordClassifier())
    llamas = LlamaPool(settings, metrics, llama_http, transport, hint_http, resolver.header.known)
    await llamas.start()
    app.state.gateway = Gateway(settings, metrics, llamas, resolver, predictors)
    settle_heap()
    log.info(
        "gateway ready: llama %s (%s routing), predictors %s, cache-manager %s",
        ", ".join(r.url for r in llamas.replicas) or "none",
        settings.routing,
        ", ".join(settings.predictor_url_list) or "none",
        ", ".join(settings.cache_url_list) or "none",
    )
    try:
        yield
    finally:
        await llamas.stop()
        if predictors is not None:
            await predictors.stop()
        for client in (predict_http, hint_http, llama_http):
            if client is not None:
                await client.aclose()


class GatewayApp(FastAPI):
    """FastAPI with the gateway's own ASGI layers around it: metrics outermost (they see every answer),
    then the drain (drain.py), CORS (preflights carry no credentials), auth (before any body is read),
    the body limit, and the generation routes' dispatch."""

    def build_middleware_stack(self) -> ASGIApp:
        settings: ProxySettings = self.state.settings
        app = GenerationDispatch(super().build_middleware_stack(), generation_routes.handlers())
        app = BodyLimit(app, max_bytes=settings.max_body_bytes)
        app = ApiKeyAuth(app, keys=settings.api_key_list)
        app = Cors(app, OriginPolicy(settings.origin_list))
        # inside the metrics, so what a drain refuses is counted; outside everything else, so a
        # draining gateway answers before any other work
        app = DrainGuard(app, self.state.drain)
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
    app.state.drain = Drain(settings.drain_s)
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnect, on_client_disconnect)
    app.include_router(ops_api.router)
    generation_routes.register(app)  # before the /v1 passthrough (see `register`)
    app.include_router(openai_api.router)
    app.include_router(ollama_api.router)
    return app
