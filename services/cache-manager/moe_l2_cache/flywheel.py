"""The routing flywheel: llama's per-domain expert counts into Redis, and each domain's hot set out of them.

llama-server counts activations per domain tag, layer and expert; `GET /moe/routing?reset=1` hands
them over and clears them, so every pull is a delta. Deltas go through the bounded buffer into
Redis in one transaction (with a marker, see buffer.py), where a Lua script first decays the
domain's existing counts by MOE_L2_CACHE_DECAY per MOE_L2_CACHE_DECAY_TOKENS new tokens of that domain, then
adds the delta: the tables follow the traffic, and a domain without traffic keeps its table.
After each write the hot sets of the domains written are chosen again and stored in Redis. With
LLAMA_ARG_MOE_TRANSITIONS llama also counts which expert follows which at the next layer; those counts
go the same way, into their own hashes, not decayed (transitions.py says why).

Only accepted domains (the known domains and llama's "untagged") become tables, and nothing read
from Redis is trusted: what does not fit the model or the accepted domains is skipped and counted
(skips.py). The global table sums the accepted domains' tables, never itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import numpy as np
from numpy.typing import NDArray
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from moe_l2_cache.buffer import Batch, Cell, CountBuffer, PairCell
from moe_l2_cache.hotset import select_hot_set, sum_tables
from moe_l2_cache.keyspace import audit, domain_problem, is_wrong_type
from moe_l2_cache.redis_keys import GLOBAL_DOMAIN, RedisKeys
from moe_l2_cache.residency import ExpertPool
from moe_l2_cache.skips import SkipCounter
from moe_l2_cache.transitions import field_name, pair_cells, pair_layers, parse_field
from moe_l2_contracts.schemas.cache import FlywheelStats, HotSetResponse, PullResponse
from moe_l2_contracts.schemas.llama import RoutingSnapshot
from moe_l2_gguf.index import ExpertIndex

log = logging.getLogger(__name__)

Table = dict[int, dict[int, float]]  # layer -> expert -> (decayed) activations

# KEYS[1]: a routing hash; ARGV[1]: decay factor; ARGV[2..]: expert, delta pairs.
# A value that is not a finite, non-negative count (Redis holds whatever it was given) would make
# HINCRBYFLOAT fail, and with it every flush: it is replaced by the delta, or dropped by the decay.
_DECAY_AND_ADD = """
local function count(s)
  local v = s and tonumber(s)
  if v and v == v and v >= 0 and v < math.huge then return v end
  return nil
end
local factor = tonumber(ARGV[1])
if factor < 1 then
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    local v = count(all[i + 1])
    if v == nil or v * factor < 0.001 then
      redis.call('HDEL', KEYS[1], all[i])
    else
      redis.call('HSET', KEYS[1], all[i], string.format('%.17g', v * factor))
    end
  end
end
for i = 2, #ARGV, 2 do
  local old = redis.call('HGET', KEYS[1], ARGV[i])
  if old and count(old) == nil then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  else
    redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
return 1
"""

# KEYS[1]: the tokens hash; ARGV[1]: domain; ARGV[2]: new tokens. A value that is not a count is replaced.
_ADD_TOKENS = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old and (#old > 18 or not string.match(old, '^%d+$')) then
  return redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
return redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
"""

_FLUSH_MARKER_TTL_S = 86_400

HotSetListener = Callable[[set[str]], Awaitable[None]]


class RoutingError(Exception):
    """llama's routing counts could not be pulled or do not fit the indexed model."""


@dataclass
class _Counters:
    pulls: int = 0
    pull_errors: int = 0
    last_pull_at: float | None = None
    last_error: str | None = None
    activations: int = 0
    tokens: int = 0
    transitions: int = 0
    flushes: int = 0
    redis_errors: int = 0
    redis_ok: bool = True


class Flywheel:
    def __init__(
        self,
        index: ExpertIndex,
        keys: RedisKeys,
        redis: Redis,
        llama: httpx.AsyncClient,
        buffer: CountBuffer,
        *,
        hotset_bytes: int,
        decay: float = 1.0,
        decay_tokens: int = 100_000,
        accepted: frozenset[str],
        pool: ExpertPool | None = None,
        admin_headers: dict[str, str] | None = None,
    ) -> None:
        self.index = index
        self.accepted = accepted  # the domains that may become tables
        self.admin_headers = admin_headers or {}  # llama's admin calls: reset=1, hot-set
        self._failing = ""  # the reason pulls are failing, "" while they work (logged once per reason)
        self.keys = keys
        self.redis = redis
        self.llama = llama
        self.buffer = buffer
        self.hotset_bytes = hotset_bytes
        self.decay = decay
        self.decay_tokens = decay_tokens
        self.pool = pool
        self.counters = _Counters()
        self.skips = SkipCounter()
        self._audit_due = True  # the keyspace is checked before the first read, and after a WRONGTYPE
        self.domains: set[str] = set()
        self._hot_sets: dict[str, HotSetResponse] = {}
        self._tables: dict[str, Table] = {}  # the last read of each domain's table: the pool policy's priors
        self._listeners: list[HotSetListener] = []
        self._flush_lock = asyncio.Lock()
        self._pull_lock = asyncio.Lock()
        self._script = redis.register_script(_DECAY_AND_ADD)
        self._add_tokens = redis.register_script(_ADD_TOKENS)

    def on_hot_sets_changed(self, listener: HotSetListener) -> None:
        self._listeners.append(listener)

    # -- pulling -------------------------------------------------------------------------------------

    async def pull(self) -> PullResponse:
        """One pull from llama (reset=1), buffered, then flushed; never raises for llama or Redis trouble."""
        async with self._pull_lock:
            try:
                snapshot = await self._fetch()
            except RoutingError as e:
                self.counters.pull_errors += 1
                # pulls repeat every few seconds: one line per new reason, not one per pull
                if str(e) != self._failing:
                    log.warning("routing pull failed, counts are not collected: %s", e)
                self._failing = str(e)
                self.counters.last_error = str(e)
                flushed = await self.flush()  # counts buffered earlier still go out
                return PullResponse(ok=False, error=str(e), flushed=flushed, buffered_cells=self.buffer.cells)
            if self._failing:
                log.info("routing pulls work again")
                self._failing = ""
            counts, tokens = self._cells(snapshot)
            pairs = self._pair_cells(snapshot)
            self.counters.pulls += 1
            self.counters.last_pull_at = time.time()
            self.counters.activations += sum(counts.values())
            self.counters.tokens += sum(tokens.values())
            self.counters.transitions += sum(pairs.values())
            if not self.buffer.add(counts, tokens, pairs):
                log.warning(
                    "count buffer full (%d cells): dropped %d activations", self.buffer.cells, sum(counts.values())
                )
            if self.pool is not None and counts:
                await asyncio.to_thread(self.pool.observe, _per_layer(counts))
            flushed = await self.flush()
            return PullResponse(
                ok=True,
                tokens=snapshot.tokens,
                activations=sum(counts.values()),
                domains=sorted({d for d, _, _ in counts} | set(tokens)),
                flushed=flushed,
                buffered_cells=self.buffer.cells,
            )

    async def _fetch(self) -> RoutingSnapshot:
        try:
            resp = await self.llama.get("/moe/routing", params={"reset": "1"}, headers=self.admin_headers)
        except httpx.HTTPError as e:
            raise RoutingError(f"llama unreachable: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            raise RoutingError(f"llama answered {resp.status_code} to GET /moe/routing: {resp.text[:200]}")
        try:
            snapshot = RoutingSnapshot.model_validate(resp.json())
        except ValueError as e:
            raise RoutingError(f"llama's /moe/routing answer does not fit the contract: {e}") from e
        if (snapshot.n_layer, snapshot.n_expert) != (self.index.n_layer, self.index.n_expert):
            raise RoutingError(
                f"llama serves a model with {snapshot.n_layer} layers x {snapshot.n_expert} experts, the indexed "
                f"{self.index.path} has {self.index.n_layer} x {self.index.n_expert}: is MOE_L2_MODEL_PATH right?"
            )
        return snapshot

    async def run(self, interval_s: float) -> None:
        """Pull every `interval_s` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.pull()
            except Exception:  # a bug must not stop the flywheel; it is logged and the next pull tries again
                log.exception("routing pull failed")

    # -- writing -------------------------------------------------------------------------------------

    async def flush(self) -> bool:
        """Write the buffered counts; False (and they stay buffered) when Redis is unreachable."""
        async with self._flush_lock:
            try:
                await self.audit_if_due()
                await self._resolve_uncertain()
            except RedisError as e:
                self._redis_failed(e)
                return False
            batch = self.buffer.take()
            if batch is None:
                return True
            try:
                await self._write(batch)
            except RedisError as e:
                # maybe applied (a WRONGTYPE fails one command of the transaction, not the others):
                # the marker decides at the next flush, after the keyspace check moved the key aside
                self.buffer.failed(batch)
                if is_wrong_type(e):
                    self._audit_due = True
                    self.counters.last_error = f"redis: {e}"
                else:
                    self._redis_failed(e)
                return False
            self.counters.flushes += 1
            self.counters.redis_ok = True
            self.domains |= batch.domains()
        await self._refresh_hot_sets(batch.domains())
        return True

    async def _resolve_uncertain(self) -> None:
        if self.buffer.uncertain is None:
            return
        applied = bool(await self.redis.exists(self.keys.flushed(self.buffer.uncertain.id)))
        self.buffer.resolve(applied)

    async def _write(self, batch: Batch) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            for domain in sorted(batch.domains()):
                factor = self._decay_factor(batch.tokens.get(domain, 0))
                deltas = dict(batch.by_layer(domain))
                for layer in sorted(set(self.index.layers) | set(deltas)):
                    cells = deltas.get(layer, {})
                    if not cells and factor >= 1.0:
                        continue
                    args: list[str | float | int] = [repr(factor)]
                    for expert, n in sorted(cells.items()):
                        args += [expert, n]
                    await self._script(keys=[self.keys.routing(domain, layer)], args=args, client=pipe)
                for layer, pairs in batch.pairs_by_layer(domain):
                    args = ["1.0"]  # no decay: see transitions.py
                    for (a, b), n in sorted(pairs.items()):
                        args += [field_name(a, b), n]
                    await self._script(keys=[self.keys.transitions(domain, layer)], args=args, client=pipe)
                if batch.tokens.get(domain):
                    await self._add_tokens(keys=[self.keys.tokens], args=[domain, batch.tokens[domain]], client=pipe)
                pipe.sadd(self.keys.domains, domain)
            pipe.set(self.keys.flushed(batch.id), 1, ex=_FLUSH_MARKER_TTL_S)
            await pipe.execute()

    def _decay_factor(self, new_tokens: int) -> float:
        if self.decay >= 1.0 or new_tokens <= 0:
            return 1.0
        return float(self.decay ** (new_tokens / self.decay_tokens))

    def _redis_failed(self, exc: Exception) -> None:
        self.counters.redis_errors += 1
        if self.counters.redis_ok:
            log.warning("Redis unreachable (%s): buffering routing counts in memory", exc)
        self.counters.redis_ok = False
        self.counters.last_error = f"redis: {exc}"

    # -- tables and hot sets ---------------------------------------------------------------------------

    async def audit_if_due(self) -> None:
        """Check the model's keyspace (keyspace.py) when it has not been checked since start or a WRONGTYPE."""
        if not self._audit_due:
            return
        moved = await audit(
            self.redis, self.keys, accepted=self.accepted, layer_ok=self.index.layers.__contains__, skips=self.skips
        )
        self._audit_due = False
        if moved:
            self._hot_sets.clear()  # a stored hot set may have been one of them

    def accepts(self, domain: str, where: str) -> bool:
        """Whether `domain` (read from `where`) may be a table; counts it as skipped when not."""
        if (why := domain_problem(domain, self.accepted)) is None:
            return True
        self.skips.skip("domain", f"{where}: {domain}", why)
        return False

    def _wrong_type(self, key: str) -> None:
        self.skips.skip("wrong_type", key, "a key of the wrong type; moved aside at the next flush")
        self._audit_due = True

    async def table(self, domain: str) -> Table:
        """A domain's counts from Redis; for GLOBAL_DOMAIN every accepted domain's together (never
        itself: it is reserved, so never accepted). Empty for a domain that is not accepted."""
        if domain == GLOBAL_DOMAIN:
            domains = await self.known_domains()
            return sum_tables([await self.table(d) for d in sorted(domains)])
        if domain not in self.accepted:
            return {}
        layers = self.index.moe_layers
        keys = [self.keys.routing(domain, layer) for layer in layers]
        table: Table = {}
        for layer, key, fields in zip(layers, keys, await self._hashes(keys), strict=True):
            if fields is not None and (counts := self._counts(key, fields)):
                table[layer] = counts
        if table:
            self._tables[domain] = table
        return table

    async def transition_counts(self, domain: str) -> dict[int, NDArray[np.float64]]:
        """A domain's pair counts from Redis: layer l -> [n_expert][n_expert] counts of (a at l, b at
        l+1), only the layers that have any; empty for a domain that is not accepted."""
        if domain not in self.accepted:
            return {}
        layers = pair_layers(self.index.layers)
        keys = [self.keys.transitions(domain, layer) for layer in layers]
        out: dict[int, NDArray[np.float64]] = {}
        for layer, key, fields in zip(layers, keys, await self._hashes(keys), strict=True):
            if fields is not None and (block := self._pairs(key, fields)).any():
                out[layer] = block
        return out

    async def _hashes(self, keys: list[str]) -> list[dict[str, str] | None]:
        """Every hash of `keys` in one round trip; None for a key of the wrong type (moved aside at the
        next flush), which must not fail the read of the others."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            raw = await pipe.execute(raise_on_error=False)
        out: list[dict[str, str] | None] = []
        for key, fields in zip(keys, raw, strict=True):
            if isinstance(fields, BaseException):
                if not is_wrong_type(fields):
                    raise fields
                self._wrong_type(key)
                fields = None
            out.append(fields)
        return out

    def _pairs(self, key: str, fields: dict[str, str]) -> NDArray[np.float64]:
        n = self.index.n_expert
        block = np.zeros((n, n))
        for field, value in fields.items():
            pair, count = parse_field(field, n), _number(value)
            if pair is None:
                why = f"not a pair of experts of the model (0..{n - 1})"
                self.skips.skip("transitions_field", f"{key} {field}", why)
            elif count is None or count < 0:
                self.skips.skip("transitions_field", f"{key} {field}", "not a finite, non-negative count")
            else:
                block[pair] = count
        return block

    def _counts(self, key: str, fields: dict[str, str]) -> dict[int, float]:
        out: dict[int, float] = {}
        for field, value in fields.items():
            expert, count = _expert_id(field), _number(value)
            if expert is None or expert >= self.index.n_expert:
                self.skips.skip(
                    "routing_field", f"{key} {field}", f"not an expert of the model (0..{self.index.n_expert - 1})"
                )
            elif count is None or count < 0:
                self.skips.skip("routing_field", f"{key} {field}", "not a finite, non-negative count")
            elif count > 0:
                out[expert] = count
        return out

    async def load_tables(self) -> None:
        """Read every domain's table and hot set (at start: the pool's policy gets its priors from
        the tables, and a stored hot set that is unusable is found and replaced now)."""
        await self.audit_if_due()
        for domain in sorted(await self.known_domains()):
            await self.table(domain)
            await self.hot_set(domain)
        await self.tokens()  # read once so that unusable counts show up in the stats
        await self._update_priors()

    async def use_pool(self, pool: ExpertPool | None) -> None:
        """Feed another pool (rebuilt on a replaced model file) from now on, priors first."""
        self.pool = pool
        await self._update_priors()

    async def _update_priors(self) -> None:
        if self.pool is not None and self._tables:
            await asyncio.to_thread(self.pool.set_priors, dict(self._tables))

    async def known_domains(self) -> set[str]:
        """The accepted domains of Redis's domain set."""
        try:
            members = await self.redis.smembers(self.keys.domains)
        except ResponseError as e:
            if not is_wrong_type(e):
                raise
            self._wrong_type(self.keys.domains)
            return set()
        domains = {m for m in members if self.accepts(m, "domain set")}
        self.domains |= domains
        return domains

    async def tokens(self) -> dict[str, int]:
        """Tokens routed per accepted domain."""
        try:
            raw = await self.redis.hgetall(self.keys.tokens)
        except ResponseError as e:
            if not is_wrong_type(e):
                raise
            self._wrong_type(self.keys.tokens)
            return {}
        out = {}
        for domain, value in raw.items():
            if not self.accepts(domain, "tokens"):
                continue
            if not _TOKENS.fullmatch(value):
                self.skips.skip("tokens_field", f"tokens {domain}", "not a non-negative integer")
                continue
            out[domain] = int(value)
        return out

    async def compute_hot_set(self, domain: str) -> HotSetResponse | None:
        table = await self.table(domain)
        return self.hot_set_of(table, domain) if table else None

    def hot_set_of(self, table: Table, domain: str) -> HotSetResponse:
        """The hot set of a table (a domain's counts, or a mix of domains' shares) under the byte budget."""
        sizes = {layer: self.index.expert_bytes(layer) for layer in self.index.layers}
        choice = select_hot_set(table, sizes, self.hotset_bytes)
        return HotSetResponse(
            model_id=self.keys.model,
            domain=domain,
            layers={str(layer): ids for layer, ids in choice.layers.items()},
            n_experts=choice.n_experts,
            bytes=choice.bytes,
            budget_bytes=self.hotset_bytes,
            activations=choice.activations,
            coverage=choice.coverage,
            computed_at=time.time(),
        )

    async def hot_set(self, domain: str, fresh: bool = False) -> HotSetResponse | None:
        """The domain's hot set: remembered, else stored in Redis (same budget), else computed from its
        table. None for a domain without counts, or one that is not accepted (GLOBAL_DOMAIN is)."""
        if domain != GLOBAL_DOMAIN and domain not in self.accepted:
            return None
        if not fresh:
            if (cached := self._hot_sets.get(domain)) is not None:
                return cached
            hot = await self._stored_hot_set(domain)
            if hot is not None and hot.budget_bytes == self.hotset_bytes:
                self._hot_sets[domain] = hot
                return hot
        hot = await self.compute_hot_set(domain)
        if hot is not None:
            await self._store(hot)
        return hot

    async def _stored_hot_set(self, domain: str) -> HotSetResponse | None:
        """The hot set Redis holds for `domain`, if it parses and fits the model (else skipped and
        recomputed: a hot set naming experts the model lacks must never reach llama)."""
        key = self.keys.hotset(domain)
        try:
            stored = await self.redis.get(key)
        except ResponseError as e:
            if not is_wrong_type(e):
                raise
            self._wrong_type(key)
            return None
        if not stored:
            return None
        try:
            hot = HotSetResponse.model_validate_json(stored)
        except ValidationError:
            self.skips.skip("hotset", key, "does not parse as a hot set")
            return None
        if problem := self._hot_set_problem(hot, domain):
            self.skips.skip("hotset", key, problem)
            return None
        return hot

    def _hot_set_problem(self, hot: HotSetResponse, domain: str) -> str | None:
        if hot.domain != domain or hot.model_id != self.keys.model:
            return "stored for another domain or model"
        for layer, ids in hot.layers.items():
            number = _expert_id(layer)
            if number is None or number not in self.index.layers:
                return "names a layer without routed experts"
            if any(not 0 <= e < self.index.n_expert for e in ids) or len(set(ids)) != len(ids):
                return "names experts the model does not have"
        return None

    async def _store(self, hot: HotSetResponse) -> None:
        self._hot_sets[hot.domain] = hot
        await self.redis.set(self.keys.hotset(hot.domain), hot.model_dump_json())

    async def _refresh_hot_sets(self, domains: set[str]) -> None:
        changed: set[str] = set()
        for domain in sorted(domains):
            before = self._hot_sets.get(domain)
            try:
                hot = await self.compute_hot_set(domain)
                if hot is None:
                    continue
                await self._store(hot)
            except RedisError as e:
                self._redis_failed(e)
                return
            if before is None or before.layers != hot.layers:
                changed.add(domain)
        self._hot_sets.pop(GLOBAL_DOMAIN, None)  # every write changes the global table
        await self._update_priors()
        if changed:
            for listener in self._listeners:
                await listener(changed)

    def _cells(self, snapshot: RoutingSnapshot) -> tuple[dict[Cell, int], dict[str, int]]:
        """The snapshot's counts of accepted domains and of the model's layers and experts; the rest
        is skipped: llama counts any tag it is given, and a table per tag would be persisted."""
        counts: dict[Cell, int] = {}
        for domain, layers in snapshot.domains.items():
            if (why := domain_problem(domain, self.accepted)) is not None:
                self.skips.skip("snapshot_domain", None, f"{why}; its counts are not stored")
                continue
            for layer_text, experts in layers.items():
                layer = _expert_id(layer_text)
                if layer is None or layer not in self.index.layers:
                    self.skips.skip("snapshot_cell", None, "a layer without routed experts")
                    continue
                for expert_text, n in experts.items():
                    expert = _expert_id(expert_text)
                    if expert is None or expert >= self.index.n_expert or n < 0:
                        self.skips.skip("snapshot_cell", None, "an expert the model does not have, or a negative count")
                    elif n:
                        counts[(domain, layer, expert)] = int(n)
        tokens = {d: int(n) for d, n in snapshot.tokens_by_domain.items() if n > 0 and d in self.accepted}
        return counts, tokens

    def _pair_cells(self, snapshot: RoutingSnapshot) -> dict[PairCell, int]:
        return pair_cells(snapshot, self.index.layers, self.index.n_expert, self.accepted, self.skips)

    def stats(self) -> FlywheelStats:
        c = self.counters
        return FlywheelStats(
            pulls=c.pulls,
            pull_errors=c.pull_errors,
            last_pull_at=c.last_pull_at,
            last_error=c.last_error,
            activations_pulled=c.activations,
            tokens_pulled=c.tokens,
            transitions_pulled=c.transitions,
            flushes=c.flushes,
            redis_ok=c.redis_ok,
            redis_errors=c.redis_errors,
            buffered_cells=self.buffer.cells,
            buffered_activations=self.buffer.activations,
            dropped_activations=self.buffer.dropped_activations,
            dropped_snapshots=self.buffer.dropped_snapshots,
            domains=sorted(self.domains),
            skipped=dict(sorted(self.skips.counts.items())),
        )


def _expert_id(text: str) -> int | None:
    """A layer or expert number as Redis and llama write it: ASCII decimal digits, nothing else."""
    return int(text) if _DECIMAL.fullmatch(text) else None


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


_DECIMAL = re.compile(r"[0-9]{1,9}")
_TOKENS = re.compile(r"[0-9]{1,19}")


def _per_layer(counts: dict[Cell, int]) -> dict[int, dict[int, float]]:
    out: dict[int, dict[int, float]] = {}
    for (_, layer, expert), n in counts.items():
        acc = out.setdefault(layer, {})
        acc[expert] = acc.get(expert, 0.0) + n
    return out
