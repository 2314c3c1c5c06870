"""Errors in each API's own format: OpenAI's error JSON on /v1 (and elsewhere), `{"error": "..."}` on /api."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_l2_common.schemas.ollama import ErrorBody as OllamaErrorBody
from moe_l2_common.schemas.openai import ErrorBody, ErrorDetail

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


class GatewayError(Exception):
    """An error the gateway answers itself (bad request, upstream unreachable, ...)."""

    def __init__(self, status: int, message: str, code: str | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.error_type = error_type or _TYPES.get(status, "server_error")


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
