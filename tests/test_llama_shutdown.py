"""llama-server under SIGTERM (the shutdown-drain patch of services/llama/patches): new requests are answered
503 at once, the requests in flight finish within --shutdown-timeout, and what still runs then ends with
an explicit error (an SSE error event and a proper end of the body, a JSON error for a blocking request),
never a cut connection; then the process exits 0.

Upstream's server, measured before the patch: a stream in flight got no further event, its chunked body
was cut without its last chunk, and the process exited about 30 s later. The real binary on the demo
model; each test starts its own server, since each ends one.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from moe_l2_ops.supervisor import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.llama

EXIT_S = 15.0  # a drained server exits within this (it used to take ~30 s, with its streams cut)


@dataclass
class Stream:
    """What one streamed completion received, read in a thread."""

    events: list[dict] = field(default_factory=list)
    done: bool = False  # the `data: [DONE]` line
    broke: str | None = None  # the body ended without its last chunk (a cut connection)
    refused: str | None = None  # not a 200: the status and body
    first: threading.Event = field(default_factory=threading.Event)
    ended_at: float = 0.0

    @property
    def errors(self) -> list[dict]:
        return [e["error"] for e in self.events if "error" in e]

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.events for c in e.get("choices", []) if c.get("finish_reason")]


@pytest.fixture
def start_server(llama_binary: Path, demo_model: Path, tmp_path: Path) -> Iterator:
    procs: list[subprocess.Popen] = []

    def start(*flags: str) -> tuple[subprocess.Popen, str]:
        port = free_port()
        log = (tmp_path / f"llama-{port}.log").open("w")
        serve = ["--host", "127.0.0.1", "--port", str(port), "--parallel", "2", "--ctx-size", "8192", "--threads", "2"]
        proc = subprocess.Popen(
            [str(llama_binary), "--model", str(demo_model), *serve, "--no-webui", *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert proc.poll() is None, (tmp_path / f"llama-{port}.log").read_text()[-3000:]
            try:
                return httpx.get(base + "/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, 120, "llama-server healthy", interval_s=0.2)
        return proc, base

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stream_completion(base: str, n_predict: int) -> tuple[Stream, threading.Thread]:
    """A streamed completion of n_predict tokens (EOS ignored), read in a thread."""
    stream = Stream()
    body = {"prompt": "the", "n_predict": n_predict, "ignore_eos": True, "stream": True, "cache_prompt": False}

    def read() -> None:
        try:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as response:
                if response.status_code != 200:
                    stream.refused = f"{response.status_code}: {response.read()[:300]!r}"
                    return
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        stream.done = True
                    elif line.startswith("data: "):
                        stream.events.append(json.loads(line.removeprefix("data: ")))
                        stream.first.set()
        except httpx.TransportError as exc:
            stream.broke = f"{type(exc).__name__}: {exc}"
        finally:
            stream.ended_at = time.monotonic()
            stream.first.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return stream, thread


def assert_refuses_new_requests(base: str) -> None:
    health = httpx.get(base + "/health", timeout=5)
    assert health.status_code == 503, health.text
    assert health.headers.get("retry-after") == "1"
    assert health.json()["error"]["type"] == "unavailable_error"
    assert "shutting down" in health.json()["error"]["message"]
    new = httpx.post(base + "/v1/completions", json={"prompt": "the", "n_predict": 4}, timeout=5)
    assert new.status_code == 503, new.text
    assert "shutting down" in new.json()["error"]["message"]


def wait_exit(proc: subprocess.Popen, timeout_s: float = EXIT_S) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"llama-server still running {timeout_s:g}s after its requests ended")


def test_sigterm_lets_a_stream_in_flight_finish_and_refuses_new_requests(start_server) -> None:
    proc, base = start_server("--shutdown-timeout", "60")
    stream, thread = stream_completion(base, n_predict=1500)
    assert stream.first.wait(60) and stream.events, (stream.refused, stream.broke)
    proc.send_signal(signal.SIGTERM)
    assert_refuses_new_requests(base)
    thread.join(90)
    assert not thread.is_alive()
    assert stream.broke is None, stream.broke
    assert stream.errors == []
    assert stream.finish_reasons == ["length"], "the stream was not finished in full"
    assert stream.done
    tokens = sum(1 for e in stream.events for c in e.get("choices", []) if c.get("text"))
    assert tokens >= 1400, tokens  # (a few tokens may decode to no text)
    assert wait_exit(proc) == 0


def test_at_the_shutdown_timeout_what_still_runs_ends_with_an_error(start_server) -> None:
    proc, base = start_server("--shutdown-timeout", "2")
    stream, thread = stream_completion(base, n_predict=6000)  # far longer than the 2 s left to it
    assert stream.first.wait(60) and stream.events, (stream.refused, stream.broke)
    blocking: dict = {}

    def block() -> None:
        body = {"prompt": "the", "n_predict": 6000, "ignore_eos": True, "cache_prompt": False}
        response = httpx.post(base + "/v1/completions", json=body, timeout=120)
        blocking.update(status=response.status_code, body=response.json())

    blocker = threading.Thread(target=block, daemon=True)
    blocker.start()
    wait_until(lambda: slots_busy(base) == 2, 30, "both slots running", interval_s=0.1)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    thread.join(60)
    blocker.join(60)
    assert stream.broke is None, f"the stream was cut: {stream.broke}"
    assert stream.ended_at - signalled >= 1.5, "ended before its --shutdown-timeout"
    assert len(stream.errors) == 1, stream.events[-3:]
    assert stream.errors[0]["code"] == 503 and "shutting down" in stream.errors[0]["message"]
    assert stream.finish_reasons == []
    assert blocking["status"] == 503, blocking
    assert "shutting down" in blocking["body"]["error"]["message"]
    assert wait_exit(proc) == 0


def test_without_the_flag_sigterm_ends_the_requests_in_flight_with_an_error_at_once(start_server) -> None:
    proc, base = start_server()
    stream, thread = stream_completion(base, n_predict=6000)
    assert stream.first.wait(60) and stream.events, (stream.refused, stream.broke)
    proc.send_signal(signal.SIGTERM)
    thread.join(30)
    assert stream.broke is None, f"the stream was cut: {stream.broke}"
    assert [e["code"] for e in stream.errors] == [503]
    assert wait_exit(proc) == 0


def test_an_idle_server_exits_at_once_on_sigterm(start_server) -> None:
    proc, _ = start_server("--shutdown-timeout", "60")
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert wait_exit(proc) == 0
    assert time.monotonic() - signalled < 5.0


def slots_busy(base: str) -> int:
    slots = httpx.get(base + "/slots", timeout=5).json()
    return sum(1 for s in slots if s.get("is_processing"))
