"""HTTP/1.1 edge cases, the gateway's transport side by side with httpx's default one as the reference.

The upstream is a scripted raw TCP server: these are malformed or unusual answers (interim 1xx,
wrong lengths, early closes, stalls, bytes after the end) that the real llama-server cannot be
made to send. Every case runs on both transports and must end the same way on both: the same
status and body, or an httpx error of the same family. Then a follow-up request on the same
transport must get its own answer, never what was left of the case's response.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest

from moe_l2_proxy.http1_transport import Http1Transport

Step = bytes | float | str  # bytes: send; float: sleep; "close": close the connection; "hold": stay silent


def sized(body: bytes, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Length: %d\r\n%s\r\n%s" % (status.encode(), len(body), extra, body)


CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"


@dataclass(frozen=True)
class Case:
    name: str
    script: list[Step]
    # ("ok", status, body) or ("error", family)
    expect: tuple
    method: str = "GET"
    headers: dict[str, str] = field(default_factory=dict)
    # seconds between the end of the case and the follow-up (late bytes while the connection is idle)
    pause: float = 0.0
    # the connection is kept for the follow-ups (a well-framed keep-alive answer), else it is closed
    reuse: bool = False


PROTOCOL = ("error", "protocol")
TIMEOUT = ("error", "timeout")
EXPECT = {"expect": "100-continue", "content-type": "application/json"}

CASES = [
    Case(
        "interim-100-then-answer",
        [b"HTTP/1.1 100 Continue\r\n\r\n", 0.2, sized(b"the answer")],
        ("ok", 200, b"the answer"),
        method="POST",
        headers=EXPECT,
        reuse=True,
    ),
    Case(
        "interim-100-and-answer-together",
        [b"HTTP/1.1 100 Continue\r\n\r\n" + sized(b"the answer")],
        ("ok", 200, b"the answer"),
        method="POST",
        headers=EXPECT,
        reuse=True,
    ),
    Case(
        "interim-103-and-102-then-answer",
        [
            b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n",
            0.05,
            b"HTTP/1.1 102 Processing\r\n\r\n",
            0.05,
            sized(b"late answer"),
        ],
        ("ok", 200, b"late answer"),
        reuse=True,
    ),
    Case(
        "interim-100-then-close",
        [b"HTTP/1.1 100 Continue\r\n\r\n", 0.05, "close"],
        PROTOCOL,
        method="POST",
        headers=EXPECT,
    ),
    Case(
        "interim-100-then-stall",
        [b"HTTP/1.1 100 Continue\r\n\r\n", "hold"],
        TIMEOUT,
        method="POST",
        headers=EXPECT,
    ),
    Case(
        "chunked-with-trailers",
        [CHUNKED + b"Trailer: X-Sum\r\n\r\n5\r\nhello\r\n", 0.05, b"6\r\n world\r\n0\r\nX-Sum: 42\r\n\r\n"],
        ("ok", 200, b"hello world"),
        reuse=True,
    ),
    Case(
        "chunked-with-extensions-split-everywhere",
        [CHUNKED + b"\r\n5;ext=1\r", 0.02, b"\nhel", 0.02, b"lo\r\n0\r", 0.02, b"\n\r\n"],
        ("ok", 200, b"hello"),
        reuse=True,
    ),
    Case("content-length-shorter-than-body", [sized(b"hello")[:-5] + b"hello, and more"], ("ok", 200, b"hello")),
    Case(
        # the bytes after the end are a whole response: they must never become the follow-up's answer
        "content-length-shorter-extra-is-a-response",
        [sized(b"hello") + sized(b"NOT YOURS")],
        ("ok", 200, b"hello"),
    ),
    Case("content-length-longer-then-close", [sized(b"0123456789")[:-5], 0.05, "close"], PROTOCOL),
    Case("content-length-longer-then-stall", [sized(b"0123456789")[:-5], "hold"], TIMEOUT),
    Case("connection-close-then-close", [sized(b"bye", extra=b"Connection: close\r\n"), "close"], ("ok", 200, b"bye")),
    Case(
        "connection-close-but-left-open",
        [sized(b"bye", extra=b"Connection: close\r\n"), "hold"],
        ("ok", 200, b"bye"),
    ),
    Case("close-before-response", ["close"], PROTOCOL),
    Case("close-mid-head", [b"HTTP/1.1 200 OK\r\nContent-Le", "close"], PROTOCOL),
    Case("close-mid-chunked-body", [CHUNKED + b"\r\n5\r\nhello\r\n", 0.05, "close"], PROTOCOL),
    Case(
        "no-length-read-until-close",
        [b"HTTP/1.1 200 OK\r\n\r\nhello ", 0.05, b"world", "close"],
        ("ok", 200, b"hello world"),
    ),
    Case("http-1.0-no-length", [b"HTTP/1.0 200 OK\r\n\r\nold style", "close"], ("ok", 200, b"old style")),
    Case("head-with-content-length", [sized(b"x" * 100)[:-100]], ("ok", 200, b""), method="HEAD", reuse=True),
    Case("no-content-204", [b"HTTP/1.1 204 No Content\r\n\r\n"], ("ok", 204, b""), reuse=True),
    Case(
        "not-modified-304-with-length",
        [b"HTTP/1.1 304 Not Modified\r\nContent-Length: 20\r\n\r\n"],
        ("ok", 304, b""),
        reuse=True,
    ),
    Case(
        "no-content-204-with-a-body", [b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\nhello"], ("ok", 204, b"")
    ),
    Case(
        # chunked wins (RFC 9112 6.3), as in httpx; the connection is not kept
        "content-length-and-chunked",
        [b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"],
        ("ok", 200, b"hello"),
    ),
    Case(
        "unsupported-transfer-encoding", [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nhello", "close"], PROTOCOL
    ),
    Case("switching-protocols-unasked", [b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n", "hold"], PROTOCOL),
    Case("garbage-status-line", [b"HTTP/1.1 abc nonsense\r\n\r\n"], PROTOCOL),
    Case("stall-before-head", ["hold"], TIMEOUT),
    Case("stall-mid-chunked-body", [CHUNKED + b"\r\n5\r\nhello\r\n", "hold"], TIMEOUT),
    Case(
        # a whole response, then an unsolicited one while the connection sits idle in the pool
        "bytes-while-idle",
        [sized(b"yours"), 0.05, sized(b"NOT YOURS")],
        ("ok", 200, b"yours"),
        pause=0.3,
    ),
]


class ScriptedUpstream:
    """A raw asyncio TCP server. `/follow/<n>` is answered `follow <n>` (well-formed, keep-alive);
    `/case/<name>` plays that case's script. Notes the request targets seen on each connection."""

    def __init__(self, cases: dict[str, Case]) -> None:
        self.cases = cases
        self.connections: list[list[str]] = []
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = asyncio.Event()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        self.writers.append(writer)
        seen: list[str] = []
        self.connections.append(seen)
        try:
            await self._play(reader, writer, seen)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.tasks.discard(task)

    async def _play(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[str]) -> None:
        while not self.stopping.is_set():
            head = await reader.readuntil(b"\r\n\r\n")
            target = head.split(b" ", 2)[1].decode()
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            if length:
                await reader.readexactly(int(length.group(1)))
            seen.append(target)
            if target.startswith("/follow/"):
                writer.write(sized(b"follow " + target.rsplit("/", 1)[1].encode()))
                continue
            for step in self.cases[target.rsplit("/", 1)[1]].script:
                if isinstance(step, bytes):
                    writer.write(step)
                    await writer.drain()
                elif isinstance(step, float):
                    await asyncio.sleep(step)
                elif step == "hold":
                    await self.stopping.wait()
                    return
                else:
                    return

    async def stop(self) -> None:
        self.stopping.set()
        for writer in self.writers:
            writer.close()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=5)
        assert self.server is not None
        self.server.close()


TRANSPORTS: dict[str, Callable[[], httpx.AsyncBaseTransport]] = {
    "http1": Http1Transport,
    "httpx-reference": httpx.AsyncHTTPTransport,
}


def outcome(response: httpx.Response | None, error: httpx.HTTPError | None) -> tuple:
    if error is not None:
        if isinstance(error, httpx.TimeoutException):
            return ("error", "timeout")
        if isinstance(error, httpx.ProtocolError):
            return ("error", "protocol")
        if isinstance(error, httpx.NetworkError):
            return ("error", "network")
        return ("error", type(error).__name__)
    assert response is not None
    return ("ok", response.status_code, response.content)


async def play(
    case: Case, make_transport: Callable[[], httpx.AsyncBaseTransport]
) -> tuple[tuple, list, ScriptedUpstream]:
    upstream = ScriptedUpstream({case.name: case})
    port = await upstream.start()
    follow_ups = []
    client = httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", transport=make_transport(), timeout=httpx.Timeout(5.0, read=0.5)
    )
    try:
        response = error = None
        content = b'{"a": 1}' if case.method == "POST" else None
        try:
            response = await client.request(case.method, f"/case/{case.name}", headers=case.headers, content=content)
        except httpx.HTTPError as exc:
            error = exc
        result = outcome(response, error)
        await asyncio.sleep(case.pause)
        for n in range(3):
            try:
                reply = await client.get(f"/follow/{n}")
                follow_ups.append((reply.status_code, reply.text))
            except httpx.HTTPError as exc:
                follow_ups.append(outcome(None, exc))
    finally:
        await client.aclose()
        await upstream.stop()
    return result, follow_ups, upstream


# httpx leaves the bytes after a response's end in h11's buffer and reads them as the next response
# on that connection: an error, or another request's answer ("NOT YOURS"). Where its outcome for
# the case itself matches, that is the reference's known weakness, not a difference of outcome.
REFERENCE_READS_PAST_THE_END = {
    "content-length-shorter-than-body",
    "content-length-shorter-extra-is-a-response",
    "no-content-204-with-a-body",
}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_edge_case_same_outcome_and_a_clean_next_request(case: Case, transport: str) -> None:
    result, follow_ups, upstream = asyncio.run(play(case, TRANSPORTS[transport]))
    assert result == case.expect
    clean = [(200, f"follow {n}") for n in range(3)]
    if transport == "httpx-reference" and case.name in REFERENCE_READS_PAST_THE_END and follow_ups != clean:
        pytest.xfail(f"httpx read the bytes after the end as the next answer: {follow_ups[0]}")
    assert follow_ups == clean
    if case.reuse:
        assert [len(seen) for seen in upstream.connections] == [4]  # all on one connection
    elif transport == "http1":
        assert [len(seen) for seen in upstream.connections] == [1, 3]  # closed after the case
