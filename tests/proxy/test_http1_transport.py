"""The gateway's HTTP/1.1 transport towards llama: httpx's API and exceptions over real sockets."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from moe_l2_common.supervisor import free_port
from moe_l2_proxy.http1_transport import Http1Transport, request_message


def client(url: str, **timeouts: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, transport=Http1Transport(), timeout=httpx.Timeout(10, **timeouts))


@pytest.mark.llama
def test_keep_alive_and_streaming(llama32):
    async def go():
        async with client(llama32.url) as c:
            first = await c.get("/health")
            second = await c.get("/v1/models")
            body = {"prompt": "hi", "max_tokens": 20, "stream": True, "ignore_eos": True}
            pieces = []
            async with c.stream("POST", "/v1/completions", json=body) as resp:
                async for chunk in resp.aiter_raw():
                    pieces.append(chunk)
            idle = sum(len(v) for v in c._transport.idle.values())
            return first, second, pieces, idle

    first, second, pieces, idle = asyncio.run(go())
    assert first.json() == {"status": "ok"} and second.json()["data"]
    text = b"".join(pieces).decode()
    assert text.rstrip().endswith("data: [DONE]") and text.count('"text"') >= 20
    assert len(pieces) > 1  # handed over as it came, not as one body
    assert idle == 1  # one connection served all three requests


def test_connection_refused_is_connect_error():
    async def go():
        async with client(f"http://127.0.0.1:{free_port()}") as c:
            await c.get("/")

    with pytest.raises(httpx.ConnectError):
        asyncio.run(go())


def test_silent_server_is_read_timeout(black_hole):
    async def go():
        async with client(black_hole.url, read=0.2) as c:
            await c.get("/")

    with pytest.raises(httpx.ReadTimeout):
        asyncio.run(go())


def test_close_before_response_is_remote_protocol_error():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    async def go():
        async with client(f"http://127.0.0.1:{server.getsockname()[1]}") as c:
            task = asyncio.create_task(c.post("/", content=json.dumps({"a": 1})))
            loop = asyncio.get_running_loop()
            conn, _ = await loop.sock_accept(server)
            await loop.sock_recv(conn, 65536)
            conn.close()  # no answer at all
            await task

    server.setblocking(False)
    try:
        with pytest.raises(httpx.RemoteProtocolError):
            asyncio.run(go())
    finally:
        server.close()


class ScriptedServer:
    """One connection on a real socket: records the request, then plays `script`, a list of
    (delay in seconds, bytes to send)."""

    def __init__(self, script: list[tuple[float, bytes]]) -> None:
        self.script = script
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.received = b""

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        conn, _ = await loop.sock_accept(self.sock)
        while b"\r\n\r\n" not in self.received:
            self.received += await loop.sock_recv(conn, 65536)
        for delay, data in self.script:
            await asyncio.sleep(delay)
            await loop.sock_sendall(conn, data)
        await asyncio.sleep(1.0)  # keep the connection open: the client decides when it is done
        conn.close()


def chunked(*pieces: bytes) -> list[bytes]:
    return [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces]


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


async def stream_through(server: ScriptedServer, read_timeout: float) -> list[bytes]:
    transport = Http1Transport()
    serving = asyncio.create_task(server.serve())
    message = request_message(
        "POST", "127.0.0.1", server.port, "/v1/x%20y?a=b%2Fc", {"content-type": "application/json"}, b"{}"
    )
    try:
        timeouts = {"connect": 5.0, "read": read_timeout, "pool": 5.0}
        response = await transport.exchange(("127.0.0.1", server.port), "POST", message, timeouts)
        pieces = [piece async for piece in response.stream]  # type: ignore[union-attr]
        await response.aclose()
        return pieces
    finally:
        serving.cancel()
        await transport.aclose()
        server.sock.close()


def test_exchange_sends_the_target_as_given_and_streams_the_answer():
    server = ScriptedServer(
        [(0, HEAD), *((0.05, c) for c in chunked(b"data: 1\n\n", b"data: 2\n\n")), (0, b"0\r\n\r\n")]
    )
    pieces = asyncio.run(stream_through(server, read_timeout=5.0))
    assert b"".join(pieces) == b"data: 1\n\ndata: 2\n\n"
    head = server.received.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    assert head[0] == b"POST /v1/x%20y?a=b%2Fc HTTP/1.1"  # still percent-encoded, query kept
    assert sorted(head[1:]) == [
        b"Content-Length: 2",
        b"content-type: application/json",
        b"host: 127.0.0.1:%d" % server.port,
    ]
    assert server.received.endswith(b"\r\n\r\n{}")


def test_read_timeout_counts_from_the_last_piece_not_the_first():
    # six pieces 0.15 s apart: 0.9 s in all, far over the 0.4 s read timeout, but never silent that long
    script = [(0, HEAD), *((0.15, c) for c in chunked(*(b"data: %d\n\n" % i for i in range(6)))), (0, b"0\r\n\r\n")]
    pieces = asyncio.run(stream_through(ScriptedServer(script), read_timeout=0.4))
    assert b"".join(pieces).count(b"data: ") == 6


def test_silence_mid_stream_is_read_timeout():
    script = [(0, HEAD), *((0, c) for c in chunked(b"data: 1\n\n"))]  # then nothing, connection open
    with pytest.raises(httpx.ReadTimeout):
        asyncio.run(stream_through(ScriptedServer(script), read_timeout=0.3))
