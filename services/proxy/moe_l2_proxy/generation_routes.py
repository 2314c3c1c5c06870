"""The generation routes, registered once: this table is where they are declared.

Chat and completion requests are nearly all of the gateway's traffic, so `GenerationDispatch`
(dispatch.py, with the measured reason) answers their POSTs ahead of FastAPI's router. Everything
else is made from the same table, so the three views of these routes cannot drift apart:
- the dispatcher's path -> handler map (`handlers`);
- FastAPI's routes (`register`): the POSTs never reach them, but they make every other request
  to these paths answer as FastAPI does for any route: another method is a 405 with `Allow: POST`
  in the API's error format (on /v1, the methods the passthrough takes go on to llama, as for any
  other /v1 path), a trailing slash is redirected;
- the published API's operations (openapi.py `build_document`): summary, request and answer models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fastapi import FastAPI
from pydantic import BaseModel

from moe_l2_contracts.schemas import ollama, openai
from moe_l2_proxy import ollama_api, openai_api
from moe_l2_proxy.dispatch import Handler

Api = Literal["openai", "ollama"]


@dataclass(frozen=True)
class GenerationRoute:
    path: str  # answered for POST
    handler: Handler
    api: Api  # whose error format and schemas
    summary: str
    request: type[BaseModel]  # the body the handler parses
    answer: type[BaseModel]  # the blocking answer (a stream carries its parts)


GENERATION_ROUTES: tuple[GenerationRoute, ...] = (
    GenerationRoute(
        "/v1/chat/completions",
        openai_api.chat_completions,
        "openai",
        "Chat completion",
        openai.ChatCompletionRequestView,
        openai.ChatCompletion,
    ),
    GenerationRoute(
        "/v1/completions",
        openai_api.completions,
        "openai",
        "Text completion",
        openai.CompletionRequestView,
        openai.Completion,
    ),
    GenerationRoute("/api/chat", ollama_api.chat, "ollama", "Chat", ollama.ChatRequest, ollama.ChatResponse),
    GenerationRoute(
        "/api/generate", ollama_api.generate, "ollama", "Generate", ollama.GenerateRequest, ollama.GenerateResponse
    ),
)


def handlers() -> dict[str, Handler]:
    """The dispatcher's table: POST path -> handler."""
    return {route.path: route.handler for route in GENERATION_ROUTES}


def register(app: FastAPI) -> None:
    """The same routes on FastAPI's router, for what the dispatcher leaves to it (see above). Call
    before the /v1 passthrough is included: Starlette takes the first route whose path matches, and
    the passthrough's would otherwise answer these paths' 405 with its own list of methods."""
    for route in GENERATION_ROUTES:
        app.add_api_route(route.path, route.handler, methods=["POST"], include_in_schema=False)
