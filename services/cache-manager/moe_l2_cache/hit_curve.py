"""The hit curve for llama-server's `--moe-cache-bytes auto`: the shipped curve's shape, through the hit rate
the engine's expert cache measured.

llama-server splits its device budget between whole layers of experts and the expert cache before the model
loads, by a cost model that needs the cache's hit rate at each share of a layer's experts it could hold: the
file of `--moe-cache-hit-curve` (format: moe_l2_placement.hit_curve). Without one it reads the shipped default
(DEFAULT_HIT_CURVE), the project's policy replayed on DeepSeek-V2-Lite's ESFT routing.

What is measured, and what is not. The engine's cache counts, in `/metrics`, `llamacpp:moe_cache_accesses_total`
(distinct experts used, per micro-batch and cached layer, the micro-batches that fit the slots: decode steps
and small prompts; a wider one bypasses the slots and is counted elsewhere) and `llamacpp:moe_cache_hits_total`
(those served from a slot); `GET /moe/cache` gives its shape (`n_slot` slots a layer of `n_expert` experts;
501 when the server runs without the cache). That is one point of the policy's curve: the share
share0 = n_slot / n_expert, the hit rate hit0 = hits / accesses. The rest of the curve cannot be measured on a
running engine (it holds one slot count), and the routing counts cannot replace it: the static top-s mass of
the flywheel's tables (a cache holding each layer's s most used experts of all the traffic) is 0.20 / 0.39 /
0.69 at 6 / 14 / 32 of 64 experts on the ESFT routing, where the policy reaches 0.54 / 0.64 / 0.81 (the shipped
curve, the engine's measured decode hit rates), because counts summed over tokens cannot see the reuse between
consecutive tokens that an adaptive cache lives on. Such a curve would make `auto` keep whole layers the cache
would serve better.

So `calibrated_curve` keeps the shipped curve's shape and moves it through the measured point: each point's hit
times hit0 / prior.hit(share0), clipped to [0, 1], then made non-decreasing. `HitCurveWriter` reads the engine's
counters every MOE_L2_CACHE_HIT_CURVE_INTERVAL_S, adds up their increase since the cache-manager started (over
restarts of llama with the same cache shape; a cache of another shape starts the count again, its share is
another point), and once that holds MOE_L2_CACHE_HIT_CURVE_MIN_ACCESSES accesses writes the curve to
MOE_L2_CACHE_HIT_CURVE_PATH (atomically), where `moe-l2 up` points the next llama-server's flag; once more
when the service stops. No cache on the engine, no counters, too few accesses: nothing is written, the shipped
prior stays (said once per reason). The settings say why the minimum and the interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from moe_l2_contracts.schemas.llama import ExpertCacheShape
from moe_l2_placement.hit_curve import DEFAULT_HIT_CURVE, HitCurve, write_hit_curve

log = logging.getLogger("moe_l2_cache.hit_curve")

# llama-server's counters of its expert cache (patch 0028, docs/expert-cache.md "Counters"), since it started
ACCESSES_METRIC = "llamacpp:moe_cache_accesses_total"
HITS_METRIC = "llamacpp:moe_cache_hits_total"

# digits of the hit rates written (the shares are the prior's, as it has them)
HIT_DIGITS = 6


def calibrated_curve(prior: HitCurve, share0: float, hit0: float) -> HitCurve:
    """`prior`'s shape through the measured point (share0, hit0): every hit times hit0 / prior.hit(share0),
    clipped to [0, 1] and rounded to HIT_DIGITS, then the running maximum (more slots never hit less). The
    result passes through (share0, hit0) unless clipped there. ValueError when the prior has no hit at share0
    (share0 <= 0) or hit0 is not in [0, 1]."""
    base = prior.hit(share0)
    if not base > 0.0:
        raise ValueError(f"the prior has no hit rate at share {share0!r} to scale")
    if not 0.0 <= hit0 <= 1.0:
        raise ValueError(f"hit rate {hit0!r} is not in [0, 1]")
    scale = hit0 / base
    points, running = [], 0.0
    for share, hit in prior.points:
        running = max(running, round(min(1.0, max(0.0, hit * scale)), HIT_DIGITS))
        points.append((share, running))
    return HitCurve(tuple(points))


@dataclass(frozen=True)
class CacheReading:
    """One look at llama's expert cache: its shape (GET /moe/cache) and its counters since llama started."""

    n_slot: int
    n_expert: int
    accesses: int
    hits: int


class NoCacheCounters(Exception):
    """llama has no expert cache to read (or no counters of it): nothing to calibrate on; the message says why."""


class CacheReadError(Exception):
    """llama could not be read (unreachable, an answer that is not the contract); the message says why."""


async def read_engine_cache(llama: httpx.AsyncClient, timeout: httpx.Timeout) -> CacheReading:
    """The cache's shape and counters: GET /moe/cache, then GET /metrics (prometheus_client's parser).
    NoCacheCounters: no cache (501/404) or no counters; CacheReadError: anything else that went wrong."""
    try:
        resp = await llama.get("/moe/cache", timeout=timeout)
    except httpx.HTTPError as e:
        raise CacheReadError(f"llama unreachable: {type(e).__name__}: {e}") from e
    if resp.status_code in (404, 501):  # a build without the cache's routes, or the cache off
        raise NoCacheCounters(f"llama runs without the expert cache (GET /moe/cache: {resp.status_code})")
    if resp.status_code != 200:
        raise CacheReadError(f"llama answered {resp.status_code} to GET /moe/cache: {resp.text[:200]}")
    try:
        shape = ExpertCacheShape.model_validate(resp.json())
    except (ValueError, ValidationError) as e:
        raise CacheReadError(f"llama's GET /moe/cache answer does not fit the contract: {e}") from e
    if shape.n_slot <= 0 or shape.n_expert <= 0:
        raise NoCacheCounters(f"llama's expert cache has {shape.n_slot} slots of {shape.n_expert} experts")
    try:
        resp = await llama.get("/metrics", timeout=timeout)
    except httpx.HTTPError as e:
        raise CacheReadError(f"llama unreachable: {type(e).__name__}: {e}") from e
    if resp.status_code in (404, 501):  # llama-server without --metrics
        raise NoCacheCounters(f"llama serves no /metrics ({resp.status_code}): its hit rate cannot be read")
    if resp.status_code != 200:
        raise CacheReadError(f"llama answered {resp.status_code} to GET /metrics: {resp.text[:200]}")
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(resp.text):
            for sample in family.samples:
                if sample.name in (ACCESSES_METRIC, HITS_METRIC) and not sample.labels:
                    values[sample.name] = float(sample.value)
    except ValueError as e:
        raise CacheReadError(f"llama's /metrics does not parse: {e}") from e
    if ACCESSES_METRIC not in values or HITS_METRIC not in values:
        raise NoCacheCounters(f"llama's /metrics has no {ACCESSES_METRIC} and {HITS_METRIC}")
    accesses, hits = values[ACCESSES_METRIC], values[HITS_METRIC]
    if not (0 <= hits <= accesses < 2**53):
        raise CacheReadError(f"llama's cache counters make no sense: {hits} hits of {accesses} accesses")
    return CacheReading(shape.n_slot, shape.n_expert, int(accesses), int(hits))


class CounterWindow:
    """The increase of llama's counters since the first reading, for one cache shape (slots, experts): what
    Prometheus's increase() does. A counter that went down (llama restarted) counts from 0; a reading of
    another shape (llama restarted with another placement) starts the window again from that reading."""

    def __init__(self) -> None:
        self.shape: tuple[int, int] | None = None
        self.accesses = 0
        self.hits = 0
        self._last: tuple[int, int] = (0, 0)

    def add(self, reading: CacheReading) -> None:
        shape = (reading.n_slot, reading.n_expert)
        if shape != self.shape:  # the first reading, or another cache: its counts from here on
            self.shape, self.accesses, self.hits = shape, 0, 0
        else:
            d_acc, d_hit = reading.accesses - self._last[0], reading.hits - self._last[1]
            if d_acc < 0 or d_hit < 0 or d_hit > d_acc:  # a restart: the counters are llama's new ones
                d_acc, d_hit = reading.accesses, reading.hits
            self.accesses += d_acc
            self.hits += d_hit
        self._last = (reading.accesses, reading.hits)


@dataclass(frozen=True)
class Anchor:
    """The measured point: the share of a layer's experts the cache holds and its hit rate over `accesses`."""

    n_slot: int
    n_expert: int
    accesses: int
    hits: int

    @property
    def share(self) -> float:
        return min(1.0, self.n_slot / self.n_expert)

    @property
    def hit(self) -> float:
        return self.hits / self.accesses


@dataclass
class HitCurveStats:
    writes: int = 0
    errors: int = 0
    last_write_at: float | None = None
    last_anchor: Anchor | None = None  # the point the last curve was written through
    last_error: str = ""


class HitCurveWriter:
    """Writes `calibrated_curve(prior, anchor)` to `path`, the anchor read from llama's expert cache."""

    def __init__(
        self,
        llama: httpx.AsyncClient,
        path: Path,
        *,
        min_accesses: int,
        interval_s: float,
        timeout: httpx.Timeout,
        prior: HitCurve,
        n_expert: int | None = None,
        model: str = "",
    ) -> None:
        self.llama = llama
        self.path = path
        self.min_accesses = min_accesses
        self.interval_s = interval_s
        self.timeout = timeout
        self.prior = prior
        self.n_expert = n_expert  # the indexed model's: a cache of another count is another model's
        self.model = model
        self.window = CounterWindow()
        self.stats = HitCurveStats()
        self._written: tuple[tuple[int, int] | None, int] | None = None  # the window the file was written from
        self._state = ""  # what was last logged: each reason once, not each round

    async def run(self) -> None:
        """Read now (the start of the window), then every interval; until cancelled."""
        while True:
            try:
                await self.write_if_due()
            except Exception:  # a bug must not stop the writer; the next round tries again
                log.exception("hit curve: round failed")
            await asyncio.sleep(self.interval_s)

    async def write_if_due(self) -> bool:
        """Read llama's counters into the window; write the curve when the window holds enough accesses that
        the file does not have yet. True when written. Never raises for llama or the file: each reason is said
        once, and the next round tries again."""
        try:
            reading = await read_engine_cache(self.llama, self.timeout)
        except NoCacheCounters as e:
            self._settle(str(e), f"hit curve: not written ({e}); llama-server reads the shipped one")
            return False
        except CacheReadError as e:
            return self._failed(f"hit curve: not written, {e}")
        if self.n_expert is not None and reading.n_expert != self.n_expert:
            return self._failed(
                f"hit curve: not written, llama's expert cache has {reading.n_expert} experts a layer, the indexed "
                f"model {self.n_expert}: is MOE_L2_MODEL_PATH right?"
            )
        self.window.add(reading)
        if self.window.accesses < self.min_accesses:
            self._settle(
                "waiting",
                f"hit curve: not written yet, llama's expert cache has made {self.window.accesses} accesses of "
                f"the {self.min_accesses} needed since the count began (MOE_L2_CACHE_HIT_CURVE_MIN_ACCESSES)",
            )
            return False
        if (self.window.shape, self.window.accesses) == self._written:
            return False  # nothing new since the last write
        anchor = Anchor(reading.n_slot, reading.n_expert, self.window.accesses, self.window.hits)
        curve = calibrated_curve(self.prior, anchor.share, anchor.hit)
        try:
            await asyncio.to_thread(self._write, curve, self._comment(anchor))
        except OSError as e:
            return self._failed(f"hit curve: cannot write {self.path} ({e}); llama keeps the curve it has")
        self._written = (self.window.shape, anchor.accesses)
        self.stats.writes += 1
        self.stats.last_write_at = time.time()
        self.stats.last_anchor = anchor
        self._settle(
            "writing",
            f"hit curve: written to {self.path}, the shipped shape through llama's measured {anchor.hit:.4f} at "
            f"{anchor.n_slot} of {anchor.n_expert} slots ({anchor.accesses} accesses)",
        )
        return True

    def _write(self, curve: HitCurve, comment: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)  # `moe-l2 up`'s state folder has no hit-curves/ yet
        write_hit_curve(self.path, curve, comment)

    def _comment(self, anchor: Anchor) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        url = str(self.llama.base_url).rstrip("/")
        model = f"model {self.model}, " if self.model else ""
        text = (
            f"The expert cache's hit rate against the share of a layer's experts it holds, written by the moe-l2\n"
            f"cache-manager {stamp}: the shape of the shipped curve ({DEFAULT_HIT_CURVE.name}, the project's\n"
            "policy replayed on DeepSeek-V2-Lite's ESFT routing), each hit scaled by one factor so that it passes\n"
            "through the hit rate llama-server measured, clipped to [0, 1] and made non-decreasing.\n"
            f"Anchor: share {anchor.share!r} ({anchor.n_slot} of {anchor.n_expert} slots), hit {anchor.hit:.6f} "
            f"({anchor.hits} hits of {anchor.accesses} accesses,\n"
            f"{ACCESSES_METRIC} since the count began), {model}llama {url};\n"
            f"factor {anchor.hit / self.prior.hit(anchor.share):.6f} on the shipped curve's "
            f"{self.prior.hit(anchor.share):.6f} there.\n"
            "llama-server's --moe-cache-bytes auto reads it at its start: --moe-cache-hit-curve FILE."
        )
        return text.encode("ascii", "replace").decode("ascii")  # the format is ASCII; a model's name may not be

    def _failed(self, reason: str) -> bool:
        self.stats.errors += 1
        self.stats.last_error = reason
        if reason != self._state:
            log.warning("%s", reason)
        self._state = reason
        return False

    def _settle(self, state: str, message: str) -> None:
        if state != self._state:
            log.info("%s", message)
        self._state = state
