"""The OpenAI API: llama-server's own, passed through byte for byte with the domain added.

Generation requests are read only to decide their domain; the client's original body goes to
llama unchanged, and the answer comes back unchanged (SSE relayed per upstream read, `[DONE]`
included). Every other /v1 route is passed through with its method, query, body and headers.

The generation handlers (`chat_completions`, `completions`) are registered in generation_routes.py,
with Ollama's; the rest of the API on `router`.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response

from moe_l2_contracts.schemas.openai import ChatCompletionRequestView, CompletionRequestView, ErrorBody, ErrorDetail
from moe_l2_proxy.domain import Decision
from moe_l2_proxy.errors import GatewayError, client_mistake, error_response, gateway_error_response
from moe_l2_proxy.gateway import ClientDisconnected, Gateway, gateway, parse_body, until_disconnect
from moe_l2_proxy.metrics import request_started
from moe_l2_proxy.streaming import RelayResponse, SseObserver, relay_raw
from moe_l2_proxy.upstream import DOMAIN_HEADER, LlamaUpstream, response_headers

router = APIRouter()

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def prompt_text(prompt: str | list[str] | list[int] | list[list[int]]) -> str:
    """The text of a completions prompt (token-id prompts have none to classify)."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(p for p in prompt if isinstance(p, str))


async def chat_completions(request: Request) -> Response:
    gw = gateway(request)
    body = await request.body()
    view = parse_body(body, ChatCompletionRequestView)
    decision = await gw.domains.for_messages(request.headers.get(DOMAIN_HEADER), view.messages)
    return await generate(request, gw, body, decision, bool(view.stream))


async def completions(request: Request) -> Response:
    gw = gateway(request)
    body = await request.body()
    view = parse_body(body, CompletionRequestView)
    decision = await gw.domains.for_text(request.headers.get(DOMAIN_HEADER), prompt_text(view.prompt))
    return await generate(request, gw, body, decision, bool(view.stream))


def target(request: Request) -> str:
    """The request target as the client sent it (still percent-encoded), query included."""
    scope = request.scope
    path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    query = scope.get("query_string", b"").decode("latin-1")
    return f"{path}?{query}" if query else path


def sse_error(gw: Gateway, exc: httpx.HTTPError) -> bytes:
    """The last event of a stream whose upstream failed midway (headers are already sent)."""
    failure = gw.llamas.transport_error(exc)
    return sse_error_event(failure.message, failure.code)


def sse_error_event(message: str, code: str | None) -> bytes:
    body = ErrorBody(error=ErrorDetail(message=message, type="server_error", code=code))
    return b"data: " + body.model_dump_json().encode() + b"\n\n"


def shutdown_event(message: str) -> bytes:
    """The last event of a stream the gateway ends at the end of its shutdown grace (drain.py)."""
    return sse_error_event(message, "shutting_down")


async def generate(request: Request, gw: Gateway, body: bytes, decision: Decision, stream: bool) -> Response:
    gw.record(decision)
    extra = decision.headers()
    headers = gw.llamas.forward_headers(request.headers.items(), decision.domain)
    path = target(request)

    def send(llama: LlamaUpstream) -> Awaitable[httpx.Response]:
        return llama.send("POST", path, headers=headers, content=body, stream=stream)

    try:
        lease, upstream = await until_disconnect(request, gw.llamas.send(decision.domain, send))
    except GatewayError as exc:
        return gateway_error_response(request.url.path, exc, headers=extra)
    except ClientDisconnected:
        return Response(status_code=499)
    if not await lease.held_by_stream(upstream, stream):
        if (message := client_mistake(upstream.status_code, upstream.content)) is not None:
            return error_response(request.url.path, 400, message, code="invalid_request", headers=extra)
        count_blocking_tokens(gw, upstream)
        return Response(upstream.content, upstream.status_code, headers={**response_headers(upstream), **extra})
    route = request.url.path
    observer = SseObserver(gw.metrics, route, request_started(request.scope))
    chunks = relay_raw(upstream, lambda exc: sse_error(gw, exc), observer)
    return RelayResponse(
        chunks,
        upstream,
        headers={**response_headers(upstream), **_SSE_HEADERS, **extra},
        on_close=lambda: (observer.finish(), lease.release()),
        tail=shutdown_event,
    )


def count_blocking_tokens(gw: Gateway, upstream: httpx.Response) -> None:
    if upstream.status_code != 200:
        return
    try:
        usage = json.loads(upstream.content).get("usage") or {}
    except (ValueError, AttributeError):
        return
    gw.metrics.count_tokens(int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))


@router.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
async def passthrough(request: Request, path: str) -> Response:
    """Any other /v1 route (models, embeddings, responses, ...) as it is, streamed back as it comes."""
    gw = gateway(request)
    body = await request.body()
    domain = gw.domains.header_domain(request.headers.get(DOMAIN_HEADER))
    headers = gw.llamas.forward_headers(request.headers.items(), domain)
    path = target(request)

    def send(llama: LlamaUpstream) -> Awaitable[httpx.Response]:
        return llama.send(request.method, path, headers=headers, content=body or None, stream=True)

    try:
        lease, upstream = await until_disconnect(request, gw.llamas.send(domain, send, hint=False))
    except GatewayError as exc:
        return gateway_error_response(request.url.path, exc)
    except ClientDisconnected:
        return Response(status_code=499)
    if upstream.status_code == 500:
        # an error JSON, small: read whole to tell the client's mistakes from llama's own failures
        try:
            await upstream.aread()
            await upstream.aclose()
        finally:
            lease.release()
        if (message := client_mistake(upstream.status_code, upstream.content)) is not None:
            return error_response(request.url.path, 400, message, code="invalid_request")
        return Response(upstream.content, upstream.status_code, headers=response_headers(upstream))
    return RelayResponse(
        relay_raw(upstream, lambda exc: sse_error(gw, exc)),
        upstream,
        status_code=upstream.status_code,
        headers=response_headers(upstream),
        on_close=lease.release,
        # an event stream (a generation through another /v1 route) ends with an error event; other bodies
        # can only stop
        tail=shutdown_event if upstream.headers.get("content-type", "").startswith("text/event-stream") else None,
    )
