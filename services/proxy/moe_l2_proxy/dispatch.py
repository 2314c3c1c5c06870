"""The generation routes, dispatched ahead of FastAPI's router.

Chat and completion requests are nearly all of the gateway's traffic, and each streamed token of
their answers passes through every layer between the handler and the server. FastAPI adds four
of those (its error middlewares, exception wrapper and exit stack) plus routing and dependency
resolution per request; measured on the demo model, about a third of the gateway's CPU per
request. The handlers here take a plain `Request` and return a `Response`, so they run the same
code either way: this only skips the layers, and answers errors the way the app's handlers do.
Every other request (another method, another path) still goes through FastAPI. Which routes are
dispatched is declared once, in generation_routes.py, as are their FastAPI routes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from moe_l2_proxy.errors import GatewayError, error_response, gateway_error_response
from moe_l2_proxy.gateway import client_left

log = logging.getLogger("moe_l2_proxy")

Handler = Callable[[Request], Awaitable[Response]]


class GenerationDispatch:
    def __init__(self, app: ASGIApp, routes: Mapping[str, Handler]) -> None:
        self.app = app
        self.routes = routes  # POST path -> handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        response = await answer(handler, Request(scope, receive))
        await response(scope, receive, send)


async def answer(handler: Handler, request: Request) -> Response:
    """The handler's response, or the error response the app's exception handlers would give."""
    try:
        return await handler(request)
    except GatewayError as exc:
        return gateway_error_response(request.url.path, exc)
    except ClientDisconnect:  # the client left while its body was being read
        return client_left(request)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(request.url.path, 500, "internal gateway error", code="internal_error")
