"""Hot-set scope `traffic`: the hot set of the domains a replica has served recently, not of one domain.

With several llama replicas the gateway sends each domain to the replicas whose caches hold its
experts (issue 16), so one replica serves a few domains at once, interleaved request by request.
Switching the hot set between them (scope `domain`) would hold one domain's experts while the
others' requests run; here the hot set is chosen for the mix instead:

- each hinted domain weighs its exponentially decayed count of hints (half-life
  MOE_L2_CACHE_TRAFFIC_HALF_LIFE_S), as a share of all of them;
- the mix's table is every domain's per-layer shares (its table, or the global one while it has
  none) weighted by those shares (hotset.mix_tables), and its hot set is chosen under the same byte
  budget as a domain's (hotset.select_hot_set);
- it is looked at on the first hint, then on a hint at most once per dwell (MOE_L2_CACHE_DWELL_S),
  and when a mixed domain's hot set changes with new counts; it is pushed to llama and pinned only
  when the chosen experts (or the name below) differ from those llama holds.

The `domain` posted to llama is the domain's own name when the mix is one domain (its hot set is then
exactly the domain's), else the reserved TRAFFIC_DOMAIN: llama only stores and reports that name
(patch 0023; its hit and miss counters go by each request's own tag), and no request may carry a
reserved name, so it cannot be mistaken for a domain. The pool pins a mix with no domain (None): no
single domain's priors fit it.

Nothing of this is kept in Redis: every replica's cache-manager shares the same Redis, and its
traffic is its own. After a restart the mix starts again from the next hints.
"""

from __future__ import annotations

import time
from typing import Any

from redis.exceptions import RedisError

from moe_l2_cache.flywheel import Table
from moe_l2_cache.hints import HintController
from moe_l2_cache.hotset import mix_tables
from moe_l2_cache.redis_keys import GLOBAL_DOMAIN
from moe_l2_contracts.schemas.cache import HintStats, HotSetResponse
from moe_l2_contracts.schemas.hint import HintResponse

# What llama is told the hot set of a mix of domains belongs to (reserved: never a request's tag).
TRAFFIC_DOMAIN = "_traffic"

# A domain whose decayed hints weigh less than this (a hundredth of one hint) is forgotten: its
# share could not move the hot set, and the mix stays as small as the traffic that is still coming.
_FORGET_BELOW = 0.01


class DecayedShares:
    """Each domain's hints, each weighing 2^-(its age / half-life); shares of the sum."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self._weights: dict[str, float] = {}
        self._at: float | None = None  # the clock time the weights are decayed to

    def add(self, domain: str, now: float) -> None:
        self._decay(now)
        self._weights[domain] = self._weights.get(domain, 0.0) + 1.0

    def shares(self, now: float) -> dict[str, float]:
        """Domain -> share of the decayed hints (summing to 1), the largest first; {} before any hint."""
        self._decay(now)
        total = sum(self._weights.values())
        ranked = sorted(self._weights.items(), key=lambda item: (-item[1], item[0]))
        return {domain: weight / total for domain, weight in ranked} if total > 0 else {}

    def _decay(self, now: float) -> None:
        if self._at is not None and now > self._at:
            factor = 0.5 ** ((now - self._at) / self.half_life_s)
            self._weights = {d: w * factor for d, w in self._weights.items() if w * factor >= _FORGET_BELOW}
        if self._at is None or now > self._at:
            self._at = now


class TrafficHintController(HintController):
    """HintController for the `traffic` scope: pushes and pins the hot set of the recent mix of domains."""

    def __init__(self, *args: Any, half_life_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.traffic = DecayedShares(half_life_s)
        self._looked_at: float | None = None  # clock time the mix's hot set was last chosen
        self._held: tuple[str, dict[int, frozenset[int]]] | None = None  # the name and experts llama holds
        self._held_domains: frozenset[str] = frozenset()  # the domains of that push
        self._uses_global = False  # a domain of the mix had no table: the global one stood in

    async def hint(self, domain: str) -> HintResponse:
        self.counters.hints += 1
        async with self._lock:
            now = self._clock()
            self.traffic.add(domain, now)
            if self._looked_at is not None and now - self._looked_at < self.dwell_s:
                return await self._held_back(domain, now)
            switched, reason = await self._look(now)
            return HintResponse(accepted=True, active_domain=self._heaviest(now), switched=switched, reason=reason)

    async def _held_back(self, domain: str, now: float) -> HintResponse:
        """Within the dwell: counted in the mix, which is looked at again once the dwell is over."""
        assert self._looked_at is not None
        left = self.dwell_s - (now - self._looked_at)
        reason = f"counted in the traffic's mix, chosen again in {left:.1f}s (dwell)"
        if domain not in self._held_domains:
            # as a held hint does in the domain scope: its experts are read ahead, within the pool's budget
            self.counters.held_by_dwell += 1
            await self._prefetch(domain)
            reason += f"; {domain}'s experts prefetched"
        return HintResponse(accepted=True, active_domain=self._heaviest(now), switched=False, reason=reason)

    async def _tables_changed(self, domains: set[str]) -> None:
        async with self._lock:
            if self._looked_at is None:
                return  # no hint yet: no mix to choose for
            now = self._clock()
            # the mix as it is now (not as last pushed); nothing pushed yet: the first counts go at once
            if self._held is None or self._uses_global or domains & self.traffic.shares(now).keys():
                await self._look(now)

    async def restore(self) -> None:
        """Nothing to restore: the mix is this replica's own and lives in memory (Redis is shared)."""

    async def _look(self, now: float) -> tuple[bool, str]:
        """Choose the mix's hot set; push and pin it when its experts differ from llama's. Says what was done."""
        self._looked_at = now
        shares = self.traffic.shares(now)
        try:
            hot = await self._mix_hot_set(shares)
        except RedisError as e:
            return False, f"no hot set pushed, Redis unreachable ({e})"
        if hot is None:
            return False, "no routing counts yet, nothing to push"
        name = next(iter(shares)) if len(shares) == 1 else TRAFFIC_DOMAIN
        # the order within a layer is not a change; the name is (llama reports whose set it holds)
        chosen = (name, {int(layer): frozenset(ids) for layer, ids in hot.layers.items()})
        what = f"the hot set of {_describe(shares)}, {hot.n_experts} experts"
        if chosen == self._held:
            return False, f"{what}, is the one llama holds"
        if not await self._push(name, hot):
            return False, f"{what}, not pushed (llama error)"
        self._held, self._held_domains = chosen, frozenset(shares)
        self._since_wall = time.time()
        self.counters.switches += 1
        self._request_pin(None if name == TRAFFIC_DOMAIN else name, hot)
        return True, f"{what}, pushed to llama"

    async def _mix_hot_set(self, shares: dict[str, float]) -> HotSetResponse | None:
        """One domain: its own hot set (the global one while it has no table); several: the mix's."""
        if len(shares) == 1:
            (domain,) = shares
            hot = await self.flywheel.hot_set(domain)
            self._uses_global = hot is None
            return hot or await self.flywheel.hot_set(GLOBAL_DOMAIN)
        tables: dict[str, Table] = {}
        global_table: Table | None = None
        for domain in shares:
            tables[domain] = await self.flywheel.table(domain)
            if not tables[domain]:
                if global_table is None:
                    global_table = await self.flywheel.table(GLOBAL_DOMAIN)
                tables[domain] = global_table
        self._uses_global = global_table is not None
        mixed = mix_tables(tables, shares)
        return self.flywheel.hot_set_of(mixed, TRAFFIC_DOMAIN) if mixed else None

    def _heaviest(self, now: float) -> str | None:
        return next(iter(self.traffic.shares(now)), None)

    def stats(self) -> HintStats:
        now = self._clock()
        shares = self.traffic.shares(now)
        mix = {domain: round(share, 4) for domain, share in shares.items()}
        base = super().stats()
        return base.model_copy(update={"active_domain": next(iter(shares), None), "scope": "traffic", "traffic": mix})


def _describe(shares: dict[str, float]) -> str:
    return ", ".join(f"{domain} {share:.0%}" for domain, share in shares.items())
