"""A check of every Redis key under the model's prefix, at start and after a write met a wrong type.

Keys the service reads and writes must hold the type it expects: a string where the domain set
should be makes every flush fail. Such a key is renamed to `moe:{model}:quarantine:...` (kept for
whoever wants to look, never read again), so the service can write a fresh one. Keys it would
never read (reserved or unknown domains, layers the model does not have, names it does not know)
are counted and left where they are: nothing is deleted.
"""

from __future__ import annotations

from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from moe_l2_cache.redis_keys import GLOBAL_DOMAIN, RedisKeys
from moe_l2_cache.skips import SkipCounter

_FIXED = {"domains": "set", "tokens": "hash", "active": "hash", "meta": "hash"}
_SCAN_BATCH = 1000


def is_wrong_type(exc: BaseException) -> bool:
    # WRONGTYPE, also when it comes back from a Lua script or annotated by the pipeline
    return isinstance(exc, ResponseError) and "WRONGTYPE" in str(exc)


def domain_problem(domain: str, accepted: frozenset[str]) -> str | None:
    """Why `domain` cannot be a table, or None when it can."""
    if domain in accepted:
        return None
    if domain.startswith("_"):
        return "a reserved name"
    return "not a known domain"


async def audit(
    redis: Redis,
    keys: RedisKeys,
    *,
    accepted: frozenset[str],
    layer_ok: Callable[[int], bool],
    skips: SkipCounter,
) -> int:
    """Classify every key of the model; returns how many keys were moved aside."""
    found: list[str] = [key async for key in redis.scan_iter(match=f"{keys.base}:*", count=_SCAN_BATCH)]
    moved = 0
    for start in range(0, len(found), _SCAN_BATCH):
        chunk = found[start : start + _SCAN_BATCH]
        async with redis.pipeline(transaction=False) as pipe:
            for key in chunk:
                pipe.type(key)
            types = await pipe.execute()
        for key, kind in zip(chunk, types, strict=True):
            expected = _expected_type(key, keys, accepted, layer_ok, skips)
            if expected is None or kind in (expected, "none"):  # "none": gone since the scan
                continue
            skips.skip("wrong_type", key, f"holds a {kind}, not a {expected}; moved to {keys.quarantine(key)}")
            try:
                await redis.rename(key, keys.quarantine(key))
                moved += 1
            except ResponseError:  # deleted meanwhile: nothing to move
                pass
    return moved


def _expected_type(
    key: str, keys: RedisKeys, accepted: frozenset[str], layer_ok: Callable[[int], bool], skips: SkipCounter
) -> str | None:
    """The type the service needs at `key`; None for a key it never reads (counted where unusable)."""
    section, rest = keys.section(key)
    if section == "quarantine":
        return None
    if section in _FIXED and not rest:
        return _FIXED[section]
    if section in ("flushed", "llama-claim") and rest:
        return "string"
    if section in ("routing", "transitions"):
        # a routing hash is one layer's, a transitions hash the pair (layer, layer + 1)'s
        pair = section == "transitions"
        parsed = keys.parse_transitions(key) if pair else keys.parse_routing(key)
        if parsed is None:
            skips.skip(f"{section}_key", key, "no layer in the key")
            return None
        domain, layer = parsed
        if (why := domain_problem(domain, accepted)) is not None:
            skips.skip("domain", key, why)
            return None
        if not (layer_ok(layer) and (not pair or layer_ok(layer + 1))):
            where = "that layer or the next" if pair else "that layer"
            skips.skip(f"{section}_key", key, f"the model has no routed experts in {where}")
            return None
        return "hash"
    if section == "hotset" and rest:
        if rest != GLOBAL_DOMAIN and (why := domain_problem(rest, accepted)) is not None:
            skips.skip("domain", key, why)
            return None
        return "string"
    skips.skip("unknown_key", key, "not a key the cache-manager writes")
    return None
