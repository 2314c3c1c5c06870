"""Helpers of the gateway tests: process handles, metric parsing, request bodies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.llama_service import llama_service_spec
from moe_l2_ops.supervisor import ServiceSpec, Supervisor, http_ok
from tests.metrics import sample_sum


@dataclass
class GatewayProc:
    url: str
    client: httpx.Client
    log_path: Path
    proc: subprocess.Popen[bytes]

    def metrics_text(self) -> str:
        return self.client.get("/metrics").raise_for_status().text

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 if none)."""
        return metric_value(self.metrics_text(), name, **labels)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def metric_value(text: str, name: str, **labels: str) -> float:
    return sample_sum(text, name, **labels)


@dataclass
class ManagedProcess:
    """A service this test owns: it may stop, kill, freeze (SIGSTOP) and restart it on the same port."""

    name: str
    port: int
    make_spec: Callable[[int], ServiceSpec]
    supervisor: Supervisor
    proc: subprocess.Popen[bytes] | None = None
    frozen: bool = field(default=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = self.supervisor.start(self.make_spec(self.port)).proc

    def stop(self) -> None:
        self.thaw()
        self.supervisor.stop(timeout_s=10)
        self.proc = None

    def kill(self) -> None:
        assert self.proc is not None
        self.thaw()
        self.proc.kill()
        self.proc.wait()

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        if self.frozen and self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        self.frozen = False


def llama_spec(
    binary: Path, model: Path, name: str, extra_args: str = "", parallel: int = 2, ctx_size: int = 4096
) -> Callable[[int], ServiceSpec]:
    def spec(port: int) -> ServiceSpec:
        settings = LlamaSettings(
            port=port,
            parallel=parallel,
            ctx_size=ctx_size,
            telemetry=True,
            threads=1,  # see gateway_llamas in conftest.py
            extra_args=extra_args,
        )
        return llama_service_spec(name, binary, model, settings)

    return spec


def predictor_spec(name: str) -> Callable[[int], ServiceSpec]:
    def spec(port: int) -> ServiceSpec:
        base = f"http://127.0.0.1:{port}"
        return ServiceSpec(
            name=name,
            argv=[sys.executable, "-m", "moe_l2_predictor"],
            # the keyword and TF-IDF tiers: a real predictor that starts in seconds on 2 cores
            env={
                "MOE_L2_PREDICTOR_PORT": str(port),
                "MOE_L2_PREDICTOR_HOST": "127.0.0.1",
                "MOE_L2_PREDICTOR_TIERS": os.environ.get("MOE_L2_TEST_PREDICTOR_TIERS", "keyword,tfidf"),
            },
            health=http_ok(f"{base}/healthz"),
            url=base,
            start_timeout_s=180,
        )

    return spec


class BlackHole:
    """A TCP port that accepts connections into its backlog and never answers: a hung service."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.sock.close()


def chat_body(text: str = "hello there", max_tokens: int = 4, **extra: object) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, **extra}


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def until_predicted(gateway: GatewayProc, predictor_url: str, cooldown_s: float, attempts: int = 4) -> httpx.Response:
    """A chat answered with the predictor's domain, retried past a cooldown: on a busy machine the
    very first call (cold connection, cold predictor) can miss a 50 ms budget."""
    for _ in range(3):
        httpx.post(f"{predictor_url}/v1/predict", json={"text": "warm up"}, timeout=30)
    for _ in range(attempts):
        resp = gateway.client.post("/v1/chat/completions", json=chat_body("fix this segfault in my C++ code"))
        if resp.headers.get("x-moe-domain-source") == "predictor":
            return resp
        time.sleep(cooldown_s + 0.1)
    raise AssertionError("the gateway never used the predictor's answer")


def raw_request(method: str, path: str, body: bytes = b"", content_length: int | None = None, **headers: str) -> bytes:
    """A request head (and body) as bytes; Content-Length may be declared longer than the body sent."""
    fields = {"Host": "gateway", **{k.replace("_", "-"): v for k, v in headers.items()}}
    if body or content_length is not None or method == "POST":
        fields["Content-Length"] = str(len(body) if content_length is None else content_length)
        fields.setdefault("Content-Type", "application/json")
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
    return head.encode() + body


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """Everything the server sends until it closes the connection: (bytes, closed). `closed` is False if
    the connection was still open after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return data, False
        sock.settimeout(left)
        try:
            piece = sock.recv(65536)
        except TimeoutError:
            return data, False
        except ConnectionResetError:
            return data, True
        if not piece:
            return data, True
        data += piece


def read_response(sock: socket.socket, timeout_s: float = 30) -> tuple[int, dict[str, str], bytes]:
    """One whole response with a Content-Length (what the gateway's own answers have), connection kept."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        if not piece:
            raise ConnectionError(f"closed before a whole response head: {data!r}")
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    status, headers = parse_head(head)
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        piece = sock.recv(65536)
        if not piece:
            raise ConnectionError("closed before the end of the body")
        body += piece
    return status, headers, body[:length]


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers


def split_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    status, headers = parse_head(head)
    return status, headers, body
