"""Relaying a generation to the client as it happens, and stopping it when the client leaves.

`RelayResponse` sends every piece the moment llama produces it (no buffering: one ASGI body
message per upstream read) while a second task waits for the client's `http.disconnect`; when
the client goes, the relay is cancelled and the upstream response closed, which closes the TCP
connection to llama-server, whose slot then stops generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from moe_l2_proxy.drain import INTERRUPT_WAIT_S, interrupted, uncancel_current
from moe_l2_proxy.gateway import DisconnectWatch
from moe_l2_proxy.metrics import GatewayMetrics, mark_disconnected

# An SSE line longer than this is relayed but not inspected for token counts (memory stays bounded).
_MAX_CARRY = 1 << 20


class RelayResponse(Response):
    def __init__(
        self,
        body: AsyncIterator[bytes],
        upstream: httpx.Response,
        status_code: int = 200,
        headers: dict[str, str] | None = None,
        media_type: str | None = None,
        on_close: Callable[[], None] | None = None,
        tail: Callable[[str], bytes] | None = None,
    ) -> None:
        """`tail(message)`: the last bytes of a stream the gateway ends before llama did (its shutdown
        grace is over: drain.py), in the stream's own error format."""
        self.body_iterator = body
        self.tail = tail
        self.upstream = upstream
        self.status_code = status_code
        self.media_type = media_type
        self.on_close = on_close
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The relay runs in this task and a watcher cancels it when the client leaves: plain asyncio, not
        # a task group, because this is paid once per streamed request and the loop once per token.
        completed = False
        left = False
        started = False
        try:
            with DisconnectWatch(receive) as watch:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                started = True
                async for chunk in self.body_iterator:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                completed = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            left = watch.left
        except OSError:  # servers on ASGI spec 2.4 report a gone client this way
            left = True
        except asyncio.CancelledError:
            if not interrupted(scope):
                raise
            # the drain's grace is over: the client gets an explicit end, not a cut connection
            uncancel_current()
            if started:
                await self._end_interrupted(send)
        finally:
            await self._close()
            if left and not completed:
                mark_disconnected(scope)
            if self.on_close is not None:
                self.on_close()

    async def _end_interrupted(self, send: Send) -> None:
        message = "the gateway shut down before this answer ended (MOE_L2_PROXY_DRAIN_S); retry the request"
        tail = self.tail(message) if self.tail is not None else b""
        # bounded: a client that reads nothing (its socket buffers full) cannot hold the exit
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(INTERRUPT_WAIT_S):
                if tail:
                    await send({"type": "http.response.body", "body": tail, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _close(self) -> None:
        # Nothing in here waits on the network (the transport just hands the connection back or closes
        # it), so it completes even when this task is being cancelled: llama's slot is always freed.
        aclose: Callable[[], Awaitable[None]] | None = getattr(self.body_iterator, "aclose", None)
        if aclose is not None:
            await aclose()
        await self.upstream.aclose()


class SseObserver:
    """Watches an OpenAI SSE stream as it passes (never delaying it) for the first token and the counts."""

    def __init__(self, metrics: GatewayMetrics, route: str, t0: float) -> None:
        self.metrics = metrics
        self.route = route
        self.t0 = t0
        self.first_token = False
        self.carry = b""
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.content_events = 0

    def feed(self, chunk: bytes) -> None:
        if not self.first_token and (b'"content":"' in chunk or b'"text":"' in chunk):
            self.first_token = True
            self.metrics.labelled(self.metrics.ttft, self.route).observe(time.perf_counter() - self.t0)
        if not self.carry and chunk.endswith(b"\n") and b'"usage"' not in chunk and b'"timings"' not in chunk:
            # the common case, once per token: whole events and nothing to read, so only count them
            self.content_events += chunk.count(b"\ndata: {") + chunk.startswith(b"data: {")
            return
        data = self.carry + chunk if self.carry else chunk
        lines = data.split(b"\n")
        carry = lines.pop()
        self.carry = carry if len(carry) < _MAX_CARRY else b""
        for line in lines:
            if not line.startswith(b"data: {"):
                continue
            self.content_events += 1
            if b'"usage"' in line or b'"timings"' in line:
                self._read_counts(line[6:])

    def _read_counts(self, payload: bytes) -> None:
        try:
            event = json.loads(payload)
        except ValueError:
            return
        usage = event.get("usage") or {}
        timings = event.get("timings") or {}
        if usage:
            self.prompt_tokens = int(usage.get("prompt_tokens", 0))
            self.completion_tokens = int(usage.get("completion_tokens", 0))
        elif timings:
            self.prompt_tokens = int(timings.get("prompt_n", 0)) + int(timings.get("cache_n", 0))
            self.completion_tokens = int(timings.get("predicted_n", 0))

    def finish(self) -> None:
        completion = self.completion_tokens
        if not completion and self.content_events:
            # a server without usage/timings: one event per token, less the role and finish events
            completion = max(0, self.content_events - 2)
        self.metrics.count_tokens(self.prompt_tokens, completion)


async def relay_raw(
    upstream: httpx.Response, on_error: Callable[[httpx.HTTPError], bytes], observer: SseObserver | None = None
) -> AsyncIterator[bytes]:
    """llama's bytes as they arrive (seen by `observer` on the way); a transport failure midway ends
    the stream with `on_error`'s bytes."""
    # The response's own byte stream (httpx's AsyncByteStream, whichever the transport), not
    # aiter_raw(): a generator less between the socket and the client, on a path taken once per token
    # (aiter_raw adds ~0.4 µs a piece here). RelayResponse closes the response.
    try:
        if observer is None:
            async for chunk in upstream.stream:  # type: ignore[union-attr]
                yield chunk
        else:
            async for chunk in upstream.stream:  # type: ignore[union-attr]
                observer.feed(chunk)
                yield chunk
    except httpx.HTTPError as exc:
        yield on_error(exc)


async def sse_payloads(upstream: httpx.Response) -> AsyncIterator[str]:
    """The `data:` payloads of an SSE stream, one per event, `[DONE]` excluded."""
    async for line in upstream.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        if payload:
            yield payload
