"""Everything the cache-manager owns, in one object: app.py builds it and serves it, metrics.py reads it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx
from redis.asyncio import Redis

from moe_l2_cache.claim import LlamaClaim
from moe_l2_cache.engine_cache import EngineCacheFeeder
from moe_l2_cache.flywheel import Flywheel
from moe_l2_cache.hints import HintController, PassThroughHints
from moe_l2_cache.hit_curve import HitCurveWriter
from moe_l2_cache.ram_tier import RamTier
from moe_l2_cache.redis_keys import RedisKeys
from moe_l2_cache.residency import ExpertPool
from moe_l2_cache.settings import CacheSettings
from moe_l2_gguf.index import ExpertIndex


@dataclass
class Service:
    settings: CacheSettings
    llama: httpx.AsyncClient
    hints: HintController | PassThroughHints
    domains: frozenset[str]  # accepted in hints, and as tables
    admin_token: str = ""  # "": every admin call is refused
    admin_problem: str = ""  # why there is no token
    index: ExpertIndex | None = None
    reason: str = ""  # why pass-through
    redis: Redis | None = None
    keys: RedisKeys | None = None
    pool: ExpertPool | None = None
    pool_problem: str | None = None
    ram_tier: RamTier | None = None  # MOE_L2_RAM_BUDGET
    flywheel: Flywheel | None = None
    engine_cache: EngineCacheFeeder | None = None
    hit_curve: HitCurveWriter | None = None  # MOE_L2_CACHE_HIT_CURVE_PATH: auto's curve, on llama's hit rate
    claim: LlamaClaim | None = None  # MOE_L2_CACHE_CLAIM_LLAMA: the replica claimed (settings.llama_url is it)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
