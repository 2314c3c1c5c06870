"""Errors in each API's own format: OpenAI's error JSON on /v1 (and elsewhere), `{"error": "..."}` on /api."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_l2_contracts.schemas.ollama import ErrorBody as OllamaErrorBody
from moe_l2_contracts.schemas.openai import ErrorBody, ErrorDetail

log = logging.getLogger("moe_l2_proxy")

# OpenAI's error `type` for each status the gateway produces
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


# statuses that mean "retry later": overloaded (429) or unavailable for now (503)
_RETRY_LATER = frozenset({429, 503})


class GatewayError(Exception):
    """An error the gateway answers itself (bad request, upstream unreachable, ...)."""

    def __init__(self, status: int, message: str, code: str | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.error_type = error_type or _TYPES.get(status, "server_error")


# llama-server answers 400 for the request errors it throws as std::invalid_argument, but 500 for
# those raised another way while it reads the request (source: tools/server/server.cpp ex_wrapper,
# common/chat.cpp, server-common.cpp of the pinned llama.cpp). These are the 500 messages that can
# only come from the client's request, each checked against the real llama-server in the tests;
# every other 500 stays a 500.
_CLIENT_MISTAKES = re.compile(
    "|".join(
        (
            # common/chat.cpp rethrows its own checks of `messages` / `tools` (wrong types, a missing
            # role, a null text part, a tool of an unknown type) as runtime errors with these prefixes
            r"Failed to parse messages: ",
            r"Failed to parse tools: ",
            # media parts sent to a model that has no projector (mmproj) for them
            r"(image|audio|video) input is not supported - ",
            r"Multimodal data provided, but model does not support multimodal requests",
            # media parts whose bytes do not decode
            r"Invalid base64 value$",
            r"Failed to load image or audio file$",
            # the body itself, which llama parses first in every handler (json::parse(req.body)): numbers
            # Python's JSON reader accepts but nlohmann's refuses (NaN, Infinity, 1e400)
            r"\[json\.exception\.parse_error\.\d+\] ",
            r"\[json\.exception\.out_of_range\.406\] ",
            # request parameters llama-server cannot serve in this configuration
            r"tools param requires --jinja flag$",
            r"tool_choice param requires --jinja flag$",
            r"Cannot use both json_schema and grammar$",
            r"Unsupported param: ",
            r"Only no echo is supported$",
        )
    )
)


def client_mistake(status: int, content: bytes) -> str | None:
    """llama's message when its error answer is a 500 caused by the client's request, else None."""
    if status != 500 or len(content) > 65536:
        return None
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(error, dict) or error.get("type") != "server_error":
        return None
    message = error.get("message")
    if isinstance(message, str) and _CLIENT_MISTAKES.match(message):
        return message
    return None


def is_ollama_path(path: str) -> bool:
    return path == "/api" or path.startswith("/api/")


def error_response(
    path: str,
    status: int,
    message: str,
    code: str | None = None,
    error_type: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    if is_ollama_path(path):
        body = OllamaErrorBody(error=message).model_dump()
    else:
        detail = ErrorDetail(message=message, type=error_type or _TYPES.get(status, "server_error"), code=code)
        body = ErrorBody(error=detail).model_dump()
    if status in _RETRY_LATER and not any(name.lower() == "retry-after" for name in headers or {}):
        # every "not now" the gateway answers says when to come back, so clients and balancers retry
        # instead of failing (and do not hammer it at once)
        headers = {**(headers or {}), "retry-after": "1"}
    return JSONResponse(body, status_code=status, headers=headers)


def gateway_error_response(path: str, exc: GatewayError, headers: dict[str, str] | None = None) -> JSONResponse:
    return error_response(path, exc.status, exc.message, exc.code, exc.error_type, headers)


async def _gateway_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, GatewayError)
    return gateway_error_response(request.url.path, exc)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else "error"
    if exc.status_code == 404:
        message = f"no route for {request.method} {request.url.path}"
    return error_response(request.url.path, exc.status_code, message, headers=exc.headers)


def describe_validation(errors: Sequence[Any]) -> str:
    """`loc: msg` of each validation error, never the offending input (it may be prompt text)."""
    parts = []
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{loc}: {err.get('msg', 'invalid')}" if loc else str(err.get("msg", "invalid")))
    return "; ".join(parts) or "invalid request"


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(request.url.path, 400, describe_validation(exc.errors()), code="invalid_request")


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(request.url.path, 500, "internal gateway error", code="internal_error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected_error)
