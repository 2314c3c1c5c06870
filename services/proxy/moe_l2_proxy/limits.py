"""Request body size limit (MOE_L2_PROXY_MAX_BODY_BYTES): 413 before reading a declared oversized body,
and as soon as a chunked one grows past the limit."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moe_l2_proxy.errors import GatewayError, error_response


def too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"request body larger than {limit} bytes", code="request_too_large")


def declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = declared_length(scope)
        if length is not None and length > self.max_bytes:
            exc = too_large(self.max_bytes)
            await error_response(scope["path"], 413, exc.message, exc.code)(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # raised inside the endpoint's body read, answered by the GatewayError handler
                    raise too_large(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)
