"""One cache-manager per llama replica (MOE_L2_CACHE_CLAIM_LLAMA): a claim in Redis on one address.

With `docker compose up --scale llama=N --scale cache-manager=N`, every cache-manager has the same
MOE_L2_LLAMA_URL (http://llama:11436), whose host name resolves to N addresses. Each cache-manager
resolves it, sorts the addresses, and takes the first one no other cache-manager holds:

    SET moe:{model}:llama-claim:{address}:{port} <owner> NX PX <ttl>

then serves that address only (its llama client, its hot-set pushes, its pulls). The claim is
renewed every ttl/3 by a compare-and-pexpire script; a claim found in another owner's hands means
two cache-managers serve one replica, and the process exits (Docker's restart policy starts it
again, and it claims afresh). On a clean stop the claim is deleted if it is still ours, so a
waiting cache-manager takes the replica over within one retry.

Failure cases (docs/cache-manager.md, "One cache-manager per llama replica"):
- every address claimed: wait, re-resolving and retrying every ttl/3, forever (a standby that takes
  over the replica of a cache-manager that stops or dies); logged once;
- the name does not resolve: retried for `resolve_timeout_s`, then ClaimError (the service does not
  start; Docker restarts it);
- Redis unreachable at start: wait until it answers, forever, a warning every 30 s;
- Redis unreachable while renewing: keep serving; the key cannot be taken while nobody can reach
  Redis, and a key that expired meanwhile is taken back when Redis answers, unless another owner took
  it first (then: exit).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
from redis.asyncio import Redis
from redis.exceptions import RedisError

from moe_l2_cache.redis_keys import RedisKeys

log = logging.getLogger("moe_l2_cache.claim")

# The keyspace of a cache-manager in pass-through mode (no model id): it claims a replica all the same,
# so that the gateway pairs every replica with one cache-manager.
UNINDEXED_MODEL = "_unindexed"
# Exit status of a cache-manager whose claim another one took (os._exit: nothing runs after it).
EXIT_CLAIM_LOST = 4

Resolver = Callable[[str, int], Awaitable[list[str]]]

# GET == owner: extend (1). Gone (expired while Redis was out of reach): take it back (2).
# Anyone else's: lost (0).
_RENEW = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not v then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 2
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
_REDIS_WARN_EVERY_S = 30.0


class ClaimError(RuntimeError):
    """The claim cannot be made (the name never resolved): the service does not start."""


def new_owner() -> str:
    """hostname:pid:random. The random part: a restarted container has the same hostname and pid (1)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address of `host` (IPv4 and IPv6), sorted: each cache-manager sees the same order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def _hostport(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ipaddress.ip_address(address).version == 6 else f"{address}:{port}"


def _target(llama_url: str) -> tuple[httpx.URL, str, int]:
    url = httpx.URL(llama_url)
    if not url.host:
        raise ClaimError(f"MOE_L2_LLAMA_URL={llama_url!r} has no host to resolve")
    return url, url.host, url.port or (443 if url.scheme == "https" else 80)


@dataclass
class LlamaClaim:
    """A held claim: `url` is the llama replica this cache-manager serves."""

    redis: Redis
    key: str
    owner: str
    url: str
    ttl_s: float

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    async def renew(self) -> bool:
        """True while the claim is ours (extended, or taken back after it expired); RedisError passes."""
        state = await self.redis.eval(_RENEW, 1, self.key, self.owner, self._ttl_ms)
        if int(state) == 2:
            log.warning("llama claim %s had expired (Redis out of reach?); taken back", self.key)
        return int(state) != 0

    async def release(self) -> bool:
        """Delete the claim if it is still ours; True when deleted."""
        return bool(await self.redis.eval(_RELEASE, 1, self.key, self.owner))

    async def run_renewer(self, on_lost: Callable[[str], None]) -> None:
        """Renew every ttl/3 until cancelled; `on_lost(why)` once the claim is another's."""
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                ours = await self.renew()
            except RedisError as e:
                log.warning(
                    "llama claim %s not renewed for %.0f s: Redis unreachable (%s)",
                    self.key,
                    time.monotonic() - last_ok,
                    e,
                )
                continue
            if not ours:
                on_lost(f"llama claim {self.key} is no longer ours (another cache-manager holds it)")
                return
            last_ok = time.monotonic()


def exit_on_lost_claim(why: str) -> None:
    """The default `on_lost`: two cache-managers on one replica must not go on; the restart re-claims."""
    log.error("%s: exiting (status %d) so that the restart claims a free replica", why, EXIT_CLAIM_LOST)
    logging.shutdown()
    os._exit(EXIT_CLAIM_LOST)


async def claim_llama(
    redis: Redis,
    keys: RedisKeys,
    llama_url: str,
    *,
    owner: str,
    ttl_s: float,
    resolve: Resolver = resolve_addresses,
    resolve_timeout_s: float = 60.0,
    retry_s: float | None = None,
) -> LlamaClaim:
    """Claim the first address of llama_url's host that no other cache-manager holds; waits while
    every one is held or Redis is unreachable, raises ClaimError when the name does not resolve
    within resolve_timeout_s."""
    url, host, port = _target(llama_url)
    retry = ttl_s / 3 if retry_s is None else retry_s
    ttl_ms = max(1, int(ttl_s * 1000))
    resolve_deadline = time.monotonic() + resolve_timeout_s
    all_held_logged = False
    redis_warned_at: float | None = None
    while True:
        try:
            addresses = await resolve(host, port)
        except (OSError, UnicodeError) as e:  # socket.gaierror is an OSError
            addresses, resolve_problem = [], str(e)
        else:
            resolve_problem = "no address"
        if not addresses:
            if time.monotonic() >= resolve_deadline:
                raise ClaimError(
                    f"the llama host {host!r} (MOE_L2_LLAMA_URL) did not resolve within {resolve_timeout_s:.0f} s "
                    f"({resolve_problem}); is the llama service up and on this network?"
                )
            log.info("llama host %r does not resolve yet (%s); retrying", host, resolve_problem)
            await asyncio.sleep(min(retry, 1.0))
            continue
        try:
            for address in addresses:
                hostport = _hostport(address, port)
                key = keys.llama_claim(hostport)
                if await redis.set(key, owner, nx=True, px=ttl_ms):
                    claimed = str(url.copy_with(host=address))
                    log.info("claimed llama replica %s (%s; %d addresses at %s)", hostport, key, len(addresses), host)
                    return LlamaClaim(redis, key, owner, claimed.rstrip("/"), ttl_s)
        except RedisError as e:
            now = time.monotonic()
            if redis_warned_at is None or now - redis_warned_at >= _REDIS_WARN_EVERY_S:
                log.warning("cannot claim a llama replica: Redis unreachable (%s); waiting for it", e)
                redis_warned_at = now
            await asyncio.sleep(retry)
            continue
        if not all_held_logged:
            log.warning(
                "every llama replica at %s has a cache-manager (%d); scale cache-manager to the llama count "
                "(waiting as a standby: this one takes over a replica whose cache-manager stops)",
                host,
                len(addresses),
            )
            all_held_logged = True
        await asyncio.sleep(retry)
