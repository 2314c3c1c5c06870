"""Client connections: bounded in number, and closed when a client stalls while sending its request.

uvicorn (httptools) times out only an idle keep-alive connection, and only after a first response:
a connection that sends nothing, half a request head or half a body stays open for good, and
`limit_concurrency` answers uvicorn's own plain-text 503 but also counts requests in flight, so
long streams would refuse new clients. `GuardedProtocol` is uvicorn's own `HttpToolsProtocol`
(same parser, same ASGI cycle) with three checks added at the parser callbacks it already has:

- the request head (request line and headers) must arrive whole within `header_timeout_s` of the
  connection opening or of the head's first byte (a total, so a client dripping one byte at a time
  is cut too), and be at most `max_header_bytes`: else 408 / 431 and close;
- while a body is coming, at most `body_timeout_s` of silence: else 408 if no answer has started
  (the handler waiting for the body sees a disconnect; the request is counted as 408), a plain
  close otherwise. Time during which the gateway itself paused reading (flow control) is not
  the client's silence;
- a connection opened while `max_connections` are already open is answered 503 (JSON, `Retry-After`)
  as soon as its request head is in, and closed; but `GET /healthz` is answered (busy is not dead).

Between requests uvicorn's keep-alive timeout (MOE_L2_PROXY_KEEP_ALIVE_S) still applies; once a request
is read, nothing here limits how long the answer takes. No parsing is done here: the callbacks
only move the phase along. These are internals of uvicorn's protocol class (stable across its
releases since 0.13); tests/proxy/test_connections.py checks every case against the running server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from moe_l2_proxy.errors import error_response
from moe_l2_proxy.metrics import GatewayMetrics, route_of
from moe_l2_proxy.settings import ProxySettings

# what a refused connection's request body may be drained of before the 503, so the client reads
# the answer instead of a reset (closing a socket with unread data makes the kernel send RST)
_DRAIN_LIMIT = 1 << 20


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_header_bytes: int
    max_connections: int

    @classmethod
    def from_settings(cls, settings: ProxySettings) -> ConnectionLimits:
        return cls(
            header_timeout_s=settings.header_timeout_s,
            body_timeout_s=settings.body_timeout_s,
            max_header_bytes=settings.max_header_bytes,
            max_connections=settings.max_connections,
        )


def error_message(path: str, status: int, message: str, code: str, extra: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection, body in the API's error format."""
    error_type = "invalid_request_error" if status < 500 else "server_error"
    body = bytes(error_response(path, status, message, code=code, error_type=error_type).body)
    head = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{name}: {value}" for name, value in (extra or {}).items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def refusal_app(limits: ConnectionLimits, metrics: GatewayMetrics) -> Callable[[Scope, Receive, Send], Any]:
    limit = limits.max_connections
    message = f"the gateway has too many open connections (MOE_L2_PROXY_MAX_CONNECTIONS={limit}); retry later"

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        drained = 0
        more = True
        while more and drained <= _DRAIN_LIMIT:
            event = await receive()
            drained += len(event.get("body", b""))
            more = event["type"] == "http.request" and event.get("more_body", False)
        metrics.labelled(metrics.requests, route_of(scope["path"]), "503").inc()
        response = error_response(scope["path"], 503, message, code="too_many_connections")
        response.headers["retry-after"] = "1"
        response.headers["connection"] = "close"
        await response(scope, receive, send)

    return refuse


def guarded_protocol(limits: ConnectionLimits, metrics: GatewayMetrics) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with these limits (pass as `uvicorn.run(..., http=...)`)."""
    refuse = refusal_app(limits, metrics)

    def closed(reason: str) -> None:
        metrics.labelled(metrics.connections_closed, reason).inc()

    class GuardedProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._timer: asyncio.TimerHandle | None = None
            self._phase = "head"  # head: waiting for a request head; body: reading its body; app: all read
            self._head_bytes = 0
            self._refused = False

        # connection

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            metrics.client_connections.inc()
            self._refused = len(self.connections) > limits.max_connections
            self._arm(limits.header_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            metrics.client_connections.dec()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._phase == "head":
                if self._timer is None:
                    self._arm(limits.header_timeout_s)  # the first byte of a request on a kept-alive connection
                self._head_bytes += len(data)
            super().data_received(data)
            if self._phase == "head" and self._head_bytes > limits.max_header_bytes and not self.transport.is_closing():
                closed("head_too_large")
                self._answer_and_close(
                    431, f"the request head is larger than {limits.max_header_bytes} bytes", "request_head_too_large"
                )

        # parser callbacks (uvicorn's, extended)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._phase = "head"
            if self._timer is None:
                self._arm(limits.header_timeout_s)

        def on_headers_complete(self) -> None:
            self._phase = "body"
            self._head_bytes = 0
            self._arm(limits.body_timeout_s)
            if not self._refused or self.url.partition(b"?")[0] == b"/healthz":
                # liveness is answered even over the limit: a gateway with too many clients is busy,
                # not dead, and an orchestrator that restarted it would drop every one of them
                super().on_headers_complete()
                return
            closed("over_limit")
            app, self.app = self.app, refuse  # type: ignore[assignment]
            try:
                super().on_headers_complete()
            finally:
                self.app = app
            self.cycle.keep_alive = False

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            self._arm(limits.body_timeout_s)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()
            if self.cycle.response_complete:
                # answered before its body was read (413, 401): uvicorn's keep-alive timer was spent on
                # that body, so the next request head gets the head timeout instead
                self._phase = "head"
                self._arm(limits.header_timeout_s)
            else:
                self._phase = "app"

        def on_response_complete(self) -> None:
            if self._phase == "app":
                self._phase = "head"  # uvicorn's keep-alive timeout covers the wait for the next request
            super().on_response_complete()

        def handle_websocket_upgrade(self) -> None:
            # the connection is handed to uvicorn's WebSocket protocol, which has its own timeouts
            self._disarm()
            self._phase = "upgraded"
            super().handle_websocket_upgrade()

        # timers

        def _arm(self, delay: float) -> None:
            self._disarm()
            self._timer = self.loop.call_later(delay, self._expired, delay)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self, delay: float) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            busy = self.cycle is not None and not self.cycle.response_complete and self._phase == "head"
            if self.flow.read_paused or busy:
                # the gateway itself is not reading (a body it has not consumed yet, or a pipelined
                # request waiting for the answer before it): not the client's silence
                self._arm(delay)
                return
            if self._phase == "head":
                closed("head_timeout")
                self._answer_and_close(
                    408, f"the request head did not arrive within {limits.header_timeout_s:g} s", "request_timeout"
                )
            elif self._phase == "body" and self.cycle is not None:
                closed("body_timeout")
                self._body_timeout()

        def _body_timeout(self) -> None:
            cycle = self.cycle
            if cycle.response_started:
                self.transport.close()  # an answer is under way: nothing else can be said
                return
            # The handler is waiting for the body: it now sees a disconnect (cycle.disconnected makes
            # uvicorn drop whatever it still sends), and the request is counted as a 408.
            cycle.scope.setdefault("state", {})["timed_out"] = True
            cycle.disconnected = True
            cycle.message_event.set()
            message = f"no request body data for {limits.body_timeout_s:g} s"
            self._answer_and_close(408, message, "request_timeout", path=cycle.scope.get("path", ""))

        def _answer_and_close(self, status: int, message: str, code: str, path: str = "") -> None:
            self._disarm()
            self.transport.write(error_message(path, status, message, code))
            self.transport.close()

    return GuardedProtocol
