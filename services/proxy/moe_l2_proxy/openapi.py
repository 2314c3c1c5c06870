"""The gateway's published API (GET /openapi.json): the part of OpenAI's and Ollama's APIs it serves.

Built from the same pydantic models the handlers parse with (moe_l2_contracts.schemas), so the
document cannot drift from what is accepted; the generation operations come from the table that
registers those routes (generation_routes.py). FastAPI's own generator cannot be used: the
generation handlers are dispatched ahead of FastAPI's router (see dispatch.py) and read their
bodies themselves. Every `$ref` points into `components/schemas`, under the API's prefix
(`openai.`, `ollama.`), since both APIs have models of the same names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from moe_l2_contracts.schemas import ollama, openai
from moe_l2_proxy.generation_routes import GENERATION_ROUTES, GenerationRoute

JsonSchema = dict[str, Any]

OPENAI = "openai"
OLLAMA = "ollama"

_API_MODELS: dict[str, list[tuple[type[BaseModel], str]]] = {
    OPENAI: [
        (openai.ChatCompletionRequestView, "validation"),
        (openai.CompletionRequestView, "validation"),
        (openai.ChatCompletion, "serialization"),
        (openai.Completion, "serialization"),
        (openai.ModelList, "serialization"),
        (openai.ErrorBody, "serialization"),
    ],
    OLLAMA: [
        (ollama.ChatRequest, "validation"),
        (ollama.GenerateRequest, "validation"),
        (ollama.ShowRequest, "validation"),
        (ollama.ChatResponse, "serialization"),
        (ollama.GenerateResponse, "serialization"),
        (ollama.ModelList, "serialization"),
        (ollama.ShowResponse, "serialization"),
        (ollama.VersionResponse, "serialization"),
        (ollama.ErrorBody, "serialization"),
    ],
}


def ref(api: str, model: type[BaseModel]) -> JsonSchema:
    return {"$ref": f"#/components/schemas/{api}.{model.__name__}"}


def components() -> dict[str, JsonSchema]:
    schemas: dict[str, JsonSchema] = {}
    for api, models in _API_MODELS.items():
        _, defs = models_json_schema(models, ref_template=f"#/components/schemas/{api}.{{model}}")  # type: ignore[arg-type]
        for name, schema in defs.get("$defs", {}).items():
            schemas[f"{api}.{name}"] = schema
    return schemas


def json_content(schema: JsonSchema) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def error_responses(api: str) -> dict[str, Any]:
    body = ref(api, openai.ErrorBody if api == OPENAI else ollama.ErrorBody)
    return {
        "400": {"description": "the request is not valid", "content": json_content(body)},
        "default": {"description": "an error, in the API's own error format", "content": json_content(body)},
    }


def domain_header(known: Iterable[str]) -> JsonSchema:
    return {
        "name": "X-MoE-Domain",
        "in": "header",
        "required": False,
        "description": "the request's domain, instead of the predicted one; any other value is a 400",
        "schema": {"type": "string", "enum": sorted(known)},
    }


_STREAMS = {
    OPENAI: ("text/event-stream", "one JSON object per server-sent event"),
    OLLAMA: ("application/x-ndjson", "one JSON object per line"),
}


def generation(route: GenerationRoute, known: Iterable[str]) -> dict[str, Any]:
    api, request, answer = route.api, route.request, route.answer
    stream_type, streamed = _STREAMS[api]
    return {
        "post": {
            "summary": route.summary,
            "operationId": f"{api}_{request.__name__.removesuffix('RequestView').removesuffix('Request').lower()}",
            "parameters": [domain_header(known)],
            "requestBody": {"required": True, "content": json_content(ref(api, request))},
            "responses": {
                "200": {
                    "description": f"the answer (`stream: false`), or the stream of its parts ({streamed})",
                    "headers": {
                        "X-MoE-Domain": {"schema": {"type": "string"}, "description": "the domain used"},
                        "X-MoE-Domain-Source": {
                            "schema": {"type": "string", "enum": ["header", "predictor", "fallback"]},
                            "description": "where the domain came from",
                        },
                    },
                    "content": {**json_content(ref(api, answer)), stream_type: {"schema": {"type": "string"}}},
                },
                **error_responses(api),
            },
        }
    }


def read(operation: str, summary: str, answer: type[BaseModel], method: str = "get") -> dict[str, Any]:
    api = operation.split("_")[0]
    return {
        method: {
            "summary": summary,
            "operationId": operation,
            "responses": {
                "200": {"description": summary, "content": json_content(ref(api, answer))},
                **error_responses(api),
            },
        }
    }


def build_document(known_domains: Iterable[str], version: str, api_keys: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the gateway; `known_domains` are the values X-MoE-Domain accepts."""
    known = sorted(known_domains)
    show = read("ollama_show", "Show the served model", ollama.ShowResponse, method="post")
    show["post"]["requestBody"] = {"required": True, "content": json_content(ref(OLLAMA, ollama.ShowRequest))}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "moe-l2 gateway",
            "version": version,
            "description": "OpenAI- and Ollama-compatible API in front of the patched llama-server. Requests are "
            "tagged with a domain (X-MoE-Domain, else predicted) that steers the expert caches. Fields of "
            "the OpenAI requests that are not listed are passed to llama-server unchanged.",
        },
        "paths": {
            **{route.path: generation(route, known) for route in GENERATION_ROUTES},
            "/v1/models": read("openai_models", "List the served model", openai.ModelList),
            "/api/tags": read("ollama_tags", "List local models", ollama.ModelList),
            "/api/ps": read("ollama_ps", "List running models", ollama.ModelList),
            "/api/show": show,
            "/api/version": read("ollama_version", "Version of the Ollama API served", ollama.VersionResponse),
        },
        "components": {"schemas": components()},
    }
    if api_keys:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
