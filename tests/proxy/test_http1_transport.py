"""The gateway's HTTP/1.1 transport towards llama: httpx's API and exceptions over real sockets."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from moe_l2_common.supervisor import free_port
from moe_l2_proxy.http1_transport import Http1Transport


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
