"""SIGTERM drains (MOE_L2_PROXY_DRAIN_S, drain.py): streams in flight finish, probes and new requests
are answered 503 meanwhile, a stream still running when the grace ends ends with an error event in its
API's format, and the gateway exits. Real gateway processes; llama is the real one where it can hold a
stream open long enough, a trickling stand-in where the test needs a stream that outlasts the grace."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.conftest import LlamaServer
from tests.proxy.standins import TrickleLlama
from tests.proxy.support import GatewayProc, chat_body, wait_until


@pytest.fixture
def trickle() -> Iterator[Callable[..., TrickleLlama]]:
    made: list[TrickleLlama] = []

    def make(events: int = 0, interval_s: float = 0.1) -> TrickleLlama:
        made.append(TrickleLlama(events, interval_s))
        return made[-1]

    yield make
    for standin in made:
        standin.close()


class Stream:
    """A streamed request read in a thread: its status, headers and every line, once it ends."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.lines: list[str] = []
        self.error: BaseException | None = None
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url, path, body), daemon=True)
        self.thread.start()

    def _read(self, url: str, path: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + path, json=body, timeout=60) as resp:
                self.status = resp.status_code
                self.headers = dict(resp.headers)
                for line in resp.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.first.set()
        except BaseException as exc:  # the test reads it: a cut stream shows as an error here
            self.error = exc
        finally:
            self.first.set()

    def join(self) -> None:
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()


def exited(gw: GatewayProc, timeout_s: float) -> bool:
    return wait_until(lambda: gw.proc.poll() is not None, timeout_s)


def test_sigterm_lets_streams_finish_while_probes_and_new_requests_get_503(
    start_gateway: Callable[..., GatewayProc], trickle: Callable[..., TrickleLlama]
) -> None:
    llama = trickle(events=40, interval_s=0.1)  # 4 s streams: in flight for the whole check below
    gw = start_gateway(llama.url, MOE_L2_PROXY_DRAIN_S="60")
    streams = [Stream(gw.url, "/v1/chat/completions", chat_body(stream=True)) for _ in range(2)]
    for stream in streams:
        assert stream.first.wait(30) and stream.error is None
    gw.proc.send_signal(signal.SIGTERM)

    # the gateway still listens: the probes say it is draining, a new request is sent elsewhere
    assert wait_until(lambda: httpx.get(gw.url + "/healthz", timeout=10).status_code == 503, 10)
    ready = httpx.get(gw.url + "/readyz", timeout=10)
    assert ready.status_code == 503 and ready.json() == {"status": "draining"}
    refused = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(), timeout=10)
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert refused.headers["connection"] == "close"
    assert refused.json()["error"]["code"] == "shutting_down"
    assert httpx.get(gw.url + "/metrics", timeout=10).status_code == 200

    for stream in streams:
        stream.join()
        assert stream.error is None and stream.status == 200
        assert stream.lines[-1] == "data: [DONE]", stream.lines[-3:]
        assert len(stream.lines) == 41 and not any('"error"' in line for line in stream.lines)
    # nothing left in flight: it exits well before the grace
    assert exited(gw, 30)
    assert "drained in" in gw.log_text()


def test_a_real_llama_stream_in_flight_at_sigterm_finishes_whole(
    start_gateway: Callable[..., GatewayProc], long_llama: LlamaServer
) -> None:
    gw = start_gateway(long_llama.url, MOE_L2_PROXY_DRAIN_S="60")
    body = chat_body("tell me a long story", max_tokens=400, stream=True, temperature=0)
    streams = [Stream(gw.url, "/v1/chat/completions", body) for _ in range(2)]
    for stream in streams:
        assert stream.first.wait(60) and stream.error is None
    gw.proc.send_signal(signal.SIGTERM)
    for stream in streams:
        stream.join()
        assert stream.error is None and stream.status == 200
        assert stream.lines[-1] == "data: [DONE]", stream.lines[-3:]
        assert not any('"error"' in line for line in stream.lines)
    assert exited(gw, 30)


def test_a_stream_past_the_grace_ends_with_an_error_event_in_each_apis_format(
    start_gateway: Callable[..., GatewayProc], trickle: Callable[..., TrickleLlama]
) -> None:
    llama = trickle(events=0)  # streams without end
    gw = start_gateway(llama.url, MOE_L2_PROXY_DRAIN_S="1")
    openai = Stream(gw.url, "/v1/chat/completions", chat_body(stream=True))
    ollama = Stream(gw.url, "/api/chat", {"model": "demo", "messages": [{"role": "user", "content": "hi"}]})
    for stream in (openai, ollama):
        assert stream.first.wait(30) and stream.error is None
    # a blocking request llama has not answered yet: it gets a refusal it can retry elsewhere
    blocked: list[httpx.Response] = []
    waiter = threading.Thread(
        target=lambda: blocked.append(httpx.post(gw.url + "/v1/chat/completions", json=chat_body(), timeout=60))
    )
    waiter.start()
    assert wait_until(lambda: gw.metric("moe_l2_requests_in_flight") >= 3, 10)

    gw.proc.send_signal(signal.SIGTERM)
    for stream in (openai, ollama):
        stream.join()
        assert stream.error is None, stream.error  # ended, not cut
    last = openai.lines[-1]
    assert last.startswith("data: ")
    assert json.loads(last.removeprefix("data: "))["error"]["code"] == "shutting_down"
    assert "[DONE]" not in openai.lines
    assert set(json.loads(ollama.lines[-1])) == {"error"}
    assert all("error" not in json.loads(line) for line in ollama.lines[:-1])
    waiter.join(timeout=30)
    assert blocked and blocked[0].status_code == 503 and blocked[0].headers["retry-after"]
    assert blocked[0].json()["error"]["code"] == "shutting_down"
    assert exited(gw, 15)


def test_with_nothing_in_flight_sigterm_exits_at_once(
    start_gateway: Callable[..., GatewayProc], trickle: Callable[..., TrickleLlama]
) -> None:
    gw = start_gateway(trickle().url, MOE_L2_PROXY_DRAIN_S="600")
    assert gw.client.get("/healthz").status_code == 200
    gw.proc.send_signal(signal.SIGTERM)
    assert exited(gw, 15)  # not the 600 s grace
