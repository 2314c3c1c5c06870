"""Client connections, with raw sockets: stalled request heads and bodies are closed after a bounded
time (408 where an answer can still be sent), and the number of open connections is bounded (503)."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.proxy.support import (
    GatewayProc,
    chat_body,
    connect,
    raw_request,
    read_response,
    read_until_closed,
    split_response,
    wait_until,
)

pytestmark = pytest.mark.llama

TIMEOUT_S = 2  # header and body timeouts of the gateway under test
PATIENCE_S = 20  # how long a test waits for the gateway to act: generous, and far below "never"


@pytest.fixture(scope="module")
def guarded(start_gateway, llama32) -> GatewayProc:
    return start_gateway(
        llama32.url,
        MOE_L2_PROXY_HEADER_TIMEOUT_S=str(TIMEOUT_S),
        MOE_L2_PROXY_BODY_TIMEOUT_S=str(TIMEOUT_S),
        MOE_L2_PROXY_MAX_HEADER_BYTES="4096",
    )


def closed_with(sock: socket.socket, status: int) -> dict:
    """The gateway answered `status` and closed the connection; the JSON body."""
    data, closed = read_until_closed(sock, PATIENCE_S)
    assert closed, f"the connection was still open after {PATIENCE_S} s (received {data!r})"
    assert data, "closed without an answer"
    got, headers, body = split_response(data)
    assert got == status, data
    assert headers.get("connection") == "close"
    return json.loads(body)


def test_idle_connection_is_closed_with_408(guarded):
    with connect(guarded.url) as sock:
        t0 = time.monotonic()
        error = closed_with(sock, 408)["error"]
        assert error["code"] == "request_timeout" and error["message"]
        assert time.monotonic() - t0 >= TIMEOUT_S - 0.5  # not before its time
    assert guarded.metric("moe_l2_client_connections_closed_total", reason="head_timeout") >= 1


def test_half_a_request_head_is_closed_with_408(guarded):
    with connect(guarded.url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: appl")
        assert closed_with(sock, 408)["error"]["code"] == "request_timeout"


def test_a_head_dripped_byte_by_byte_is_cut_at_the_header_timeout(guarded):
    """The header timeout is a total, not an idle time: a client sending one byte every 0.2 s
    (slowloris) is closed although it never goes quiet."""
    head = raw_request("GET", "/v1/models", **{"X-Padding": "p" * 300})
    with connect(guarded.url) as sock:
        t0 = time.monotonic()
        answer = None
        for byte in head[:-2]:  # never the final CRLF
            if time.monotonic() - t0 > PATIENCE_S:
                break
            try:
                sock.sendall(bytes([byte]))
                sock.settimeout(0.2)
                answer = sock.recv(65536)  # data (the 408) or b"" (closed): the gateway gave up on it
                break
            except TimeoutError:
                continue
            except OSError:
                answer = b""
                break
        assert answer is not None, f"the gateway kept reading a head that never ends for {PATIENCE_S} s"
        if answer:
            assert answer.startswith(b"HTTP/1.1 408 ")


def test_an_oversized_head_is_431(guarded):
    with connect(guarded.url) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\nX-Big: " + b"b" * 8000)
        assert closed_with(sock, 431)["error"]["code"] == "request_head_too_large"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat", "/v1/embeddings"])
def test_a_stalled_body_is_closed_with_408(guarded, path):
    body = json.dumps(chat_body()).encode()
    before = guarded.metric("moe_l2_requests_total", route=path, status="408")
    with connect(guarded.url) as sock:
        sock.sendall(raw_request("POST", path, body[:10], content_length=len(body)))
        error = closed_with(sock, 408)["error"]
        # each API's own error format
        assert isinstance(error, str) if path.startswith("/api/") else error["code"] == "request_timeout"
    assert wait_until(lambda: guarded.metric("moe_l2_requests_total", route=path, status="408") == before + 1, 5)
    assert guarded.metric("moe_l2_requests_total", route=path, status="500") == 0


def test_a_slow_body_that_keeps_coming_is_served(guarded):
    """The body timeout is the longest silence: a body sent in pieces over more than the timeout,
    none of them further apart than it, is read whole."""
    body = json.dumps(chat_body("tell me about slow uploads")).encode()
    pieces = [body[:10], body[10:20], body[20:30], body[30:]]
    with connect(guarded.url) as sock:
        sock.sendall(raw_request("POST", "/v1/chat/completions", pieces[0], content_length=len(body)))
        for piece in pieces[1:]:
            time.sleep(TIMEOUT_S * 0.6)
            sock.sendall(piece)
        status, _, answer = read_response(sock)
    assert status == 200 and json.loads(answer)["choices"][0]["message"]["content"]


def test_long_answers_and_idle_keep_alive_are_not_cut(guarded, start_gateway, long_llama):
    """No timeout runs while the gateway works on a read request, nor between requests on a
    kept-alive connection (uvicorn's keep-alive timeout, 75 s, governs that)."""
    gw = start_gateway(long_llama.url, MOE_L2_PROXY_HEADER_TIMEOUT_S="1", MOE_L2_PROXY_BODY_TIMEOUT_S="1")
    body = json.dumps(chat_body("a long answer", max_tokens=4000, ignore_eos=True)).encode()
    with connect(gw.url) as sock:
        t0 = time.monotonic()
        sock.sendall(raw_request("POST", "/v1/chat/completions", body))
        status, _, answer = read_response(sock, timeout_s=120)
        took = time.monotonic() - t0
        assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 4000
        time.sleep(2.5)  # idle past both timeouts
        sock.sendall(raw_request("GET", "/healthz"))
        assert read_response(sock)[0] == 200
    print(f"4000-token answer took {took:.1f} s against 1 s timeouts")


def test_connections_beyond_the_limit_get_503(start_gateway, llama32):
    limit = 8
    gw = start_gateway(llama32.url, MOE_L2_PROXY_MAX_CONNECTIONS=str(limit))
    held: list[socket.socket] = []
    try:
        for _ in range(limit):  # kept-alive connections, each served once
            sock = connect(gw.url)
            sock.sendall(raw_request("GET", "/healthz"))
            assert read_response(sock)[0] == 200
            held.append(sock)
        with connect(gw.url) as extra:
            extra.sendall(raw_request("POST", "/v1/chat/completions", json.dumps(chat_body()).encode()))
            error = closed_with(extra, 503)["error"]
            assert error["code"] == "too_many_connections" and "MOE_L2_PROXY_MAX_CONNECTIONS=8" in error["message"]
        with connect(gw.url) as extra:
            extra.sendall(raw_request("GET", "/api/tags"))
            data, closed = read_until_closed(extra, PATIENCE_S)
            status, headers, body = split_response(data)
            assert closed and status == 503 and isinstance(json.loads(body)["error"], str)
            assert headers["retry-after"]
        # the held connections still work, and a freed place is taken again
        held[0].sendall(raw_request("GET", "/healthz"))
        assert read_response(held[0])[0] == 200
        held.pop().close()

        def served() -> bool:
            with connect(gw.url) as sock:
                sock.sendall(raw_request("GET", "/healthz"))
                return read_response(sock)[0] == 200

        assert wait_until(served, timeout_s=10)
    finally:
        for sock in held:
            sock.close()
    assert gw.metric("moe_l2_client_connections_closed_total", reason="over_limit") >= 2
    assert gw.metric("moe_l2_requests_total", route="/v1/chat/completions", status="503") >= 1
