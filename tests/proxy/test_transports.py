"""The gateway end to end with either transport towards llama (MOE_L2_PROXY_LLAMA_TRANSPORT=fast|httpx).

The same requests through the official clients, the same probes, and the same answers to the same
real faults (llama unreachable, llama's stream cut midway): the rest of the gateway only talks to
httpx.AsyncClient, so which transport is under it must not show.
"""

from __future__ import annotations

import re
import socket
import socketserver
import threading
from collections.abc import Iterator

import httpx
import ollama
import openai
import pytest

from moe_l2_ops.supervisor import free_port
from tests.proxy.support import GatewayProc, chat_body

pytestmark = pytest.mark.llama

TRANSPORTS = ["fast", "httpx"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def gw(request: pytest.FixtureRequest, start_gateway, llama32) -> GatewayProc:
    return start_gateway(llama32.url, MOE_L2_PROXY_LLAMA_TRANSPORT=request.param)


def test_openai_client_streams_and_blocks(gw):
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "write a python function"}]
    stream = client.chat.completions.create(model="demo", messages=messages, max_tokens=8, stream=True)
    pieces = [chunk.choices[0].delta.content for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    assert len(pieces) >= 2
    blocking = client.completions.create(model="demo", prompt="def parse(", max_tokens=5)
    assert blocking.usage.completion_tokens == 5 and blocking.choices[0].text


def test_ollama_client_streams_and_blocks(gw):
    client = ollama.Client(host=gw.url, timeout=120)
    messages = [{"role": "user", "content": "hello"}]
    parts = list(client.chat(model="demo", messages=messages, stream=True, options={"num_predict": 6}))
    assert parts[-1].done and parts[-1].eval_count == 6
    answer = client.generate(model="demo", prompt="hi", options={"num_predict": 4})
    assert answer.done and answer.eval_count == 4


def test_passthrough_and_probes(gw):
    assert gw.client.get("/v1/models").json()["data"]
    assert gw.client.get("/api/tags").json()["models"]
    assert gw.client.get("/readyz").json()["status"] == "ready"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_llama_unreachable_is_503_in_each_apis_format(start_gateway, transport):
    gw = start_gateway(f"http://127.0.0.1:{free_port()}", MOE_L2_PROXY_LLAMA_TRANSPORT=transport)
    v1 = gw.client.post("/v1/chat/completions", json=chat_body())
    assert v1.status_code == 503 and v1.json()["error"]["code"] == "upstream_unavailable"
    api = gw.client.post("/api/chat", json={"model": "d", "messages": [{"role": "user", "content": "hi"}]})
    assert api.status_code == 503 and isinstance(api.json()["error"], str)
    assert gw.client.get("/readyz").status_code == 503


class CutLlama(socketserver.ThreadingTCPServer):
    """Answers every request with the head of a stream and one event, then closes: llama dying mid-answer."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _CutHandler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _CutHandler(socketserver.BaseRequestHandler):
    EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"hel"}}],"object":"chat.completion.chunk"}\n\n'

    def handle(self) -> None:
        sock: socket.socket = self.request
        received = b""
        while b"\r\n\r\n" not in received:
            data = sock.recv(65536)
            if not data:
                return
            received += data
        length = re.search(rb"(?im)^content-length:\s*(\d+)", received)
        body = len(received.split(b"\r\n\r\n", 1)[1])
        while length and body < int(length.group(1)):
            body += len(sock.recv(65536))
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        sock.sendall(head + b"%x\r\n%s\r\n" % (len(self.EVENT), self.EVENT))
        sock.close()


@pytest.fixture
def cut_llama() -> Iterator[CutLlama]:
    server = CutLlama()
    yield server
    server.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_llama_cut_midway_is_the_same_error_with_either_transport(start_gateway, cut_llama, transport):
    gw = start_gateway(cut_llama.url, MOE_L2_PROXY_LLAMA_TRANSPORT=transport)
    with gw.client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as resp:
        assert resp.status_code == 200
        text = resp.read().decode()
    assert '"content":"hel"' in text  # what came before the cut is relayed
    assert text.rstrip().endswith('"code":"upstream_protocol"}}')  # then one error event
    blocking = gw.client.post("/v1/chat/completions", json=chat_body())
    assert blocking.status_code == 502 and blocking.json()["error"]["code"] == "upstream_protocol"
    body = {"model": "d", "messages": [{"role": "user", "content": "hi"}]}
    with gw.client.stream("POST", "/api/chat", json=body) as resp:
        lines = resp.read().decode().splitlines()
    assert '"error"' in lines[-1] and "llama-server connection failed" in lines[-1]
    assert gw.metric("moe_l2_upstream_errors_total", kind="protocol") == 3
    assert httpx.get(f"{gw.url}/healthz").status_code == 200
