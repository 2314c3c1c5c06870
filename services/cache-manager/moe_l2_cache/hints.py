"""The active domain: hints switch it (after a minimum dwell), and a switch prepares the new domain's experts.

A switch pushes the domain's hot set to llama (`POST /moe/hot-set`) and re-pins the expert pool.
Hints for another domain within the dwell time do not switch (alternating requests would thrash
the pool); their hot set is prefetched instead, which costs nothing that the pool's budget and
policy do not allow. When the active domain's hot set changes as counts come in, it is pushed
and pinned again (not a switch). A domain without a table yet gets the global hot set.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from redis.asyncio import Redis
from redis.exceptions import RedisError

from moe_l2_cache.flywheel import Flywheel
from moe_l2_cache.redis_keys import GLOBAL_DOMAIN, RedisKeys
from moe_l2_cache.residency import ExpertPool
from moe_l2_contracts.schemas.cache import HintStats, HotSetResponse
from moe_l2_contracts.schemas.hint import HintResponse
from moe_l2_contracts.schemas.llama import HotSetRequest

log = logging.getLogger(__name__)


@dataclass
class _Counters:
    hints: int = 0
    switches: int = 0
    held_by_dwell: int = 0
    pushes: int = 0
    push_errors: int = 0
    last_push_error: str | None = None


class HintController:
    def __init__(
        self,
        flywheel: Flywheel,
        llama: httpx.AsyncClient,
        redis: Redis,
        keys: RedisKeys,
        *,
        dwell_s: float,
        pool: ExpertPool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.flywheel = flywheel
        self.llama = llama
        self.redis = redis
        self.keys = keys
        self.dwell_s = dwell_s
        self.pool = pool
        self._clock = clock
        self.active: str | None = None
        self._since: float | None = None  # clock time of the last switch
        self._since_wall: float | None = None
        self.counters = _Counters()
        self._lock = asyncio.Lock()
        self._pin_wanted: tuple[str | None, dict[int, list[int]]] | None = None
        self._pin_event = asyncio.Event()
        flywheel.on_hot_sets_changed(self._tables_changed)

    async def hint(self, domain: str) -> HintResponse:
        self.counters.hints += 1
        async with self._lock:
            if domain == self.active:
                return HintResponse(accepted=True, active_domain=domain, switched=False, reason="already active")
            now = self._clock()
            if self.active is not None and self._since is not None and now - self._since < self.dwell_s:
                self.counters.held_by_dwell += 1
                await self._prefetch(domain)
                left = self.dwell_s - (now - self._since)
                return HintResponse(
                    accepted=True,
                    active_domain=self.active,
                    switched=False,
                    reason=f"{self.active} stays active for {left:.1f}s more (dwell); {domain}'s experts prefetched",
                )
            self.active, self._since, self._since_wall = domain, now, time.time()
            self.counters.switches += 1
            reason = await self._prepare(domain)
            await self._remember(domain)
            return HintResponse(accepted=True, active_domain=domain, switched=True, reason=reason)

    async def restore(self) -> None:
        """After a restart: the active domain Redis remembers becomes active again (no dwell to honour)."""
        try:
            saved = await self.redis.hget(self.keys.active, "domain")
        except RedisError as e:
            log.info("active domain not restored: %s", e)
            return
        # Redis may hold anything: a reserved or unknown name is never made active again
        if saved and self.flywheel.accepts(saved, "active domain"):
            async with self._lock:
                self.active, self._since, self._since_wall = saved, self._clock() - self.dwell_s, time.time()
                await self._prepare(saved)

    async def _tables_changed(self, domains: set[str]) -> None:
        if self.active is not None and self.active in domains:
            async with self._lock:
                await self._prepare(self.active)

    async def _prepare(self, domain: str) -> str:
        """Push the domain's hot set to llama and ask the pool to pin it; says what was done."""
        try:
            hot = await self.flywheel.hot_set(domain)
            source = domain
            if hot is None:
                hot, source = await self.flywheel.hot_set(GLOBAL_DOMAIN), GLOBAL_DOMAIN
        except RedisError as e:
            return f"switched; no hot set pushed, Redis unreachable ({e})"
        if hot is None:
            return "switched; no routing counts yet, nothing to push"
        pushed = await self._push(domain, hot)
        self._request_pin(domain, hot)
        what = "its hot set" if source == domain else "the global hot set (no table for it yet)"
        return f"switched; {what} of {hot.n_experts} experts " + (
            "pushed to llama" if pushed else "not pushed (llama error)"
        )

    async def _push(self, domain: str, hot: HotSetResponse) -> bool:
        body = HotSetRequest(domain=domain, layers=hot.layers)
        try:
            resp = await self.llama.post("/moe/hot-set", json=body.model_dump(), headers=self.flywheel.admin_headers)
            resp.raise_for_status()
        except httpx.HTTPError as e:
            self.counters.push_errors += 1
            self.counters.last_push_error = f"{type(e).__name__}: {e}"
            log.warning("hot set for %s not pushed to llama: %s", domain, e)
            return False
        self.counters.pushes += 1
        return True

    async def _prefetch(self, domain: str) -> None:
        if self.pool is None:
            return
        try:
            hot = await self.flywheel.hot_set(domain)
        except RedisError:
            return
        if hot is not None:
            await asyncio.to_thread(self.pool.prefetch, _layers(hot))

    async def _remember(self, domain: str) -> None:
        try:
            await self.redis.hset(self.keys.active, mapping={"domain": domain, "since": str(self._since_wall)})
        except RedisError as e:
            log.info("active domain not saved: %s", e)

    # -- pinning runs in the background: a hint returns once llama has the hot set --------------------

    def _request_pin(self, domain: str | None, hot: HotSetResponse) -> None:
        if self.pool is None:
            return
        self._pin_wanted = (domain, _layers(hot))  # only the latest request matters
        self._pin_event.set()

    async def run_pinner(self) -> None:
        """Apply pin requests one at a time, in a worker thread, until cancelled."""
        while True:
            await self._pin_event.wait()
            self._pin_event.clear()
            wanted, self._pin_wanted = self._pin_wanted, None
            if wanted is None or self.pool is None:
                continue
            try:
                await asyncio.to_thread(self.pool.pin, *wanted)
            except Exception:  # the pool logs its own degradations; a bug here must not stop later pins
                log.exception("pinning the hot set of %s failed", wanted[0])

    def stats(self) -> HintStats:
        c = self.counters
        return HintStats(
            active_domain=self.active,
            active_since=self._since_wall,
            dwell_s=self.dwell_s,
            hints=c.hints,
            switches=c.switches,
            held_by_dwell=c.held_by_dwell,
            pushes=c.pushes,
            push_errors=c.push_errors,
            last_push_error=c.last_push_error,
        )


def _layers(hot: HotSetResponse) -> dict[int, list[int]]:
    return {int(layer): ids for layer, ids in hot.layers.items()}


class PassThroughHints:
    """Hints when there is nothing to manage (dense or unreadable model): accepted, counted and ignored."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.hints = 0

    async def hint(self, domain: str) -> HintResponse:
        self.hints += 1
        return HintResponse(accepted=True, active_domain=None, switched=False, reason=f"pass-through: {self.reason}")

    def stats(self) -> HintStats:
        return HintStats(
            active_domain=None,
            active_since=None,
            dwell_s=0.0,
            hints=self.hints,
            switches=0,
            held_by_dwell=0,
            pushes=0,
            push_errors=0,
        )
