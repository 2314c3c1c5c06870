"""The Ollama API, served by translating to llama-server's OpenAI API and back (ollama_translate).

The generation handlers (`chat`, `generate`) are registered in generation_routes.py, with OpenAI's;
the rest of the API on `router`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError

from moe_l2_contracts.schemas.ollama import (
    ChatRequest,
    GenerateRequest,
    ModelList,
    ShowRequest,
    ShowResponse,
    VersionResponse,
)
from moe_l2_contracts.schemas.openai import ModelList as OpenAIModelList
from moe_l2_contracts.schemas.predict import ChatMessage
from moe_l2_proxy.domain import Decision
from moe_l2_proxy.errors import GatewayError, client_mistake, error_response, gateway_error_response
from moe_l2_proxy.gateway import ClientDisconnected, Gateway, gateway, parse_body, until_disconnect
from moe_l2_proxy.metrics import request_started
from moe_l2_proxy.ollama_translate import (
    NEVER_EXPIRES,
    Kind,
    StreamTranslator,
    blocking_to_ollama,
    chat_to_openai,
    generate_to_openai,
    model_entry,
    now_rfc3339,
)
from moe_l2_proxy.streaming import RelayResponse, sse_payloads
from moe_l2_proxy.upstream import DOMAIN_HEADER, LlamaUpstream

router = APIRouter()

NDJSON = "application/x-ndjson"


@router.get("/")
@router.head("/")
async def root() -> PlainTextResponse:
    # what Ollama answers; some clients probe it before anything else
    return PlainTextResponse("Ollama is running")


@router.get("/api/version")
async def version(request: Request) -> VersionResponse:
    return VersionResponse(version=gateway(request).settings.ollama_version)


async def chat(request: Request) -> Response:
    gw = gateway(request)
    req = parse_body(await request.body(), ChatRequest)
    if not req.messages:
        return loaded(req.model, "chat")
    messages = [ChatMessage(role=m.role, content=m.content) for m in req.messages]
    decision = await gw.domains.for_messages(request.headers.get(DOMAIN_HEADER), messages)
    body = chat_to_openai(req)
    return await translate(request, gw, decision, "chat", req.model, "/v1/chat/completions", body, req.stream)


async def generate(request: Request) -> Response:
    gw = gateway(request)
    req = parse_body(await request.body(), GenerateRequest)
    if not req.prompt and not req.images:
        return loaded(req.model, "generate")
    decision = await gw.domains.for_text(request.headers.get(DOMAIN_HEADER), req.prompt)
    path, body = generate_to_openai(req)
    return await translate(request, gw, decision, "generate", req.model, path, body, req.stream)


def loaded(model: str, kind: Kind) -> JSONResponse:
    """Ollama's answer to a request without input: it (pre)loads the model; llama's is always loaded."""
    body: dict[str, Any] = {"model": model, "created_at": now_rfc3339(), "done": True, "done_reason": "load"}
    if kind == "chat":
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    return JSONResponse(body)


async def translate(
    request: Request,
    gw: Gateway,
    decision: Decision,
    kind: Kind,
    model: str,
    path: str,
    body: dict[str, Any],
    stream: bool,
) -> Response:
    gw.record(decision)
    extra = decision.headers()
    raw = path == "/v1/completions"
    t0 = request_started(request.scope)
    headers = gw.llamas.own_headers(decision.domain)
    content = json.dumps(body).encode()

    def send(llama: LlamaUpstream) -> Awaitable[httpx.Response]:
        return llama.send("POST", path, headers=headers, content=content, stream=stream)

    try:
        lease, upstream = await until_disconnect(request, gw.llamas.send(decision.domain, send))
    except GatewayError as exc:
        return gateway_error_response(request.url.path, exc, headers=extra)
    except ClientDisconnected:
        return Response(status_code=499)
    if not await lease.held_by_stream(upstream, stream):
        if upstream.status_code != 200:
            return upstream_error(request.url.path, upstream, extra)
        try:
            content = blocking_to_ollama(kind, model, upstream.content, raw, t0)
        except ValidationError:
            return error_response(request.url.path, 502, "llama-server sent an unexpected answer", headers=extra)
        count_tokens(gw, content)
        return Response(content, media_type="application/json; charset=utf-8", headers=extra)
    translator = StreamTranslator(kind, model, raw, t0)
    return RelayResponse(
        ndjson(gw, upstream, translator, request.url.path),
        upstream,
        headers=extra,
        media_type=NDJSON,
        on_close=lease.release,
        tail=error_line,
    )


async def ndjson(
    gw: Gateway, upstream: httpx.Response, translator: StreamTranslator, route: str
) -> AsyncIterator[bytes]:
    """One NDJSON line per generated fragment as llama produces it, then Ollama's final object."""
    try:
        async for payload in sse_payloads(upstream):
            if payload.startswith('{"error"'):
                yield error_line(upstream_message(payload.encode()))
                return
            try:
                out = translator.event(payload)
            except ValidationError:
                continue  # an event kind the translation does not know carries nothing for the client
            if out is None:
                continue
            if not translator.first_text_sent:
                translator.first_text_sent = True
                gw.metrics.labelled(gw.metrics.ttft, route).observe(time.perf_counter() - translator.t0)
            yield out
    except httpx.HTTPError as exc:
        yield error_line(gw.llamas.transport_error(exc).message)
        return
    final = translator.final()
    count_tokens(gw, final.rsplit(b"\n", 2)[-2])
    yield final


def error_line(message: str) -> bytes:
    return json.dumps({"error": message}).encode() + b"\n"


def count_tokens(gw: Gateway, final_line: bytes) -> None:
    try:
        final = json.loads(final_line)
    except ValueError:
        return
    gw.metrics.count_tokens(int(final.get("prompt_eval_count") or 0), int(final.get("eval_count") or 0))


def upstream_message(content: bytes) -> str:
    """The message of llama's OpenAI error JSON (or its raw text)."""
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return content.decode(errors="replace")[:500] or "llama-server error"
    if isinstance(error, dict):
        return str(error.get("message", "llama-server error"))
    return str(error)


def upstream_error(path: str, upstream: httpx.Response, headers: dict[str, str]) -> JSONResponse:
    if (message := client_mistake(upstream.status_code, upstream.content)) is not None:
        return error_response(path, 400, message, headers=headers)
    return error_response(path, upstream.status_code, upstream_message(upstream.content), headers=headers)


async def served_models(gw: Gateway) -> tuple[OpenAIModelList, dict[str, Any]]:
    models = OpenAIModelList.model_validate(await gw.llamas.get_json("/v1/models"))
    try:
        props = await gw.llamas.get_json("/props")
    except GatewayError:
        props = {}
    return models, props


@router.get("/api/tags")
async def tags(request: Request) -> JSONResponse:
    models, props = await served_models(gateway(request))
    ftype = str(props.get("model_ftype", ""))
    entries = [model_entry(card, ftype) for card in models.data]
    return JSONResponse(ModelList(models=entries).model_dump(exclude_none=True))


@router.get("/api/ps")
async def ps(request: Request) -> JSONResponse:
    models, props = await served_models(gateway(request))
    ftype = str(props.get("model_ftype", ""))
    n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
    entries = [
        # size_vram: where llama placed its weights is not visible from here; 0 claims nothing
        model_entry(card, ftype).model_copy(
            update={"expires_at": NEVER_EXPIRES, "size_vram": 0, "context_length": n_ctx}
        )
        for card in models.data
    ]
    return JSONResponse(ModelList(models=entries).model_dump(exclude_none=True))


@router.post("/api/show")
async def show(request: Request) -> JSONResponse:
    gw = gateway(request)
    req = parse_body(await request.body(), ShowRequest)
    models, props = await served_models(gw)
    if not models.data:
        raise GatewayError(404, f"model '{req.model or req.name}' not found")
    # llama-server serves one model under any name, so does the gateway
    card = models.data[0]
    meta = card.meta or {}
    entry = model_entry(card, str(props.get("model_ftype", "")))
    modalities = props.get("modalities") or {}
    capabilities = ["completion"] + (["vision"] if modalities.get("vision") else [])
    if (props.get("chat_template_caps") or {}).get("supports_tools"):
        capabilities.append("tools")
    info = {
        "general.parameter_count": meta.get("n_params"),
        "general.file_type": props.get("model_ftype"),
        "general.context_length": meta.get("n_ctx_train"),
        "general.embedding_length": meta.get("n_embd"),
        "general.vocab_size": meta.get("n_vocab"),
    }
    answer = ShowResponse(
        template=str(props.get("chat_template", "")),
        details=entry.details,
        model_info={k: v for k, v in info.items() if v is not None},
        capabilities=capabilities,
        modified_at=entry.modified_at,
    )
    return JSONResponse(answer.model_dump(exclude_none=True))
