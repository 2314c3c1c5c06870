"""Streams are relayed as they are generated, many at once, and stop when the client leaves."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import httpx
import pytest

from tests.proxy.support import chat_body, metric_value, wait_until

pytestmark = pytest.mark.llama


def timed_sse(client: httpx.Client, path: str, body: dict) -> tuple[list[float], list[dict], float]:
    """Arrival time of every content event, all events, and the request start."""
    t0 = time.perf_counter()
    arrivals: list[float] = []
    events: list[dict] = []
    with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                events.append({"done": True})
                continue
            event = json.loads(line[6:])
            events.append(event)
            if event.get("choices") and (event["choices"][0].get("delta") or {}).get("content"):
                arrivals.append(time.perf_counter())
    return arrivals, events, t0


def test_sse_is_relayed_as_generated_not_buffered(gateway):
    body = chat_body("tell me a long story", max_tokens=400, stream=True, ignore_eos=True)
    arrivals, events, t0 = timed_sse(gateway.client, "/v1/chat/completions", body)
    assert events[-1] == {"done": True}  # [DONE] preserved
    assert len(arrivals) == 400
    generation_s = events[-2]["timings"]["predicted_ms"] / 1000
    spread = arrivals[-1] - arrivals[0]
    # buffered, every chunk would arrive at once at the end (spread ~ 0)
    assert spread >= 0.5 * generation_s, (spread, generation_s)
    assert arrivals[0] - t0 < 0.5 * (arrivals[-1] - t0)


def test_ollama_ndjson_is_relayed_as_generated(gateway):
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "options": {"num_predict": 400},
    }
    arrivals: list[float] = []
    t0 = time.perf_counter()
    with gateway.client.stream("POST", "/api/chat", json=body) as resp:
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        lines = []
        for line in resp.iter_lines():
            part = json.loads(line)
            lines.append(part)
            if not part["done"]:
                arrivals.append(time.perf_counter())
    final = lines[-1]
    assert final["done"] is True and final["eval_count"] == len(arrivals)
    generation_s = final["eval_duration"] / 1e9
    # buffered, every line would arrive at once at the end (spread ~ 0, the first line as late as the last).
    # A tenth, not a half, of the generation: its 400 tokens take ~0.17 s here, and on a loaded machine the
    # reads come in bursts (CI once saw 0.027 s of spread for 0.168 s of generation, streamed all the same)
    assert arrivals[-1] - arrivals[0] >= 0.1 * generation_s, (arrivals[-1] - arrivals[0], generation_s)
    assert arrivals[0] - t0 < 0.5 * (arrivals[-1] - t0)


@dataclass
class StreamResult:
    status: int
    text: str
    usage: int
    done: bool
    first_token: float
    last_token: float


async def one_stream(client: httpx.AsyncClient, tokens: int) -> StreamResult:
    body = chat_body("write a python function", max_tokens=tokens, stream=True, ignore_eos=True)
    body["stream_options"] = {"include_usage": True}
    text, usage, done, arrivals = [], 0, False, []
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        status = resp.status_code
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]["completion_tokens"]
                if event.get("choices") and event["choices"][0]["delta"].get("content"):
                    text.append(event["choices"][0]["delta"]["content"])
                    arrivals.append(time.perf_counter())
    return StreamResult(status, "".join(text), usage, done, arrivals[0], arrivals[-1])


async def run_streams(url: str, n: int, tokens: int) -> tuple[float, list[StreamResult]]:
    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, tokens) for _ in range(n)))
        return time.perf_counter() - t0, list(results)


def peak_overlap(results: list[StreamResult]) -> int:
    """The most streams that were between their first and last token at the same moment."""
    edges = sorted([(r.first_token, 1) for r in results] + [(r.last_token, -1) for r in results])
    peak = current = 0
    for _, step in edges:
        current += step
        peak = max(peak, current)
    return peak


@pytest.mark.slow
def test_32_concurrent_streams_are_not_serialized(start_gateway, batching_llama32):
    gateway = start_gateway(batching_llama32.url)
    tokens = 48
    one = statistics.median(asyncio.run(run_streams(gateway.url, 1, tokens))[0] for _ in range(3))
    # the same 32 streams straight to llama and through the gateway, alternated
    direct = [asyncio.run(run_streams(batching_llama32.url, 32, tokens))[0]]
    wall, results = asyncio.run(run_streams(gateway.url, 32, tokens))
    direct.append(asyncio.run(run_streams(batching_llama32.url, 32, tokens))[0])
    for r in results:
        assert r.status == 200 and r.done and r.text and r.usage == tokens
    ratio = wall / (32 * one)
    print(f"32 streams: gateway {wall:.2f}s, llama alone {direct}, one stream {one:.3f}s, wall/(32 x one) {ratio:.2f}")
    # served one at a time, at most one stream would be generating at any moment; the ratio is printed, not
    # asserted: it measured 0.4 on 2 quiet cores and 0.61 in a CI run, a timing, not the behaviour
    assert peak_overlap(results) >= 16
    # the gateway adds no queueing of its own: it takes about what llama alone takes for 32 streams
    assert wall < 1.5 * min(direct) + 1.0, (wall, direct)


def llama_counters(llama) -> tuple[float, float]:
    text = llama.metrics()
    return metric_value(text, "llamacpp:tokens_predicted_total"), metric_value(text, "llamacpp:requests_processing")


@pytest.mark.slow
def test_client_disconnect_cancels_generation(start_gateway, long_llama):
    gw = start_gateway(long_llama.url)
    before, busy = llama_counters(long_llama)
    assert busy == 0
    requested = 8000
    body = {"prompt": "tell me everything", "max_tokens": requested, "stream": True, "ignore_eos": True}
    received = 0
    with (
        httpx.Client(base_url=gw.url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as resp,
    ):
        for line in resp.iter_lines():
            received += line.startswith("data: ")
            if received >= 20:
                break  # leaving the block closes the connection mid-stream
    # the slot is released once the gateway closes its upstream connection
    assert wait_until(lambda: llama_counters(long_llama)[1] == 0, timeout_s=5), "llama kept generating"
    settled, _ = llama_counters(long_llama)
    time.sleep(1.0)
    after, busy = llama_counters(long_llama)
    assert after == settled and busy == 0  # nothing grows any more
    assert received <= after - before < requested / 2
    assert wait_until(lambda: gw.metric("moe_l2_requests_total", route="/v1/completions", status="499") == 1, 5)
