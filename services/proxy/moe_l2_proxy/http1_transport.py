"""A lean HTTP/1.1 transport for httpx: asyncio protocol + httptools parser, keep-alive pool.

Why: relaying a generation costs one upstream read per token. Through httpx's default stack
(httpcore, h11, anyio) one read costs ~140 µs of CPU here, against ~20 µs for the socket itself,
and on a small machine the gateway's CPU is taken from llama. This transport keeps httpx's API
(`httpx.AsyncClient(transport=Http1Transport(...))`, same exceptions) and parses with httptools
(C, the parser uvicorn uses). Body pieces that arrived together are handed over together; nothing
is held back waiting for more.

Scope: plain http:// to one trusted upstream (llama-server), HTTP/1.1, no proxies, no TLS.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import cast

import httptools
import httpx

# Pause reading from the socket while this much body is waiting for the consumer.
_HIGH_WATER = 256 * 1024


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        # the read timeout: one timer re-armed lazily, not one created and cancelled per token
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.keep_alive = True
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but they have its methods
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = httpx.RemoteProtocolError(f"invalid HTTP response from upstream: {exc}")
            self.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(bytes(body))
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True

    def on_message_complete(self) -> None:
        self.complete = True

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self, timeout: float | None) -> None:
        """Until more data, the end of the message or of the connection; TimeoutError after `timeout`."""
        waiter = self.waiter = self.loop.create_future()
        if timeout is not None:
            self.deadline = self.loop.time() + timeout
            if self.timer is None:
                self.timer = self.loop.call_at(self.deadline, self._check_deadline)
        try:
            await waiter
        finally:
            self.waiter = None

    def _check_deadline(self) -> None:
        self.timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return  # nobody waiting: the next wait arms the timer again
        if self.loop.time() < self.deadline:
            self.timer = self.loop.call_at(self.deadline, self._check_deadline)  # data came since: later
        else:
            waiter.set_exception(asyncio.TimeoutError())

    def take(self) -> bytes:
        data = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.transport.resume_reading()
            self.paused = False
        return data

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class _Body(httpx.AsyncByteStream):
    def __init__(
        self, pool: Http1Transport, origin: tuple[str, int], conn: _Connection, read_timeout: float | None
    ) -> None:
        self.pool = pool
        self.origin = origin
        self.conn = conn
        self.read_timeout = read_timeout
        self.released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self.conn
        while True:
            if conn.chunks:
                yield conn.take()
            elif conn.complete:
                return
            elif conn.error is not None:
                raise conn.error
            elif conn.closed:
                raise httpx.RemoteProtocolError("upstream closed the connection before the end of the body")
            else:
                try:
                    await conn.wait(self.read_timeout)
                except asyncio.TimeoutError:
                    raise httpx.ReadTimeout("upstream sent nothing within the read timeout") from None

    async def aclose(self) -> None:
        if not self.released:
            self.released = True
            self.pool.release(self.origin, self.conn)


class Http1Transport(httpx.AsyncBaseTransport):
    def __init__(self, max_connections: int = 512, max_keepalive: int = 128, keepalive_expiry: float = 4.0) -> None:
        self.max_keepalive = max_keepalive
        self.keepalive_expiry = keepalive_expiry
        self.idle: dict[tuple[str, int], list[_Connection]] = {}
        self.slots = asyncio.Semaphore(max_connections)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            raise httpx.UnsupportedProtocol("this transport speaks plain http:// only")
        body = await request.aread()
        origin = (request.url.host, request.url.port or 80)
        head = _request_head(request.method, request.url.raw_path, request.headers.raw, len(body))
        response = await self.exchange(origin, request.method, head + body, request.extensions.get("timeout", {}))
        response.request = request
        return response

    async def exchange(
        self, origin: tuple[str, int], method: str, message: bytes, timeouts: Mapping[str, float | None]
    ) -> httpx.Response:
        """Sends one whole request message (head and body) and returns the response once its head is in;
        the body streams. For callers that build the message themselves, without an httpx.Request."""
        await self._acquire_slot(timeouts.get("pool"))
        conn: _Connection | None = None
        try:
            conn = self._idle_connection(origin) or await self._connect(origin, timeouts.get("connect"))
            assert conn.transport is not None
            conn.transport.write(message)
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                if conn.closed:
                    raise httpx.RemoteProtocolError("upstream closed the connection without a response")
                try:
                    await conn.wait(timeouts.get("read"))
                except asyncio.TimeoutError:
                    conn.close()
                    raise httpx.ReadTimeout("upstream sent no response within the read timeout") from None
        except BaseException:
            self.slots.release()
            if conn is not None:
                conn.close()
            raise
        if method == "HEAD" or conn.status in (204, 304):
            conn.complete = True
        return httpx.Response(
            conn.status,
            headers=conn.headers,
            stream=_Body(self, origin, conn, timeouts.get("read")),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def _acquire_slot(self, timeout: float | None) -> None:
        if not self.slots.locked():
            await self.slots.acquire()
            return
        try:
            await asyncio.wait_for(self.slots.acquire(), timeout)
        except asyncio.TimeoutError:
            raise httpx.PoolTimeout("no free upstream connection within the pool timeout") from None

    def _idle_connection(self, origin: tuple[str, int]) -> _Connection | None:
        idle = self.idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_expiry:
                conn._reset()
                return conn
            conn.close()
        return None

    async def _connect(self, origin: tuple[str, int], timeout: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            transport, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(loop), origin[0], origin[1]), timeout
            )
        except asyncio.TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {origin[0]}:{origin[1]} within the connect timeout") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {origin[0]}:{origin[1]}: {exc.strerror or exc}") from exc
        # uvloop calls connection_made only on the next loop iteration
        conn.transport = cast(asyncio.Transport, transport)
        return conn

    def release(self, origin: tuple[str, int], conn: _Connection) -> None:
        """A response is done with its connection: keep it for the next request, or close it."""
        self.slots.release()
        idle = self.idle.setdefault(origin, [])
        if conn.reusable() and len(idle) < self.max_keepalive:
            conn.idle_since = time.monotonic()
            idle.append(conn)
        else:
            conn.close()

    def drop_idle(self) -> None:
        """Closes every pooled connection: after one was found dead, its siblings likely are too."""
        for idle in self.idle.values():
            for conn in idle:
                conn.close()
        self.idle.clear()

    async def aclose(self) -> None:
        self.drop_idle()


def _request_head(method: str, target: bytes, headers: Iterable[tuple[bytes, bytes]], body_length: int) -> bytes:
    lines = [b"%s %s HTTP/1.1" % (method.encode(), target)]
    has_length = False
    for name, value in headers:
        lower = name.lower()
        if lower == b"transfer-encoding":
            continue  # the body is sent whole, with its length
        if lower == b"content-length":
            has_length = True
        lines.append(name + b": " + value)
    if not has_length and (body_length or method in ("POST", "PUT", "PATCH")):
        lines.append(b"Content-Length: %d" % body_length)
    return b"\r\n".join(lines) + b"\r\n\r\n"


def request_message(
    method: str, host: str, port: int, target: str, headers: Mapping[str, str], body: bytes | None
) -> bytes:
    """A whole HTTP/1.1 request (head and body) for `exchange`; the header names and values must
    already be valid (they come from a parsed client request or from the gateway itself)."""
    fields = [(b"host", f"{host}:{port}".encode("latin-1"))]
    fields += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items() if k.lower() != "host"]
    body = body or b""
    return _request_head(method, target.encode("latin-1"), fields, len(body)) + body
