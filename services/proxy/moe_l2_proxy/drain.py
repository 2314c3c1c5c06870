"""Shutdown that drains (MOE_L2_PROXY_DRAIN_S): SIGTERM ends the gateway without cutting the answers
it is giving.

uvicorn's own graceful shutdown closes the listening socket at once and, when its timeout ends,
cancels whatever still runs: a stream in flight then just stops (the client sees a connection cut
mid-answer, with no error event), and during the wait a probe cannot even connect, so it reads as a
crash rather than a drain. Here a first SIGTERM (or Ctrl-C) starts a drain instead:

- the gateway keeps listening: `/healthz` and `/readyz` answer 503 `{"status": "draining"}` (a load
  balancer or Kubernetes' readiness stops sending), `/metrics` is still served, and any other new
  request is answered 503 with `Retry-After` and `Connection: close` at once (a balancer retries it on
  another gateway; nothing new starts here that the grace could cut);
- the requests in flight go on; when the last one ends, the gateway exits (uvicorn's shutdown then
  has nothing left to wait for);
- at the end of the grace, each request still running is ended explicitly: a stream with an error
  event in its API's format (OpenAI's SSE `data: {"error": ...}`, Ollama's NDJSON `{"error": ...}`),
  a request not yet answered with 503 and `Retry-After` (its llama request is cancelled, which frees
  the slot). Only then is uvicorn told to exit.

A second signal ends the grace at once (the same explicit endings); a third Ctrl-C is uvicorn's
force-quit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moe_l2_proxy.errors import error_response

log = logging.getLogger("moe_l2_proxy.drain")

SCOPE_KEY = "moe_l2.drain"  # the request's Ticket in its ASGI scope (RelayResponse looks there)
PROBES = frozenset({"/healthz", "/readyz"})
# what a refused request's body may be drained of before the 503, so the client reads the answer
# instead of a reset (closing a socket with unread data makes the kernel send RST)
_BODY_DRAIN_LIMIT = 1 << 20
# after the grace: how long the interrupted requests get to send their last bytes (a client that
# reads nothing cannot hold the exit: uvicorn's own shutdown timeout follows)
INTERRUPT_WAIT_S = 2.0
RETRY_AFTER_S = "1"


@dataclass(eq=False)
class Ticket:
    """One request in flight while the gateway may drain."""

    task: asyncio.Task[object] | None
    started: bool = False  # the response head is sent
    interrupted: bool = False  # the grace ended with it still running: its task was cancelled

    def interrupt(self) -> None:
        self.interrupted = True
        if self.task is not None and not self.task.done():
            self.task.cancel()


def interrupted(scope: Scope) -> bool:
    """True when this request's cancellation is the drain's, not the client's leaving."""
    ticket = scope.get(SCOPE_KEY)
    return isinstance(ticket, Ticket) and ticket.interrupted


def uncancel_current() -> None:
    """Take back the drain's cancellation of this task, so it can still send its last bytes."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


@dataclass
class Drain:
    grace_s: float
    draining: bool = False
    started_at: float = 0.0
    cut_short: bool = False  # a second signal: the grace ends now
    tickets: set[Ticket] = field(default_factory=set)

    def begin(self) -> None:
        if not self.draining:
            self.draining = True
            self.started_at = time.monotonic()
            log.info(
                "draining: %d request(s) in flight, up to %g s (MOE_L2_PROXY_DRAIN_S); new requests are refused",
                len(self.tickets),
                self.grace_s,
            )
        else:
            self.cut_short = True

    async def run(self) -> None:
        """Begin the drain and return when nothing is in flight any more, or when the grace is over and
        what still ran has been ended explicitly."""
        self.begin()
        deadline = self.started_at + self.grace_s
        # a poll, as uvicorn's own shutdown does: cheap, and nothing here needs to be faster than 0.1 s
        while self.tickets and not self.cut_short and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.tickets:
            log.warning("drain grace over: ending %d request(s) still in flight", len(self.tickets))
            for ticket in list(self.tickets):
                ticket.interrupt()
            end = time.monotonic() + INTERRUPT_WAIT_S
            while self.tickets and time.monotonic() < end:
                await asyncio.sleep(0.05)
        log.info("drained in %.1f s", time.monotonic() - self.started_at)


class DrainGuard:
    """Pure ASGI: tracks the requests in flight, and answers for the gateway while it drains."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.drain.draining:
            if path == "/metrics":
                await self.app(scope, receive, send)
            elif path in PROBES:
                await draining_probe(scope, receive, send)
            else:
                await refuse(scope, receive, send, "the gateway is shutting down; retry (another replica) now")
            return
        ticket = Ticket(asyncio.current_task())
        scope[SCOPE_KEY] = ticket
        self.drain.tickets.add(ticket)

        async def tracking_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                ticket.started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if not ticket.interrupted:
                raise
            uncancel_current()
            if not ticket.started:
                # its llama request is cancelled (the slot freed); another gateway can take it
                await refuse(scope, receive, send, "the gateway shut down before answering; retry now", read=False)
            # a started answer that was not a relayed stream (which ends itself with an error event):
            # nothing more can be said on it; uvicorn closes the connection
        finally:
            self.drain.tickets.discard(ticket)


async def draining_probe(scope: Scope, receive: Receive, send: Send) -> None:
    response = JSONResponse(
        {"status": "draining"}, status_code=503, headers={"retry-after": RETRY_AFTER_S, "connection": "close"}
    )
    await response(scope, receive, send)


async def refuse(scope: Scope, receive: Receive, send: Send, message: str, read: bool = True) -> None:
    if read:
        drained = 0
        more = True
        while more and drained <= _BODY_DRAIN_LIMIT:
            event = await receive()
            drained += len(event.get("body", b""))
            more = event["type"] == "http.request" and event.get("more_body", False)
    response = error_response(
        scope["path"],
        503,
        message,
        code="shutting_down",
        headers={"retry-after": RETRY_AFTER_S, "connection": "close"},
    )
    with contextlib.suppress(OSError):
        await response(scope, receive, send)
