"""Feeding llama's expert cache with what the flywheel learned: each domain's prior and transitions.

The engine's cache (patches 0009-0014 and 0026-0031, docs/expert-cache.md) evicts by the hybrid score, which
weighs each expert by the prior of the running request's domain. That prior is the flywheel's
table: per cached layer, each expert's share of the layer's (decayed) activations in the domain's
requests. The cache holds only some model layers, depending on the placement (--cpu-moe, --n-cpu-moe
N, -ot), so the feeder asks which (GET /moe/cache) and sends one row per cached layer
(POST /moe/cache/profile, `freq`).

Every table is sent again each interval (MOE_L2_CACHE_ENGINE_PROFILE_INTERVAL_S, 30 s by default) rather
than tracking what llama holds: a table is n_layer x n_expert float32 (26 x 64 x 4 = 6.5 KB for
DeepSeek-V2-Lite), and a llama that restarted gets its priors back within one interval.

The default policy's cross-layer prefetch reads a table of transitions, P(expert b at layer l+1 | a at
l). With LLAMA_ARG_MOE_TRANSITIONS llama counts them per domain (patch 0032), the flywheel stores them
(transitions.py), and each round sends a domain's table with its prior once the domain has routed
MOE_L2_CACHE_ENGINE_TRANSITIONS_MIN_TOKENS tokens (1,000 by default: a table fitted on a few tokens says
P = 1 for whatever those tokens did, and every prefetch of a wrong guess costs a copy). Requests of
no domain ("untagged") get theirs as the table of no domain (`domain: null`, no prior: the engine
takes none for it); it also serves a domain without its own. A table is n_layer x n_expert^2
float32: 426 KB for DeepSeek-V2-Lite, sent each interval like the priors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import httpx
import numpy as np
from numpy.typing import NDArray
from pydantic import ValidationError
from redis.exceptions import RedisError

from moe_l2_cache.flywheel import Flywheel
from moe_l2_cache.transitions import cache_transitions
from moe_l2_contracts.domains import UNTAGGED
from moe_l2_contracts.schemas.llama import ExpertCacheProfile, ExpertCacheShape

log = logging.getLogger("moe_l2_cache.engine_cache")


def domain_prior(table: Mapping[int, Mapping[int, float]], layers: Sequence[int], n_expert: int) -> NDArray | None:
    """[len(layers)][n_expert], each row summing to 1: each expert's share of its layer's activations.
    A layer without counts is uniform (no preference); None when no cached layer has any."""
    freq = np.zeros((len(layers), n_expert))
    seen = False
    for li, layer in enumerate(layers):
        for expert, count in table.get(layer, {}).items():
            if 0 <= expert < n_expert and count > 0:
                freq[li, expert] = count
        total = freq[li].sum()
        if total > 0:
            freq[li] /= total
            seen = True
        else:
            freq[li] = 1.0 / n_expert
    return freq if seen else None


@dataclass
class FeederStats:
    state: str = "unknown"  # "on": pushing; "off": llama runs without the cache; "error": see last_error
    pushes: int = 0  # domain tables accepted by llama
    transition_pushes: int = 0  # of those, the ones with transitions
    errors: int = 0  # rounds that failed
    last_error: str = ""
    last_push_at: float | None = None
    layers: int = 0  # the cache's layers, as llama last said


class EngineCacheFeeder:
    def __init__(
        self,
        flywheel: Flywheel,
        llama: httpx.AsyncClient,
        admin_headers: Mapping[str, str],
        interval_s: float,
        transitions_min_tokens: int = 1000,
    ) -> None:
        self.flywheel = flywheel
        self.llama = llama
        self.admin_headers = dict(admin_headers)
        self.interval_s = interval_s
        self.transitions_min_tokens = transitions_min_tokens
        self.counters = FeederStats()
        self._problem = ""  # the last reason logged, so a reason repeats once, not every interval

    def stats(self) -> FeederStats:
        return self.counters

    async def run(self) -> None:
        """Push now, then every interval, until cancelled."""
        while True:
            try:
                await self.push()
            except Exception:  # a bug must not stop the feeder; the next round tries again
                log.exception("expert cache profile push failed")
            await asyncio.sleep(self.interval_s)

    async def push(self) -> int:
        """Send every accepted domain's prior to llama's cache; the number llama accepted."""
        try:
            shape = await self._shape()
            if shape is None:
                self._settle("off", "llama runs without the expert cache (no --moe-cache-bytes): no priors to send")
                return 0
            self._check(shape)
            pushed = with_transitions = 0
            tokens = await self.flywheel.tokens()
            for domain in sorted(await self.flywheel.known_domains()):
                # the engine's table of no domain takes no prior
                freq = None if domain == UNTAGGED else await self._prior(domain, shape)
                transitions = None
                if tokens.get(domain, 0) >= self.transitions_min_tokens:
                    transitions = await self._transitions(domain, shape)
                if freq is None and transitions is None:
                    continue  # both null would remove the domain's tables
                name = None if domain == UNTAGGED else domain
                await self._post(ExpertCacheProfile.from_tables(name, freq=freq, transitions=transitions))
                pushed += 1
                with_transitions += transitions is not None
        except RedisError as e:  # the tables are read again next round; llama keeps the last ones meanwhile
            return self._failed("Redis unreachable, the priors are not updated", f"{type(e).__name__}: {e}")
        except _FeedError as e:
            return self._failed(str(e))
        self.counters.pushes += pushed
        self.counters.transition_pushes += with_transitions
        self.counters.last_push_at = time.time()
        self._settle(
            "on",
            f"sending the routing tables of {pushed} domains ({with_transitions} with transitions) "
            "to llama's expert cache",
        )
        return pushed

    async def _prior(self, domain: str, shape: ExpertCacheShape) -> NDArray | None:
        return domain_prior(await self.flywheel.table(domain), shape.layers, shape.n_expert)

    async def _transitions(self, domain: str, shape: ExpertCacheShape) -> NDArray | None:
        counts = await self.flywheel.transition_counts(domain)
        index = self.flywheel.index
        return cache_transitions(counts, shape.layers, index.n_expert_used, index.moe_layers)

    def _failed(self, reason: str, detail: str = "") -> int:
        self.counters.errors += 1
        self.counters.last_error = f"{reason}: {detail}" if detail else reason
        self._settle("error", reason, detail)
        return 0

    def _settle(self, state: str, reason: str, detail: str = "") -> None:
        """Logs the reason when it changes (its detail, such as an exception's text, may vary meanwhile)."""
        self.counters.state = state
        if reason != self._problem:
            (log.warning if state == "error" else log.info)("%s", f"{reason}: {detail}" if detail else reason)
            self._problem = reason

    async def _shape(self) -> ExpertCacheShape | None:
        try:
            resp = await self.llama.get("/moe/cache")
        except httpx.HTTPError as e:
            raise _FeedError(f"llama unreachable: {type(e).__name__}: {e}") from e
        if resp.status_code in (404, 501):  # a build without the cache's routes, or the cache off
            return None
        if resp.status_code != 200:
            raise _FeedError(f"llama answered {resp.status_code} to GET /moe/cache: {resp.text[:200]}")
        try:
            shape = ExpertCacheShape.model_validate(resp.json())
        except (ValueError, ValidationError) as e:
            raise _FeedError(f"llama's GET /moe/cache answer does not fit the contract: {e}") from e
        self.counters.layers = shape.n_layer
        return shape

    def _check(self, shape: ExpertCacheShape) -> None:
        index = self.flywheel.index
        if shape.n_expert != index.n_expert or not set(shape.layers) <= set(index.layers):
            raise _FeedError(
                f"llama's expert cache holds layers {shape.layers} of {shape.n_expert} experts, the indexed "
                f"{index.path} has MoE layers {index.layers[0]}..{index.layers[-1]} of {index.n_expert}: "
                "is MOE_L2_MODEL_PATH right?"
            )

    async def _post(self, body: ExpertCacheProfile) -> None:
        try:
            resp = await self.llama.post("/moe/cache/profile", json=body.model_dump(), headers=self.admin_headers)
        except httpx.HTTPError as e:
            raise _FeedError(f"llama unreachable: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            raise _FeedError(f"llama answered {resp.status_code} to POST /moe/cache/profile: {resp.text[:200]}")


class _FeedError(Exception):
    """A round that could not complete; the message is one line for the log and the stats."""
