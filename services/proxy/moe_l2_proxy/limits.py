"""Request body size limit (MOE_L2_PROXY_MAX_BODY_BYTES): 413 before reading a declared oversized body,
and as soon as a chunked one grows past the limit. Admission to llama (`Admission`): a bounded wait.
"""

from __future__ import annotations

import asyncio

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


class Admission:
    """The requests relayed to llama at once (MOE_L2_PROXY_LLAMA_MAX_CONNECTIONS), and a bounded wait
    for the rest: at most `max_waiting` wait, each at most `timeout_s`; beyond either, 503 with
    Retry-After. Without it, requests past the connection pool wait in httpx's pool (30 s each, in any
    number), and those that do get a connection wait inside llama-server (its slots are few, its queue
    has no bound) up to MOE_L2_PROXY_LLAMA_READ_TIMEOUT_S: under overload every client waits minutes
    instead of hearing at once that it should come back. A request holds its place from the choice
    of a replica to the end of its answer (a stream's last byte), retries on another replica included.
    """

    def __init__(self, limit: int, max_waiting: int, timeout_s: float) -> None:
        self.limit = limit
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.in_flight = 0
        self.waiting = 0
        self._places = asyncio.Semaphore(limit)

    async def acquire(self) -> None:
        if self._places.locked():
            if self.waiting >= self.max_waiting:
                raise overloaded(
                    f"the gateway has {self.in_flight} requests in flight to llama-server and {self.waiting} "
                    "waiting (MOE_L2_PROXY_MAX_WAITING); retry later"
                )
            self.waiting += 1
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._places.acquire()
            except TimeoutError:
                raise overloaded(
                    f"no llama-server connection was free within {self.timeout_s:g} s "
                    "(MOE_L2_PROXY_WAIT_TIMEOUT_S); retry later"
                ) from None
            finally:
                self.waiting -= 1
        else:
            await self._places.acquire()
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        self._places.release()


def overloaded(message: str) -> GatewayError:
    return GatewayError(503, message, code="overloaded")
