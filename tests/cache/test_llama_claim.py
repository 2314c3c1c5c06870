"""MOE_L2_CACHE_CLAIM_LLAMA: one cache-manager per llama replica, through claims in Redis.

The claim logic as a unit (a resolver the test controls, a real Redis): two claimers take different
addresses, a third waits as a standby and takes over a released one, the renewer keeps a claim alive
past its TTL and notices one another cache-manager took, a name that never resolves fails with a
clear message, Redis down at start is waited for. Then real processes on the real llama-server:
`localhost` resolves to 127.0.0.1 only here, so the second cache-manager waits (it does not claim
the first one's replica) and takes it over when the first stops; a claim taken away ends the process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from moe_l2_cache.claim import (
    EXIT_CLAIM_LOST,
    UNINDEXED_MODEL,
    ClaimError,
    LlamaClaim,
    claim_llama,
    resolve_addresses,
)
from moe_l2_cache.keyspace import audit
from moe_l2_cache.redis_keys import RedisKeys
from moe_l2_cache.skips import SkipCounter
from tests.waiting import await_until, holds_throughout

from ..conftest import LlamaServer
from .conftest import CacheManager, RedisServer

KEYS = RedisKeys("0123456789abcdef")
URL = "http://llama:11436"
TTL = 1.5  # renewals every 0.5 s


def fixed(*addresses: str) -> Callable[[str, int], object]:
    async def resolve(host: str, port: int) -> list[str]:
        assert (host, port) == ("llama", 11436)
        return sorted(addresses)

    return resolve


def counting(resolve: Callable[[str, int], object], tries: list[str]) -> Callable[[str, int], object]:
    """resolve, each call (one per try of claim_llama's loop) recorded in `tries`."""

    def counted(host: str, port: int) -> object:
        tries.append(host)
        return resolve(host, port)

    return counted


def owned_by(redis: Redis, key: str, owner: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await redis.get(key) == owner

    return check


def client(server: RedisServer) -> Redis:
    return Redis.from_url(server.url, decode_responses=True, socket_timeout=2, socket_connect_timeout=2)


async def claim(redis: Redis, owner: str, resolve: Callable[[str, int], object], **kw: object) -> LlamaClaim:
    return await claim_llama(redis, KEYS, URL, owner=owner, ttl_s=TTL, resolve=resolve, **kw)  # type: ignore[arg-type]


def test_two_claimers_get_different_replicas_and_a_third_waits_for_a_free_one(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    async def run() -> None:
        redis = client(redis_server)
        resolve = fixed("10.0.0.3", "10.0.0.2")
        a = await claim(redis, "a", resolve)
        b = await claim(redis, "b", resolve)
        assert (a.url, b.url) == ("http://10.0.0.2:11436", "http://10.0.0.3:11436")
        assert await redis.get(KEYS.llama_claim("10.0.0.2:11436")) == "a"
        assert await redis.get(KEYS.llama_claim("10.0.0.3:11436")) == "b"
        assert 0 < await redis.pttl(a.key) <= TTL * 1000

        caplog.set_level(logging.INFO, logger="moe_l2_cache.claim")
        tries: list[str] = []
        third = asyncio.create_task(claim(redis, "c", counting(resolve, tries), retry_s=0.05))
        await await_until(lambda: len(tries) >= 10, 10, "ten tries of the third claimer")
        assert not third.done(), "a third cache-manager claimed a replica that two others hold"
        full = [r for r in caplog.records if "every llama replica at llama has a cache-manager (2)" in r.message]
        assert len(full) == 1, "the 'every replica is held' message is logged once"

        assert await b.release()
        c = await asyncio.wait_for(third, 2)
        assert c.url == b.url and await redis.get(c.key) == "c"
        assert not await b.release(), "a released claim now someone else's is not deleted by its old owner"
        assert await redis.get(c.key) == "c"
        await redis.aclose()

    asyncio.run(run())


def test_expired_claim_of_a_dead_cache_manager_is_taken_over(redis_server: RedisServer) -> None:
    async def run() -> None:
        redis = client(redis_server)
        resolve = fixed("10.0.0.2")
        dead = await claim(redis, "dead", resolve)  # never renewed: it died
        standby = await asyncio.wait_for(claim(redis, "standby", resolve, retry_s=0.1), TTL + 2)
        assert standby.key == dead.key and await redis.get(standby.key) == "standby"
        await redis.aclose()

    asyncio.run(run())


def test_renewer_keeps_the_claim_and_detects_one_taken_away(redis_server: RedisServer) -> None:
    async def run() -> None:
        redis = client(redis_server)
        held = await claim(redis, "a", fixed("10.0.0.2"))
        lost: list[str] = []
        renewer = asyncio.create_task(held.run_renewer(lost.append))
        # two TTLs, watched all along: the claim never expires
        await holds_throughout(owned_by(redis, held.key, "a"), TTL * 2, "the claim kept by its renewer")
        assert not lost

        # expired while Redis was out of reach, nobody took it: taken back at the next renewal, still serving
        await redis.delete(held.key)
        await await_until(owned_by(redis, held.key, "a"), TTL, "the renewer to take the expired claim back")
        assert not lost

        await redis.set(held.key, "b", px=int(TTL * 1000))  # another cache-manager has it now
        await asyncio.wait_for(renewer, TTL)
        assert len(lost) == 1 and "no longer ours" in lost[0]
        assert await redis.get(held.key) == "b", "the loser must not touch the new owner's claim"
        assert not await held.release()
        await redis.aclose()

    asyncio.run(run())


def test_a_name_that_never_resolves_fails_with_a_clear_message(redis_server: RedisServer) -> None:
    async def nowhere(host: str, port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    async def run() -> None:
        redis = client(redis_server)
        started = time.monotonic()
        with pytest.raises(ClaimError, match=r"'llama' \(MOE_L2_LLAMA_URL\) did not resolve within 1 s"):
            await asyncio.wait_for(claim(redis, "a", nowhere, resolve_timeout_s=1.0), 5)
        assert 1.0 <= time.monotonic() - started < 3
        assert await redis.keys("*") == []

        # a name that resolves late (llama's container not up yet) is claimed once it does
        answers = iter([[], [], ["10.0.0.2"]])

        async def late(host: str, port: int) -> list[str]:
            return next(answers)

        late_claim = await claim(redis, "a", late, resolve_timeout_s=10.0, retry_s=0.05)
        assert late_claim.url == "http://10.0.0.2:11436"
        await redis.aclose()

    asyncio.run(run())


def test_redis_down_at_start_is_waited_for(redis_server: RedisServer) -> None:
    async def run() -> None:
        redis_server.kill9()
        redis = client(redis_server)
        tries: list[str] = []
        pending = asyncio.create_task(claim(redis, "a", counting(fixed("10.0.0.2"), tries), retry_s=0.1))
        await await_until(lambda: len(tries) >= 5, 10, "five tries of the claimer while Redis is down")
        assert not pending.done(), "no claim can be made without Redis: the service must wait"
        await asyncio.to_thread(redis_server.start)
        held = await asyncio.wait_for(pending, 10)
        assert await redis.get(held.key) == "a"
        await redis.aclose()

    asyncio.run(run())


def test_resolver_sorts_every_address_and_ipv6_keys_are_bracketed(redis_server: RedisServer) -> None:
    async def run() -> None:
        assert await resolve_addresses("127.0.0.1", 80) == ["127.0.0.1"]
        redis = client(redis_server)
        v6 = await claim(redis, "a", fixed("::1"))
        assert v6.url == "http://[::1]:11436" and v6.key == KEYS.llama_claim("[::1]:11436")
        skips = SkipCounter()  # the keyspace audit knows the claim keys
        assert await audit(redis, KEYS, accepted=frozenset(), layer_ok=lambda _: True, skips=skips) == 0
        assert skips.counts == {}
        await redis.aclose()

    asyncio.run(run())


# -- real processes --------------------------------------------------------------------------------


def _start_waiting(manager: CacheManager) -> subprocess.Popen[bytes]:
    """Start without waiting for health: a standby is not healthy until it holds a claim."""
    env = {**os.environ, **manager.env, "MOE_L2_CACHE_PORT": str(manager.port), "MOE_L2_CACHE_HOST": "127.0.0.1"}
    manager.proc = subprocess.Popen(
        [sys.executable, "-m", "moe_l2_cache"],
        env=env,
        stdout=manager.log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return manager.proc


def _until(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.llama
@pytest.mark.slow
def test_two_processes_one_replica_the_second_waits_then_takes_over(
    start_cache_manager: Callable[..., CacheManager],
    cache_llama: LlamaServer,
    demo_model: Path,
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    port = httpx.URL(cache_llama.url).port
    env = {
        "MOE_L2_MODEL_PATH": str(demo_model),
        "MOE_L2_LLAMA_URL": f"http://localhost:{port}",
        "MOE_L2_REDIS_URL": redis_server.url,
        "MOE_L2_CACHE_CLAIM_LLAMA": "1",
        "MOE_L2_CACHE_CLAIM_TTL_S": "3",
        "MOE_L2_CACHE_PULL_INTERVAL_S": "0",
        "MOE_L2_CACHE_POOL_BYTES": str(64 << 20),
    }
    replica = f"http://127.0.0.1:{port}"
    first = start_cache_manager(**env)
    assert first.stats()["llama_url"] == replica
    model_id = first.stats()["model_id"]
    key = RedisKeys(model_id).llama_claim(f"127.0.0.1:{port}")
    with redis_server.client() as r:
        first_owner = r.get(key)
        assert first_owner and r.pttl(key) > 0

    second = CacheManager({k: str(v) for k, v in env.items()}, tmp_path / "cache-manager-second.log")
    try:
        proc = _start_waiting(second)
        # its start (imports, Redis) takes seconds on a loaded machine: wait for what it says, then watch it
        waiting = "every llama replica at localhost has a cache-manager (1)"
        assert _until(lambda: waiting in second.log.read_text(), 60), "the standby never said it waits"
        assert not _until(second._healthy, 2), "a second cache-manager serves a replica the first one holds"
        assert proc.poll() is None, "a standby waits, it does not exit"
        with redis_server.client() as r:
            assert r.get(key) == first_owner

        # clean stop (uvicorn re-raises SIGTERM once shut down): the claim is released, the standby takes it
        assert first.stop() in (0, -signal.SIGTERM)
        with redis_server.client() as r:
            assert _until(lambda: r.get(key) not in (None, first_owner), 15), "the standby did not take over"
        assert _until(second._healthy, 30)
        assert second.stats()["llama_url"] == replica

        # a claim another cache-manager took: the process exits, so that its restart claims afresh
        with redis_server.client() as r:
            r.set(key, "intruder", px=60_000)
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail("the cache-manager whose claim was taken kept running")
        assert code == EXIT_CLAIM_LOST
        assert "is no longer ours" in second.log.read_text()
        with redis_server.client() as r:
            assert r.get(key) == "intruder"
    finally:
        if second.proc is not None and second.proc.poll() is None:
            second.proc.send_signal(signal.SIGKILL)
            second.proc.wait()
        second.client.close()


@pytest.mark.llama
def test_stats_name_the_llama_served_without_a_claim(
    start_cache_manager: Callable[..., CacheManager], cache_llama: LlamaServer, redis_server: RedisServer
) -> None:
    manager = start_cache_manager(
        MOE_L2_LLAMA_URL=cache_llama.url, MOE_L2_REDIS_URL=redis_server.url, MOE_L2_CACHE_PULL_INTERVAL_S="0"
    )
    stats = manager.stats()
    assert stats["mode"] == "pass-through"  # no model given
    assert stats["llama_url"] == cache_llama.url
    with redis_server.client() as r:
        assert r.keys("*") == []  # no claim unless asked


def test_a_pass_through_process_claims_too_and_an_unresolvable_host_stops_it(
    start_cache_manager: Callable[..., CacheManager], redis_server: RedisServer, tmp_path: Path
) -> None:
    env = {"MOE_L2_REDIS_URL": redis_server.url, "MOE_L2_CACHE_CLAIM_LLAMA": "1", "MOE_L2_CACHE_PULL_INTERVAL_S": "0"}
    manager = start_cache_manager(**env, MOE_L2_LLAMA_URL="http://127.0.0.1:9")  # no model: pass-through
    assert manager.stats()["mode"] == "pass-through"
    assert manager.stats()["llama_url"] == "http://127.0.0.1:9"
    with redis_server.client() as r:
        assert r.keys("*") == [RedisKeys(UNINDEXED_MODEL).llama_claim("127.0.0.1:9")]

    lost = CacheManager(
        {**env, "MOE_L2_LLAMA_URL": "http://no-such-host.invalid:11436", "MOE_L2_CACHE_CLAIM_RESOLVE_TIMEOUT_S": "1"},
        tmp_path / "cache-manager-unresolvable.log",
    )
    try:
        assert _start_waiting(lost).wait(timeout=30) == 3  # uvicorn's startup failure
        assert "'no-such-host.invalid' (MOE_L2_LLAMA_URL) did not resolve within 1 s" in lost.log.read_text()
    finally:
        lost.close()
