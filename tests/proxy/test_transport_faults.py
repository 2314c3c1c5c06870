"""Failures towards llama are httpx's exceptions, the same class with either transport.

Every fault is real: a port nobody listens on, a listen backlog that is full, a server that accepts
and stays silent, closes or resets (SO_LINGER 0) its connection before or in the middle of an
answer, a pool whose only connection is taken. The gateway's error handling (upstream.classify,
the streams' last event) only sees these classes, so it behaves the same whichever transport runs.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from moe_l2_ops.supervisor import free_port
from moe_l2_proxy.http1_transport import Http1Transport

TRANSPORTS: dict[str, Callable[[httpx.Limits], httpx.AsyncBaseTransport]] = {
    "fast": Http1Transport,
    "httpx": lambda limits: httpx.AsyncHTTPTransport(limits=limits),
}

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
PIECE = b"9\r\ndata: 1\n\n\r\n"
SIZED_HEAD = b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n"

# a step: bytes to send, "close" (FIN), "reset" (RST), "hold" (stay silent, connection open)
Step = bytes | str


class FaultyUpstream:
    """A raw TCP server: reads each request head (and body), then plays `script` on that connection."""

    def __init__(self, script: list[Step]) -> None:
        self.script = script
        self.server: asyncio.Server | None = None
        self.release = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    await reader.readexactly(int(line.split(b":")[1]))
            for step in self.script:
                if isinstance(step, bytes):
                    writer.write(step)
                    await writer.drain()
                    await asyncio.sleep(0.05)  # a piece of its own, as a token would be
                elif step == "reset":
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                elif step == "close":
                    return
                else:
                    await self.release.wait()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.tasks.discard(task)

    async def stop(self) -> None:
        self.release.set()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=5)
        assert self.server is not None
        self.server.close()


@asynccontextmanager
async def llama_client(
    transport: str, url: str, read: float = 0.3, limits: httpx.Limits | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    limits = limits or httpx.Limits(max_connections=8, max_keepalive_connections=8, keepalive_expiry=4.0)
    timeout = httpx.Timeout(5.0, connect=0.3, read=read, pool=0.3)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, transport=TRANSPORTS[transport](limits)) as client:
        yield client


async def stream_all(client: httpx.AsyncClient) -> bytes:
    """One streamed POST, read to its end through the client interface the gateway uses."""
    request = httpx.Request("POST", client.base_url.join("/v1/chat/completions"), content=b"{}")
    response = await client.send(request, stream=True)
    try:
        return b"".join([piece async for piece in response.aiter_raw()])
    finally:
        await response.aclose()


async def against(script: list[Step], transport: str) -> bytes:
    upstream = FaultyUpstream(script)
    url = await upstream.start()
    try:
        async with llama_client(transport, url) as client:
            return await stream_all(client)
    finally:
        await upstream.stop()


SCRIPTED = {
    "silent": (["hold"], httpx.ReadTimeout),
    "close-before-response": (["close"], httpx.RemoteProtocolError),
    "reset-before-response": (["reset"], httpx.ReadError),
    "close-mid-head": ([b"HTTP/1.1 200 OK\r\nContent-Ty", "close"], httpx.RemoteProtocolError),
    "close-mid-sized-body": ([SIZED_HEAD, b'{"partial', "close"], httpx.RemoteProtocolError),
    "close-mid-stream": ([HEAD, PIECE, PIECE, "close"], httpx.RemoteProtocolError),
    "reset-mid-stream": ([HEAD, PIECE, "reset"], httpx.ReadError),
    "silence-mid-stream": ([HEAD, PIECE, "hold"], httpx.ReadTimeout),
    "not-http": ([b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "close"], httpx.RemoteProtocolError),
}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("fault", list(SCRIPTED))
def test_a_faulty_upstream_is_the_same_httpx_error_with_either_transport(fault: str, transport: str) -> None:
    script, expected = SCRIPTED[fault]
    with pytest.raises(httpx.HTTPError) as raised:
        asyncio.run(against(script, transport))
    assert type(raised.value) is expected, repr(raised.value)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_nobody_listening_is_connect_error(transport: str) -> None:
    async def go() -> bytes:
        async with llama_client(transport, f"http://127.0.0.1:{free_port()}") as client:
            return await stream_all(client)

    with pytest.raises(httpx.HTTPError) as raised:
        asyncio.run(go())
    assert type(raised.value) is httpx.ConnectError


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_full_listen_backlog_is_connect_timeout(transport: str) -> None:
    # Linux drops the SYN of a connection its full accept queue has no room for: the connect hangs
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    try:
        for _ in range(8):  # more than the queue takes, whatever the kernel rounds a backlog of 0 to
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)

        async def go() -> bytes:
            async with llama_client(transport, f"http://127.0.0.1:{port}") as client:
                return await stream_all(client)

        with pytest.raises(httpx.HTTPError) as raised:
            asyncio.run(go())
        assert type(raised.value) is httpx.ConnectTimeout
    finally:
        for filler in fillers:
            filler.close()
        server.close()


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_no_free_connection_is_pool_timeout(transport: str) -> None:
    async def go() -> None:
        upstream = FaultyUpstream([HEAD, PIECE, "hold"])
        url = await upstream.start()
        one = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=4.0)
        try:
            async with llama_client(transport, url, read=5.0, limits=one) as client:
                request = httpx.Request("POST", client.base_url.join("/v1/chat/completions"), content=b"{}")
                held = await client.send(request, stream=True)  # the only connection, still streaming
                try:
                    await stream_all(client)
                finally:
                    await held.aclose()
        finally:
            await upstream.stop()

    with pytest.raises(httpx.HTTPError) as raised:
        asyncio.run(go())
    assert type(raised.value) is httpx.PoolTimeout
