"""The hit curve the cache-manager writes for llama-server's `--moe-cache-bytes auto` (moe_l2_cache.hit_curve):
the shipped curve's shape through the hit rate llama's expert cache measured. The calibration's arithmetic on
planted curves by hand, its clipping and monotonicity; the anchor read from llama's /metrics and GET /moe/cache
as llama-server writes them, served over real HTTP by a small server whose counters the test moves; nothing
written without a cache, without counters or before the minimum of accesses; the write atomic; the service's
lifespan (start: the count begins; stop: the last write) and its settings."""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import os
import random
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from moe_l2_cache.app import create_app
from moe_l2_cache.hit_curve import (
    ACCESSES_METRIC,
    HITS_METRIC,
    CacheReading,
    CounterWindow,
    HitCurveWriter,
    calibrated_curve,
)
from moe_l2_cache.settings import CacheSettings
from moe_l2_gguf.index import load_index
from moe_l2_ops.supervisor import free_port
from moe_l2_placement.hit_curve import DEFAULT_HIT_CURVE, HitCurve, read_hit_curve
from tests.waiting import wait_until

PRIOR = HitCurve(((0.25, 0.4), (0.5, 0.6), (0.75, 0.8), (1.0, 0.9)))
SHIPPED = read_hit_curve(DEFAULT_HIT_CURVE)
TIMEOUT = httpx.Timeout(5.0, connect=2.0)


# -- the calibration ------------------------------------------------------------------------------------------


def test_the_prior_s_shape_is_scaled_through_the_measured_point() -> None:
    # share 0.375 lies halfway between 0.4 and 0.6: the prior says 0.5 there; measured 0.6, so every hit x 1.2,
    # and the last one (1.08) is clipped to 1
    curve = calibrated_curve(PRIOR, 0.375, 0.6)
    assert curve.points == ((0.25, 0.48), (0.5, 0.72), (0.75, 0.96), (1.0, 1.0))
    assert curve.hit(0.375) == pytest.approx(0.6)
    # below the prior's first share the line runs from (0, 0): 0.2 at 0.125; measured 0.1, so every hit x 0.5
    curve = calibrated_curve(PRIOR, 0.125, 0.1)
    assert curve.points == ((0.25, 0.2), (0.5, 0.3), (0.75, 0.4), (1.0, 0.45))
    assert curve.hit(0.125) == pytest.approx(0.1)
    # the prior's own point gives the prior back
    assert calibrated_curve(PRIOR, 0.5, 0.6) == PRIOR
    assert calibrated_curve(SHIPPED, 7 / 64, 0.5658) == SHIPPED


def test_clipped_to_one_and_never_decreasing() -> None:
    # measured 0.95 where the prior says 0.4: x 2.375, every point above 1 is 1
    assert calibrated_curve(PRIOR, 0.25, 0.95).points == ((0.25, 0.95), (0.5, 1.0), (0.75, 1.0), (1.0, 1.0))
    # no hit at all: a flat curve at 0, still a curve
    assert calibrated_curve(PRIOR, 0.5, 0.0).points == ((0.25, 0.0), (0.5, 0.0), (0.75, 0.0), (1.0, 0.0))
    # hits that differ below the written digits round to one value, never to a decrease
    close = HitCurve(((0.5, 0.3333333), (0.75, 0.33333334), (1.0, 0.3333334)))
    assert [h for _, h in calibrated_curve(close, 0.5, 0.3333333).points] == [0.333333] * 3
    rng = random.Random(7)
    for _ in range(500):
        n = rng.randint(2, 12)
        shares = sorted(rng.sample(range(1, 65), n))
        hits = sorted(rng.random() for _ in range(n))
        prior = HitCurve(tuple((s / 64, h) for s, h in zip(shares, hits, strict=True)))
        share0, hit0 = rng.randint(1, 64) / 64, rng.random()
        if prior.hit(share0) <= 0.0:
            continue
        curve = calibrated_curve(prior, share0, hit0)  # a HitCurve: checked on construction
        values = [h for _, h in curve.points]
        assert all(0.0 <= h <= 1.0 for h in values) and values == sorted(values)
        assert [s for s, _ in curve.points] == [s for s, _ in prior.points]
        if hit0 / prior.hit(share0) * max(hits) <= 1.0:  # nothing clipped: the curve passes through the anchor
            assert curve.hit(share0) == pytest.approx(hit0, abs=2e-6)


def test_what_cannot_be_calibrated_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no hit rate at share 0\.0"):
        calibrated_curve(PRIOR, 0.0, 0.5)
    with pytest.raises(ValueError, match="not in"):
        calibrated_curve(PRIOR, 0.5, 1.5)


def test_the_window_counts_the_increase_across_llama_restarts() -> None:
    window = CounterWindow()
    reading = CacheReading
    window.add(reading(7, 64, 5000, 2000))  # what llama counted before the count began is not in it
    assert (window.accesses, window.hits) == (0, 0)
    window.add(reading(7, 64, 15000, 8000))
    assert (window.accesses, window.hits) == (10000, 6000)
    window.add(reading(7, 64, 3000, 1000))  # llama restarted: its counters start from 0
    assert (window.accesses, window.hits) == (13000, 7000)
    window.add(reading(7, 64, 4000, 3000))  # more hits than accesses since the last look: another restart
    assert (window.accesses, window.hits) == (17000, 10000)
    window.add(reading(14, 64, 9000, 6000))  # another placement: another point of the curve, counted anew
    assert (window.shape, window.accesses, window.hits) == ((14, 64), 0, 0)
    window.add(reading(14, 64, 10000, 6500))
    assert (window.accesses, window.hits) == (1000, 500)


# -- llama, played over HTTP ----------------------------------------------------------------------------------


def metrics_text(n_slot: int, accesses: int, hits: int) -> str:
    """llama-server's /metrics with the expert cache on: upstream's families, then patch 0028's block (the
    order, names, help and types it writes), with per-domain counters that must not be taken for the totals."""
    upstream = [
        ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", 5120),
        ("prompt_seconds_total", "counter", "Prompt process time", 3.5),
        ("tokens_predicted_total", "counter", "Number of generation tokens processed.", accesses // 150),
        ("tokens_predicted_seconds_total", "counter", "Predict process time", 12.25),
        ("n_decode_total", "counter", "Total number of llama_decode() calls", 812),
        ("n_tokens_max", "counter", "Largest observed n_tokens.", 512),
        ("n_busy_slots_per_decode", "counter", "Average number of busy slots per llama_decode() call", 1.0),
        ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.", 1462.9),
        ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.", 61.3),
        ("requests_processing", "gauge", "Number of requests processing.", 1),
        ("requests_deferred", "gauge", "Number of requests deferred.", 0),
    ]
    cache = [
        ("moe_cache_slots", "gauge", "Expert slots per cached layer in device memory.", n_slot),
        ("moe_cache_layers", "gauge", "MoE layers whose host-resident experts are cached.", 26),
        ("moe_cache_device_bytes", "gauge", "Device memory taken by the expert cache.", n_slot * 26 * 8650752),
        ("moe_cache_accesses_total", "counter", "Distinct experts used, per micro-batch and cached layer.", accesses),
        ("moe_cache_hits_total", "counter", "Expert uses served from a slot.", hits),
        ("moe_cache_misses_total", "counter", "Expert uses copied from host memory into a slot first.",
         accesses - hits),
        ("moe_cache_loads_total", "counter", "Experts copied into slots.", accesses - hits + 40),
        ("moe_cache_prefetch_total", "counter",
         "Experts copied into slots ahead of use by the cross-layer prefetch.", 40),
    ]  # fmt: skip
    out = []
    for name, kind, help_, value in upstream + cache:
        out += [f"# HELP llamacpp:{name} {help_}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {value}"]
    for name in ("moe_cache_domain_accesses_total", "moe_cache_domain_hits_total"):
        out += [f"# HELP llamacpp:{name} Per domain.", f"# TYPE llamacpp:{name} counter"]
        out += [f'llamacpp:{name}{{domain="{d}"}} {accesses * 7}' for d in ("math", "untagged")]
    return "\n".join(out) + "\n"


@dataclass
class FakeLlama:
    """llama-server's GET /moe/cache and GET /metrics for an expert cache of `n_slot` of `n_expert` experts a
    layer, its counters where the test puts them; `cache_status` 501 is a server without the cache."""

    url: str = ""
    n_slot: int = 7
    n_expert: int = 64
    accesses: int = 0
    hits: int = 0
    cache_status: int = 200
    counters: bool = True  # False: a /metrics without the cache's families
    requests: Counter[str] = field(default_factory=Counter)

    def cache_body(self) -> dict:
        return {
            "profile": ["math", "untagged"],
            "n_layer": 26,
            "n_slot": self.n_slot,
            "n_expert": self.n_expert,
            "layers": list(range(1, 27)),
            "device_bytes": self.n_slot * 26 * 8650752,
            "slot_bytes": 8650752,
            "ahead_bytes": 0,
        }

    def answer(self, path: str) -> tuple[int, str, bytes]:
        self.requests[path] += 1
        if path == "/moe/cache":
            if self.cache_status != 200:
                error = {"code": 501, "message": "the expert cache is off (start the server with --moe-cache-bytes)"}
                return self.cache_status, "application/json", json.dumps({"error": error}).encode()
            return 200, "application/json", json.dumps(self.cache_body()).encode()
        if path == "/metrics":
            text = metrics_text(self.n_slot, self.accesses, self.hits)
            if not self.counters:
                text = "".join(line + "\n" for line in text.splitlines() if "moe_cache" not in line)
            return 200, "text/plain; version=0.0.4", text.encode()
        return 404, "application/json", b'{"error": {"code": 404, "message": "File Not Found"}}'


@pytest.fixture
def llama() -> Iterator[FakeLlama]:
    fake = FakeLlama()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # the headers and the body are two writes: no 40 ms wait for an ACK

        def do_GET(self) -> None:
            status, content_type, body = fake.answer(self.path.split("?", 1)[0])
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


def writer(llama: FakeLlama, path: Path, *, min_accesses: int = 10_000, prior: HitCurve = SHIPPED) -> HitCurveWriter:
    client = httpx.AsyncClient(base_url=llama.url, timeout=TIMEOUT)
    return HitCurveWriter(
        client, path, min_accesses=min_accesses, interval_s=60, timeout=TIMEOUT, prior=prior, n_expert=64, model="m"
    )


# -- the writer -----------------------------------------------------------------------------------------------


def test_written_once_llama_counted_enough_accesses(llama: FakeLlama, tmp_path: Path) -> None:
    path = tmp_path / "hit-curves" / "model.txt"  # a folder that does not exist yet
    llama.accesses, llama.hits = 50_000, 10_000  # before the cache-manager started: not its to count

    async def run() -> None:
        w = writer(llama, path)
        assert not await w.write_if_due()  # the count begins
        llama.accesses, llama.hits = 56_000, 13_000
        assert not await w.write_if_due()  # 6,000 of the 10,000 needed
        assert not path.exists()
        llama.accesses, llama.hits = 70_000, 20_000  # 20,000 accesses since, 10,000 hits: 0.5 at 7 of 64
        assert await w.write_if_due()
        curve = read_hit_curve(path)
        factor = 0.5 / 0.5658  # the shipped curve's hit at 7 / 64 slots
        assert [s for s, _ in curve.points] == [s for s, _ in SHIPPED.points]
        assert curve.points == tuple((s, round(min(1.0, h * factor), 6)) for s, h in SHIPPED.points)
        assert curve.hit(7 / 64) == pytest.approx(0.5, abs=1e-6)
        text = path.read_text()
        assert "share 0.109375 (7 of 64 slots), hit 0.500000 (10000 hits of 20000 accesses" in text
        assert f"llama {llama.url};" in text and "hit-curve-default.txt" in text and "--moe-cache-hit-curve" in text
        assert oct(path.stat().st_mode & 0o777) == "0o644"
        assert w.stats.writes == 1 and w.stats.last_anchor is not None and w.stats.last_anchor.accesses == 20_000
        # no new accesses: no new write
        before = path.stat().st_mtime_ns
        assert not await w.write_if_due()
        assert path.stat().st_mtime_ns == before
        # new accesses: written again, from every access since the count began
        llama.accesses, llama.hits = 90_000, 36_000  # 40,000 accesses, 26,000 hits since
        assert await w.write_if_due()
        assert read_hit_curve(path).hit(7 / 64) == pytest.approx(0.65, abs=1e-6)
        assert sorted(p.name for p in path.parent.iterdir()) == ["model.txt"]  # no temporary left
        await w.llama.aclose()

    asyncio.run(run())
    assert llama.requests == {"/moe/cache": 5, "/metrics": 5}


@pytest.mark.parametrize(
    ("setup", "said"),
    [
        ({"cache_status": 501}, "llama runs without the expert cache (GET /moe/cache: 501)"),
        ({"counters": False}, f"llama's /metrics has no {ACCESSES_METRIC} and {HITS_METRIC}"),
    ],
)
def test_without_the_cache_s_counters_nothing_is_written_and_it_is_said_once(
    llama: FakeLlama, tmp_path: Path, caplog: pytest.LogCaptureFixture, setup: dict, said: str
) -> None:
    for name, value in setup.items():
        setattr(llama, name, value)
    path = tmp_path / "model.txt"

    async def run() -> None:
        w = writer(llama, path, min_accesses=1)
        for step in range(3):
            llama.accesses, llama.hits = 10_000 * step, 5_000 * step
            assert not await w.write_if_due()
        assert w.stats.errors == 0 and w.stats.writes == 0
        await w.llama.aclose()

    with caplog.at_level(logging.INFO, logger="moe_l2_cache.hit_curve"):
        asyncio.run(run())
    assert not path.exists()
    logged = [r for r in caplog.records if r.name == "moe_l2_cache.hit_curve"]
    assert [(r.levelno, r.getMessage()) for r in logged] == [
        (logging.INFO, f"hit curve: not written ({said}); llama-server reads the shipped one")
    ]


def test_too_few_accesses_are_said_once_and_a_new_placement_counts_anew(
    llama: FakeLlama, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "model.txt"

    async def run() -> None:
        w = writer(llama, path, min_accesses=10_000)
        for step in range(4):  # 0, 3,000, 6,000, 9,000 accesses since the count began
            llama.accesses, llama.hits = 3_000 * step, 2_000 * step
            assert not await w.write_if_due()
        # llama restarted with another placement (14 slots): its counts are another point, counted anew
        llama.n_slot, llama.accesses, llama.hits = 14, 2_000, 1_000
        assert not await w.write_if_due()
        llama.accesses, llama.hits = 11_000, 7_000
        assert not await w.write_if_due()  # 9,000 at 14 slots; the 9,000 at 7 slots are another point's
        llama.accesses, llama.hits = 12_000, 7_600
        assert await w.write_if_due()
        anchor = w.stats.last_anchor
        assert anchor is not None and (anchor.n_slot, anchor.accesses, anchor.hits) == (14, 10_000, 6_600)
        assert read_hit_curve(path).hit(14 / 64) == pytest.approx(0.66, abs=1e-6)
        await w.llama.aclose()

    with caplog.at_level(logging.INFO, logger="moe_l2_cache.hit_curve"):
        asyncio.run(run())
    messages = [r.getMessage() for r in caplog.records if r.name == "moe_l2_cache.hit_curve"]
    assert len([m for m in messages if "not written yet" in m]) == 1
    assert "of the 10000 needed since the count began (MOE_L2_CACHE_HIT_CURVE_MIN_ACCESSES)" in messages[0]
    assert messages[-1].startswith(f"hit curve: written to {path}, the shipped shape through llama's measured 0.6600")


def test_llama_unreachable_or_another_model_is_said_once_and_survived(
    llama: FakeLlama, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "model.txt"

    async def run() -> None:
        down = httpx.AsyncClient(base_url=f"http://127.0.0.1:{free_port()}", timeout=TIMEOUT)
        w = HitCurveWriter(down, path, min_accesses=1, interval_s=60, timeout=TIMEOUT, prior=SHIPPED, n_expert=64)
        for _ in range(2):
            assert not await w.write_if_due()
        assert w.stats.errors == 2 and "llama unreachable: ConnectError" in w.stats.last_error
        await down.aclose()
        llama.n_expert = 32  # llama serves another model than the indexed one: its curve is not this file's
        w = writer(llama, path, min_accesses=1)
        for step in range(2):
            llama.accesses, llama.hits = 1000 * step, 500 * step
            assert not await w.write_if_due()
        assert w.stats.errors == 2 and "32 experts a layer, the indexed model 64" in w.stats.last_error
        await w.llama.aclose()

    with caplog.at_level(logging.WARNING, logger="moe_l2_cache.hit_curve"):
        asyncio.run(run())
    assert not path.exists()
    assert len([r for r in caplog.records if "llama unreachable" in r.getMessage()]) == 1
    assert len([r for r in caplog.records if "MOE_L2_MODEL_PATH" in r.getMessage()]) == 1


def test_a_write_that_fails_leaves_the_last_curve_whole(
    llama: FakeLlama, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The file is replaced by a rename of a complete one, or not at all: a llama starting reads either curve."""
    path = tmp_path / "model.txt"
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")

    async def run() -> None:
        w = writer(llama, path, min_accesses=1)
        await w.write_if_due()
        llama.accesses, llama.hits = 1000, 500
        assert await w.write_if_due()
        written = path.read_text()
        llama.accesses, llama.hits = 2000, 1500

        def refused(src: object, dst: object) -> None:
            raise OSError(28, "No space left on device")

        with monkeypatch.context() as m:
            m.setattr(os, "replace", refused)
            assert not await w.write_if_due()
        assert path.read_text() == written and sorted(p.name for p in tmp_path.iterdir()) == [
            "model.txt",
            "not-a-folder",
        ]
        assert "hit curve: cannot write" in w.stats.last_error and "No space left on device" in w.stats.last_error
        assert await w.write_if_due()  # the next round writes what the failed one could not
        assert read_hit_curve(path).hit(7 / 64) == pytest.approx(0.75, abs=1e-6)
        # a path that can never be written: said once, the service goes on
        w.path = blocker / "model.txt"
        for step in (3, 4):
            llama.accesses, llama.hits = 1000 * step, 500 * step
            assert not await w.write_if_due()
        await w.llama.aclose()

    with caplog.at_level(logging.WARNING, logger="moe_l2_cache.hit_curve"):
        asyncio.run(run())
    assert len([r for r in caplog.records if f"cannot write {blocker / 'model.txt'}" in r.getMessage()]) == 1


# -- in the service -------------------------------------------------------------------------------------------


def test_the_service_counts_from_its_start_and_writes_when_it_stops(
    llama: FakeLlama, demo_model: Path, tmp_path: Path
) -> None:
    """In the app's lifespan: the first round at start begins the count, the stop writes what llama counted
    since. The demo model has 32 experts a layer; Redis is down, which the hit curve does not need."""
    llama.n_expert, llama.n_slot = load_index(demo_model).n_expert, 8
    llama.accesses, llama.hits = 1_000_000, 900_000  # before the service: not counted
    path = tmp_path / "curves" / "demo.txt"
    settings = CacheSettings(
        model_path=demo_model,
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        llama_url=llama.url,
        pull_interval_s=0,
        engine_profile_interval_s=0,
        hit_curve_path=path,
        hit_curve_min_accesses=100_000,
    )
    app = create_app(settings)
    with TestClient(app):
        hit_curve = app.state.service.hit_curve
        wait_until(lambda: hit_curve.window.shape is not None, 10, "the hit curve's first round")
        llama.accesses, llama.hits = 1_150_000, 990_000  # 150,000 accesses, 90,000 hits since the start
        assert not path.exists()  # the next round is a minute away
    curve = read_hit_curve(path)
    assert curve.hit(8 / 32) == pytest.approx(0.6, abs=1e-6)
    assert curve.points == calibrated_curve(SHIPPED, 0.25, 0.6).points
    assert "(8 of 32 slots), hit 0.600000 (90000 hits of 150000 accesses" in path.read_text()


def test_the_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    settings = CacheSettings()
    assert (settings.hit_curve_path, settings.hit_curve_min_accesses, settings.hit_curve_interval_s) == (
        None,
        1_000_000,
        60,
    )
    monkeypatch.setenv("MOE_L2_CACHE_HIT_CURVE_PATH", "")  # compose's ${VAR:-}: unset, not the current folder
    assert CacheSettings().hit_curve_path is None
    monkeypatch.setenv("MOE_L2_CACHE_HIT_CURVE_PATH", str(tmp_path / "c.txt"))
    monkeypatch.setenv("MOE_L2_CACHE_HIT_CURVE_MIN_ACCESSES", "250000")
    monkeypatch.setenv("MOE_L2_CACHE_HIT_CURVE_INTERVAL_S", "15")
    settings = CacheSettings()
    assert (settings.hit_curve_path, settings.hit_curve_min_accesses, settings.hit_curve_interval_s) == (
        tmp_path / "c.txt",
        250_000,
        15,
    )
    for name, bad in (("MOE_L2_CACHE_HIT_CURVE_MIN_ACCESSES", "0"), ("MOE_L2_CACHE_HIT_CURVE_INTERVAL_S", "0")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name.removeprefix("MOE_L2_CACHE_").lower()):
            CacheSettings()
        monkeypatch.delenv(name)
