"""The gateway's HTTP/1.1 transport towards llama: httpx's API and exceptions over real sockets."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import httpx
import pytest

from moe_l2_ops.supervisor import free_port
from moe_l2_proxy.app import llama_client, llama_transport
from moe_l2_proxy.errors import GatewayError
from moe_l2_proxy.http1_transport import Http1Transport
from moe_l2_proxy.metrics import GatewayMetrics
from moe_l2_proxy.settings import ProxySettings
from moe_l2_proxy.upstream import LlamaUpstream


def client(url: str, **timeouts: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, transport=Http1Transport(), timeout=httpx.Timeout(10, **timeouts))


@pytest.mark.llama
def test_keep_alive_and_streaming(llama32):
    async def go():
        async with client(llama32.url) as c:
            first = await c.get("/health")
            second = await c.get("/v1/models")
            # 200 tokens, not 20: the demo model makes 20 in ~11 ms, which a client descheduled on a busy
            # 2-core machine read as one piece (seen once in a run beside a build)
            body = {"prompt": "hi", "max_tokens": 200, "stream": True, "ignore_eos": True}
            pieces = []
            async with c.stream("POST", "/v1/completions", json=body) as resp:
                async for chunk in resp.aiter_raw():
                    pieces.append(chunk)
            return first, second, pieces

    first, second, pieces = asyncio.run(go())
    assert first.json() == {"status": "ok"} and second.json()["data"]
    text = b"".join(pieces).decode()
    assert text.rstrip().endswith("data: [DONE]") and text.count('"text"') >= 20
    assert len(pieces) > 1  # handed over as it came, not as one body


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


async def stream_through(
    server: ScriptedServer,
    read_timeout: float,
    target: str = "/v1/x%20y?a=b%2Fc",
    headers: dict[str, str] | None = None,
) -> list[bytes]:
    """One streamed POST through an httpx.AsyncClient on this transport, as the gateway sends it."""
    serving = asyncio.create_task(server.serve())
    url = f"http://127.0.0.1:{server.port}"
    timeout = httpx.Timeout(5.0, read=read_timeout)
    headers = headers or {"content-type": "application/json"}
    try:
        async with httpx.AsyncClient(transport=Http1Transport(), timeout=timeout) as c:
            request = httpx.Request("POST", url + target, headers=headers, content=b"{}")
            response = await c.send(request, stream=True)
            pieces = [piece async for piece in response.aiter_raw()]
            await response.aclose()
            return pieces
    finally:
        serving.cancel()
        server.sock.close()


def test_the_target_is_sent_as_given_and_the_answer_streams():
    server = ScriptedServer(
        [(0, HEAD), *((0.05, c) for c in chunked(b"data: 1\n\n", b"data: 2\n\n")), (0, b"0\r\n\r\n")]
    )
    pieces = asyncio.run(stream_through(server, read_timeout=5.0))
    assert b"".join(pieces) == b"data: 1\n\ndata: 2\n\n"
    head = server.received.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    assert head[0] == b"POST /v1/x%20y?a=b%2Fc HTTP/1.1"  # still percent-encoded, query kept
    assert sorted(head[1:]) == [
        b"Content-Length: 2",
        b"Host: 127.0.0.1:%d" % server.port,
        b"content-type: application/json",
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


class PlannedServer:
    """Connection i plays plans[i]: one script per request on it (steps: bytes to send, "close").
    Notes the request targets each connection received."""

    def __init__(self, plans: list[list[list[bytes | str]]]) -> None:
        self.plans = plans
        self.seen: list[list[str]] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.append(task)
        self.writers.append(writer)
        seen: list[str] = []
        self.seen.append(seen)
        plan = self.plans[len(self.seen) - 1] if len(self.seen) <= len(self.plans) else []
        try:
            for script in plan:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                if length:
                    await reader.readexactly(int(length.group(1)))
                seen.append(head.split(b" ", 2)[1].decode())
                for step in script:
                    if step == "close":
                        return
                    assert isinstance(step, bytes)
                    writer.write(step)
            await reader.read()  # until the client closes
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        for writer in self.writers:
            writer.close()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=5)
        assert self.server is not None
        self.server.close()


def sized(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def test_idle_connection_found_closed_is_retried_once_on_a_fresh_one():
    # llama closed the idle connection as the second request went out: it never read it, no byte came back
    server = PlannedServer([[[sized(b"first")], ["close"]], [[sized(b"second")]]])
    retries = []

    async def go():
        port = await server.start()
        transport = Http1Transport(on_retry=lambda: retries.append(1))
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", transport=transport) as c:
                return (await c.get("/1")).text, (await c.get("/2")).text
        finally:
            await server.stop()

    assert asyncio.run(go()) == ("first", "second")
    assert server.seen == [["/1", "/2"], ["/2"]]
    assert retries == [1]


@pytest.mark.parametrize(
    "answer",
    [
        [b"HTTP/1.1 200 OK\r\nContent-Le", "close"],  # part of the head
        [b'HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{"partial', "close"],  # part of the body
        [b"HTTP/1.1 100 Continue\r\n\r\n", "close"],  # only an interim response
    ],
    ids=["mid-head", "mid-body", "after-100"],
)
def test_no_retry_once_any_response_byte_arrived(answer):
    server = PlannedServer([[[sized(b"first")], answer], [[sized(b"must not be asked")]]])
    retries = []

    async def go():
        port = await server.start()
        transport = Http1Transport(on_retry=lambda: retries.append(1))
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", transport=transport) as c:
                assert (await c.get("/1")).text == "first"
                await c.post("/generate", content=b"{}")
        finally:
            await server.stop()

    with pytest.raises(httpx.RemoteProtocolError):
        asyncio.run(go())
    assert server.seen == [["/1", "/generate"]]  # sent once
    assert retries == []


def test_one_connection_serves_requests_one_after_the_other():
    server = PlannedServer([[[sized(b"1")], [sized(b"2")], [sized(b"3")]]])

    async def go():
        port = await server.start()
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", transport=Http1Transport()) as c:
                return [(await c.get(f"/{n}")).text for n in (1, 2, 3)]
        finally:
            await server.stop()

    assert asyncio.run(go()) == ["1", "2", "3"]
    assert server.seen == [["/1", "/2", "/3"]]  # kept alive: one connection


@pytest.mark.parametrize("transport", ["fast", "httpx"])
@pytest.mark.parametrize("reused", [False, True], ids=["fresh-connection", "reused-connection"])
def test_blocking_generation_cut_midway_is_not_run_twice(reused, transport):
    """LlamaUpstream.send for a non-streaming request whose answer is cut short: an error, and llama
    was asked once (a second run would be a second full generation)."""
    cut = [b'HTTP/1.1 200 OK\r\nContent-Length: 80\r\n\r\n{"choices": [', "close"]
    plans = [[[sized(b"{}")], cut]] if reused else [[cut]]
    server = PlannedServer([*plans, [[sized(b'{"choices": []}')]]])

    async def go():
        port = await server.start()
        settings = ProxySettings(llama_url=f"http://127.0.0.1:{port}", llama_transport=transport)
        metrics = GatewayMetrics()
        under = llama_transport(settings, metrics)
        client = llama_client(settings, under)
        upstream = LlamaUpstream(settings.llama_url, settings, metrics, client, under)
        try:
            if reused:
                await upstream.send("GET", "/health", headers={})
            await upstream.send("POST", "/v1/chat/completions", headers={}, content=b"{}", stream=False)
        finally:
            await client.aclose()
            await server.stop()

    with pytest.raises(GatewayError) as failure:
        asyncio.run(go())
    assert failure.value.status == 502
    assert [len(seen) for seen in server.seen] == ([2] if reused else [1])


def test_forwarded_headers_leave_hop_by_hop_and_secrets_behind():
    settings = ProxySettings(llama_url="http://127.0.0.1:1", llama_api_key="k")
    upstream = LlamaUpstream(
        settings.llama_url, settings, GatewayMetrics(), httpx.AsyncClient(), httpx.AsyncHTTPTransport()
    )
    client = [
        ("host", "gateway:11435"),
        ("content-type", "application/json"),
        ("content-length", "12"),
        ("expect", "100-continue"),
        ("connection", "keep-alive, X-Private"),
        ("Connection", "x-other"),
        ("x-private", "hop"),
        ("X-Other", "hop"),
        ("keep-alive", "timeout=5"),
        ("te", "trailers"),
        ("trailer", "x-sum"),
        ("transfer-encoding", "chunked"),
        ("upgrade", "h2c"),
        ("proxy-connection", "keep-alive"),
        ("proxy-authorization", "Basic eA=="),
        ("authorization", "Bearer the-client's"),
        ("X-MoE-Admin-Token", "secret"),
        ("x-moe-domain", "math"),
        ("accept", "text/event-stream"),
        ("x-request-id", "r1"),
    ]
    assert upstream.forward_headers(client, "codegen") == {
        "content-type": "application/json",
        "accept": "text/event-stream",
        "x-request-id": "r1",
        "authorization": "Bearer k",
        "x-moe-domain": "codegen",
    }


def test_the_transport_never_sends_headers_it_owns():
    server = ScriptedServer([(0, sized(b"ok"))])
    own = {"Expect": "100-continue", "Connection": "close", "Transfer-Encoding": "chunked", "Upgrade": "h2c"}
    asyncio.run(stream_through(server, read_timeout=5.0, target="/v1/chat/completions", headers={**own, "a": "b"}))
    head = server.received.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    assert sorted(head[1:]) == [b"Content-Length: 2", b"Host: 127.0.0.1:%d" % server.port, b"a: b"]


@pytest.mark.parametrize("transport", ["fast", "httpx"])
def test_the_llama_client_keeps_no_cookies(transport):
    """One client carries every user's requests: a cookie llama set on one answer is never sent again."""
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                heads.append(await reader.readuntil(b"\r\n\r\n"))
                cookie = b"Set-Cookie: session=user-one; Path=/\r\n" if len(heads) == 1 else b""
                writer.write(b"HTTP/1.1 200 OK\r\n%sContent-Length: 2\r\n\r\n{}" % cookie)
        except (ConnectionError, asyncio.IncompleteReadError):
            writer.close()

    async def go():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        settings = ProxySettings(
            llama_url=f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", llama_transport=transport
        )
        metrics = GatewayMetrics()
        under = llama_transport(settings, metrics)
        client = llama_client(settings, under)
        upstream = LlamaUpstream(settings.llama_url, settings, metrics, client, under)
        try:
            first = await upstream.send("GET", "/props", headers={})
            assert first.headers["set-cookie"].startswith("session=")  # relayed as llama sent it
            await upstream.send("GET", "/props", headers={})
            await upstream.get_json("/v1/models")  # the client's own request building, too
        finally:
            await client.aclose()
            server.close()

    asyncio.run(go())
    assert len(heads) == 3
    assert not any(b"cookie:" in head.lower() for head in heads[1:])


@pytest.mark.parametrize(
    ("limits", "connections"),
    [
        (httpx.Limits(keepalive_expiry=None), [["/1", "/2"]]),  # never expires: reused
        (httpx.Limits(keepalive_expiry=0), [["/1"], ["/2"]]),  # expired at once
        (httpx.Limits(max_keepalive_connections=0), [["/1"], ["/2"]]),  # none kept
    ],
    ids=["no-expiry", "expiry-0", "keep-none"],
)
def test_the_pool_follows_httpx_limits(limits, connections):
    server = PlannedServer([[[sized(b"1")], [sized(b"2")]], [[sized(b"2")]]])

    async def go():
        port = await server.start()
        try:
            transport = Http1Transport(limits)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", transport=transport) as c:
                return [(await c.get(f"/{n}")).text for n in (1, 2)]
        finally:
            await server.stop()

    assert asyncio.run(go()) == ["1", "2"]
    assert server.seen == connections


@pytest.mark.parametrize("transport", ["fast", "httpx"])
def test_header_bytes_reach_llama_as_the_client_sent_them(transport):
    """Starlette hands header values over decoded as latin-1: a UTF-8 value goes on byte for byte."""
    server = ScriptedServer([(0, sized(b"{}"))])

    async def go():
        serving = asyncio.create_task(server.serve())
        settings = ProxySettings(llama_url=f"http://127.0.0.1:{server.port}", llama_transport=transport)
        metrics = GatewayMetrics()
        under = llama_transport(settings, metrics)
        client = llama_client(settings, under)
        try:
            sent = "café".encode().decode("latin-1")  # what request.headers holds for these bytes
            await LlamaUpstream(settings.llama_url, settings, metrics, client, under).send(
                "GET", "/props", headers={"x-title": sent}
            )
        finally:
            await client.aclose()
            serving.cancel()
            server.sock.close()

    asyncio.run(go())
    assert "x-title: café".encode() in server.received
