"""A lean HTTP/1.1 transport for httpx: asyncio protocol + httptools parser, keep-alive pool.

Why: relaying a generation costs one upstream read per token. Through httpx's default stack
(httpcore, h11, anyio) one read costs ~140 µs of CPU here, against ~20 µs for the socket itself,
and on a small machine the gateway's CPU is taken from llama. This transport keeps httpx's API
(`httpx.AsyncClient(transport=Http1Transport(...))`, same exceptions) and parses with httptools
(C, the parser uvicorn uses). Body pieces that arrived together are handed over together; nothing
is held back waiting for more.

Only httpx's transport interface is public (`handle_async_request`, `aclose`, and the constructor,
which takes `httpx.Limits` as httpx's own transport does): the rest of the gateway talks to the
`httpx.AsyncClient` around it, so going back to httpx's transport is one line (MOE_L2_PROXY_LLAMA_TRANSPORT
or the constructor in app.py). Failures are httpx's exception types, of the same family httpx's
transport raises for the same fault (tests/proxy/test_transport_faults.py causes each for real).

Scope: plain http:// to one trusted upstream (llama-server), HTTP/1.1, no proxies, no TLS.

A pooled connection carries many clients' requests one after the other, so a byte read as the
wrong response's is another client's data. The rules that keep answers apart:
- interim 1xx responses (100 Continue, 103 Early Hints) are skipped: the final response is the answer;
- a connection goes back to the pool only when the parser saw its response end, keep-alive, and
  nothing after it; any byte after the end (or while idle) closes it, as does every response whose
  framing is in doubt (Content-Length with Transfer-Encoding, no length: read until close, a
  parser error, a body cut short);
- a request is sent again only when a reused idle connection turned out closed before a single
  response byte came back (llama closed it while idle); never once any byte of a response arrived.
The edge cases are tested against httpx's own transport in tests/proxy/test_http1_edge_cases.py.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import cast

import httptools
import httpx

# Pause reading from the socket while this much body is waiting for the consumer.
_HIGH_WATER = 256 * 1024

_DEFAULT_LIMITS = httpx.Limits(max_connections=512, max_keepalive_connections=128, keepalive_expiry=4.0)

# Request headers this transport owns: it frames the body itself (the whole body, with its length),
# keeps connections alive as it sees fit and never waits for 100 Continue, so a caller's say in
# these would only mislead the upstream.
_OWN_REQUEST_HEADERS = frozenset(
    {b"transfer-encoding", b"connection", b"keep-alive", b"proxy-connection", b"te", b"upgrade", b"expect"}
)


class _AfterTheEnd(Exception):
    """Raised from a parser callback to stop parsing bytes that came after the response's end."""


class _DeadIdleConnection(Exception):
    """A reused pooled connection was closed by the upstream before any byte of a response."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.lost: Exception | None = None  # why the connection ended, when the OS said (a reset)
        self.idle_since = 0.0
        # the read timeout: one timer re-armed lazily, not one created and cancelled per token
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self._reset(False)

    def _reset(self, head_only: bool) -> None:
        self.parser = httptools.HttpResponseParser(self)
        # Content-Length with chunked is parsed as chunked (as httpx does) and the connection closed
        # after it, instead of failing the request: see `on_headers_complete`.
        self.parser.set_dangerous_leniencies(lenient_chunked_length=True)
        self.head_only = head_only  # the answer to HEAD: headers only, whatever its length says
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.interim = False
        self.complete = False
        self.keep_alive = True
        self.until_close = False
        self.received = False
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
        self.received = True
        if self.complete:
            # After the end of the response, or while idle in the pool: whatever these bytes are, they
            # are no answer to the next request, and the connection's framing can no longer be trusted.
            self.close()
        else:
            try:
                self.parser.feed_data(data)
            except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
                if not self.complete:
                    self.error = httpx.RemoteProtocolError(f"invalid HTTP response from upstream: {exc}")
                self.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc
        if self.until_close and not self.complete:
            self.complete = True  # a response without a length ends with its connection
        self.closed = True
        self._wake()

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.complete:
            raise _AfterTheEnd  # a second message in the bytes after the end: not this response's

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            if status == 101:
                raise httptools.HttpParserError("101 Switching Protocols, but no upgrade was asked for")
            # Interim (100 Continue, 102, 103 Early Hints): the final response follows on this connection.
            self.interim = True
            self.headers = []
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        if self.head_only or status == 204 or status == 304:
            self.complete = True  # no body, whatever the headers say; a byte after this closes the connection
        else:
            self._check_framing()
        self.head_done = True

    def _check_framing(self) -> None:
        length = coding = None
        for name, value in self.headers:
            if len(name) == 14 and name.lower() == b"content-length":
                length = value
            elif len(name) == 17 and name.lower() == b"transfer-encoding":
                coding = value
        if coding is not None:
            if not coding.lower().rstrip(b" \t").endswith(b"chunked"):
                raise httptools.HttpParserError(f"unsupported transfer-encoding {coding!r}")
            if length is not None:
                self.keep_alive = False  # chunked wins, but what else the upstream got wrong is unknown
        elif length is None:
            self.until_close = True  # the body ends with the connection
            self.keep_alive = False

    def on_body(self, body: bytes) -> None:
        if self.complete:
            raise _AfterTheEnd  # body bytes after a head-only response
        self.chunks.append(bytes(body))
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
        else:
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
            waiter.set_exception(TimeoutError())

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
    """The response body as httpx's streaming interface: pieces as they arrived, and on close the
    connection goes back to the pool or is closed (it never waits on the network)."""

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
                raise _lost(conn, "before the end of the body")
            else:
                try:
                    await conn.wait(self.read_timeout)
                except TimeoutError:
                    raise httpx.ReadTimeout("upstream sent nothing within the read timeout") from None

    async def aclose(self) -> None:
        if not self.released:
            self.released = True
            self.pool._release(self.origin, self.conn)


def _lost(conn: _Connection, when: str) -> httpx.TransportError:
    """The error for a connection that ended too soon, in the family httpx's own transport uses: a
    reset is a network error, an orderly close a protocol error (the response is incomplete)."""
    if isinstance(conn.lost, OSError):
        return httpx.ReadError(f"upstream connection lost {when}: {conn.lost}")
    return httpx.RemoteProtocolError(f"upstream closed the connection {when}")


class Http1Transport(httpx.AsyncBaseTransport):
    """httpx's transport interface over the protocol above: `httpx.AsyncClient(transport=Http1Transport(
    limits))` where httpx's default would be `httpx.AsyncHTTPTransport(limits=limits)`. Only the
    interface is public; the pool is this module's own."""

    def __init__(self, limits: httpx.Limits = _DEFAULT_LIMITS, on_retry: Callable[[], None] | None = None) -> None:
        self._max_keepalive = _unbounded(limits.max_keepalive_connections)
        # None: kept until the upstream closes it, as httpx reads it
        self._keepalive_expiry = float("inf") if limits.keepalive_expiry is None else limits.keepalive_expiry
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._slots = asyncio.Semaphore(_unbounded(limits.max_connections))
        # called when a request is sent again because its reused idle connection was found closed
        self._on_retry = on_retry

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Sends the whole request (head and body) and returns the response once its head is in; the
        body streams (`response.aiter_raw()`), and closing the response releases the connection."""
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"this transport speaks plain http:// only, not {url.scheme}://")
        body = await request.aread()
        origin = (url.host, url.port or 80)
        message = _request_head(request.method, url.raw_path, request.headers.raw, len(body)) + body
        timeouts: Mapping[str, float | None] = request.extensions.get("timeout", {})
        return await self._exchange(origin, request.method, message, timeouts)

    async def _exchange(
        self, origin: tuple[str, int], method: str, message: bytes, timeouts: Mapping[str, float | None]
    ) -> httpx.Response:
        await self._acquire_slot(timeouts.get("pool"))
        conn: _Connection | None = None
        head_only = method == "HEAD"
        try:
            conn = self._idle_connection(origin, head_only)
            if conn is not None:
                try:
                    await self._send(conn, message, timeouts.get("read"), reused=True)
                except _DeadIdleConnection:
                    # Closed by the upstream while idle (its keep-alive timeout, a restart), before it read
                    # the request: no byte of an answer came, so sending it again cannot run it twice.
                    # Its idle siblings were likely closed at the same moment.
                    conn.close()
                    self._drop_idle()
                    if self._on_retry is not None:
                        self._on_retry()
                    conn = None
            if conn is None:
                conn = await self._connect(origin, timeouts.get("connect"), head_only)
                await self._send(conn, message, timeouts.get("read"), reused=False)
        except BaseException:
            self._slots.release()
            if conn is not None:
                conn.close()
            raise
        return httpx.Response(
            conn.status,
            headers=conn.headers,
            stream=_Body(self, origin, conn, timeouts.get("read")),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def _send(self, conn: _Connection, message: bytes, read_timeout: float | None, reused: bool) -> None:
        """Writes the request and waits for the head of its final response."""
        assert conn.transport is not None
        if conn.transport.is_closing():
            # closed by the upstream between its accept and this write (a llama replica killed right
            # then): uvloop's write would raise RuntimeError, which reached the client as a 500; it is
            # a connection lost before any answer, as below, and the caller may retry it elsewhere
            if reused and not conn.received:
                raise _DeadIdleConnection
            raise _lost(conn, "before the request was sent")
        conn.transport.write(message)
        while not conn.head_done:
            if conn.error is not None:
                raise conn.error
            if conn.closed:
                if reused and not conn.received:
                    raise _DeadIdleConnection
                raise _lost(conn, "without a response")
            try:
                await conn.wait(read_timeout)
            except TimeoutError:
                raise httpx.ReadTimeout("upstream sent no response within the read timeout") from None

    async def _acquire_slot(self, timeout: float | None) -> None:
        if not self._slots.locked():
            await self._slots.acquire()
            return
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout)
        except TimeoutError:
            raise httpx.PoolTimeout("no free upstream connection within the pool timeout") from None

    def _idle_connection(self, origin: tuple[str, int], head_only: bool) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self._keepalive_expiry:
                conn._reset(head_only)
                return conn
            conn.close()
        return None

    async def _connect(self, origin: tuple[str, int], timeout: float | None, head_only: bool) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            transport, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(loop), origin[0], origin[1]), timeout
            )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {origin[0]}:{origin[1]} within the connect timeout") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {origin[0]}:{origin[1]}: {exc.strerror or exc}") from exc
        # uvloop calls connection_made only on the next loop iteration
        conn.transport = cast(asyncio.Transport, transport)
        conn.head_only = head_only
        return conn

    def _release(self, origin: tuple[str, int], conn: _Connection) -> None:
        """A response is done with its connection: keep it for the next request, or close it."""
        self._slots.release()
        idle = self._idle.setdefault(origin, [])
        if conn.reusable() and len(idle) < self._max_keepalive:
            conn.idle_since = time.monotonic()
            idle.append(conn)
        else:
            conn.close()

    def _drop_idle(self) -> None:
        """Closes every pooled connection: after one was found dead, its siblings likely are too."""
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()

    async def aclose(self) -> None:
        self._drop_idle()


def _unbounded(limit: int | None) -> int:
    return (1 << 30) if limit is None else limit


def _request_head(method: str, target: bytes, headers: Iterable[tuple[bytes, bytes]], body_length: int) -> bytes:
    lines = [b"%s %s HTTP/1.1" % (method.encode(), target)]
    has_length = False
    for name, value in headers:
        lower = name.lower()
        if lower in _OWN_REQUEST_HEADERS:
            continue
        if lower == b"content-length":
            has_length = True
        lines.append(name + b": " + value)
    if not has_length and (body_length or method in ("POST", "PUT", "PATCH")):
        lines.append(b"Content-Length: %d" % body_length)
    return b"\r\n".join(lines) + b"\r\n\r\n"
