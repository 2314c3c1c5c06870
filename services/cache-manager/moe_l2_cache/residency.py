"""The expert pool: host-memory residency of expert weights within a byte budget.

The model file(s) are mapped read-only and shared. The page cache belongs to the file, not to a
process, so pinning (mlock) an expert's pages here keeps them resident for an unmodified llama.cpp
that maps the same file; prefetching (madvise WILLNEED) reads them ahead; evicting (munlock, then
MADV_DONTNEED on our mapping and POSIX_FADV_DONTNEED on the file) lets the kernel drop them.

Which experts the pool holds is the expert-cache policy's decision (`moe_l2_cache.policy`, capacity
= the experts per MoE layer the budget holds): the pinned hot set and every prefetch are accesses
to it, and what it keeps resident is what the pool holds. The hot set's experts among those are
locked; the others are only prefetched. The pages themselves (mapping, mlock, madvise, mincore and
their reference counts) are pages.py's.
"""

from __future__ import annotations

import errno
import logging
import resource
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from moe_l2_cache.pages import ModelPages, PageRun, Span
from moe_l2_cache.policy import DEFAULT_POLICY, ExpertCachePolicy, PolicyError, make_policy
from moe_l2_contracts.schemas.cache import PoolStats
from moe_l2_gguf.index import ExpertIndex

log = logging.getLogger(__name__)

Expert = tuple[int, int]  # (layer, expert)


class PoolError(Exception):
    """The pool cannot be set up (unreadable file, bad policy); the message is for the user."""


def memlock_limit() -> int | None:
    """RLIMIT_MEMLOCK's soft limit in bytes, None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


@dataclass
class _Counters:
    prefetch_bytes: int = 0
    evicted_bytes: int = 0
    lock_failures: int = 0


@dataclass
class PinResult:
    pinned: int  # experts of the hot set the pool holds
    locked_bytes: int
    dropped: int  # hot-set experts the budget (the policy) did not keep
    lock_mode: str


@dataclass
class _State:
    tracked: set[Expert] = field(default_factory=set)
    pinned: set[Expert] = field(default_factory=set)
    locked: set[Expert] = field(default_factory=set)
    hot: dict[Expert, int] = field(default_factory=dict)  # expert -> rank in the hot set (0 = most useful)


class ExpertPool:
    """Thread-safe: every public method holds the pool's lock."""

    def __init__(
        self,
        index: ExpertIndex,
        budget_bytes: int,
        policy: str | None = None,
        *,
        lock: bool = True,
    ) -> None:
        if budget_bytes < 0:
            raise PoolError(f"pool budget must be >= 0 bytes (got {budget_bytes})")
        self.index = index
        self.budget_bytes = budget_bytes
        try:
            self._pages = ModelPages(index.files)
        except OSError as e:
            raise PoolError(f"cannot map {e.filename or 'the model'}: {e.strerror or e}") from e
        n_moe = len(index.layers)
        self.capacity_per_layer = min(index.n_expert, budget_bytes // (n_moe * index.max_expert_bytes))
        try:
            self.policy_name, self._policy = _make_policy(policy, index, self.capacity_per_layer)
        except PoolError:
            self._pages.close()
            raise
        self.lock_mode: Literal["mlock", "prefetch-only"] = "mlock" if lock else "prefetch-only"
        self.lock_problem: str | None = None if lock else "locking disabled by configuration"
        self._state = _State()
        self._counters = _Counters()
        self._lock = threading.RLock()
        self._spans: dict[Expert, list[Span]] = {}

    # -- public API --------------------------------------------------------------------------------

    @property
    def pages(self) -> ModelPages:
        """The model's mapped pages (the RAM tier locks, probes and drops through them; under the pool's lock)."""
        return self._pages

    @property
    def mutex(self) -> threading.RLock:
        """The pool's lock: hold it while using `pages`."""
        return self._lock

    def tracked(self) -> set[Expert]:
        with self._lock:
            return set(self._state.tracked)

    @property
    def policy(self) -> ExpertCachePolicy:
        """The replacement policy (read it, do not drive it: the pool's lock guards it)."""
        return self._policy

    def pin(self, domain: str | None, hot: Mapping[int, Sequence[int]]) -> PinResult:
        """Make `hot` (per layer, most useful first) the pinned set: the policy admits it, what it keeps is locked."""
        with self._lock:
            self._policy.on_domain(domain)
            self._state.hot = {}
            rank = 0
            for layer, experts in hot.items():
                self._check_layer(layer)
                for e in experts:
                    self._state.hot[(layer, int(e))] = rank
                    rank += 1
                # least useful first, so the most useful is the most recent access
                for e in reversed(list(experts)):
                    self._policy.access(layer, [int(e)])
            self._sync()
            held = len(self._state.pinned)
            return PinResult(held, self._locked_bytes(), len(self._state.hot) - held, self.lock_mode)

    def prefetch(self, experts: Mapping[int, Sequence[int]]) -> int:
        """Experts about to be needed (e.g. a hinted domain's hot set): read ahead if the policy keeps them."""
        with self._lock:
            before = self._counters.prefetch_bytes
            for layer, ids in experts.items():
                self._check_layer(layer)
                for e in reversed(list(ids)):
                    self._policy.access(layer, [int(e)])
            self._sync()
            return self._counters.prefetch_bytes - before

    def observe(self, counts: Mapping[int, Mapping[int, float]]) -> None:
        """Routing counts llama reported: the experts used, least used first (the last access is the strongest)."""
        with self._lock:
            for layer, per_expert in counts.items():
                if layer not in self.index.layers:
                    continue
                for e, _ in sorted(per_expert.items(), key=lambda kv: (kv[1], -kv[0])):
                    if 0 <= e < self.index.n_expert:
                        self._policy.access(layer, [e])
            self._sync()

    def set_priors(self, tables: Mapping[str, Mapping[int, Mapping[int, float]]]) -> None:
        """Per-domain routing counts (the flywheel's tables) as the policy's priors, if it takes any."""
        set_priors = getattr(self._policy, "set_priors", None)
        if set_priors is None or not tables:
            return
        from moe_l2_cache.policy import profile_from_counts

        by_domain = {
            d: {str(layer): {str(e): c for e, c in row.items()} for layer, row in table.items()}
            for d, table in tables.items()
        }
        profile = profile_from_counts(by_domain, self.index.n_layer, self.index.n_expert, self.index.n_expert_used)
        with self._lock:
            set_priors(profile.global_freq, profile.domain_freq)

    def evict_all(self) -> int:
        """Drop everything the pool holds; returns the bytes released."""
        with self._lock:
            released = self._tracked_bytes()
            drop: list[PageRun] = []
            for expert in list(self._state.tracked):
                self._untrack(expert, drop)
            self._pages.drop(drop)
            self._state.pinned.clear()
            self._state.hot.clear()
            self._policy.reset()
            return released

    def holds(self) -> dict[str, set[Expert]]:
        with self._lock:
            return {
                "tracked": set(self._state.tracked),
                "pinned": set(self._state.pinned),
                "locked": set(self._state.locked),
            }

    def resident_bytes(self, experts: Iterable[Expert]) -> tuple[int, int]:
        """(resident, total) bytes of these experts' slices, from mincore."""
        with self._lock:
            resident = total = 0
            for expert in experts:
                for span in self._spans_of(expert):
                    resident += self._pages.resident(span)
                    total += span.length
            return resident, total

    def stats(self) -> PoolStats:
        with self._lock:
            tracked = self._state.tracked
            resident, _ = self.resident_bytes(tracked)
            return PoolStats(
                budget_bytes=self.budget_bytes,
                policy=self.policy_name,
                capacity_per_layer=self.capacity_per_layer,
                lock_mode=self.lock_mode,
                lock_problem=self.lock_problem,
                memlock_limit_bytes=memlock_limit(),
                pinned_experts=len(self._state.pinned),
                pinned_bytes=self._bytes(self._state.pinned),
                locked_bytes=self._locked_bytes(),
                tracked_experts=len(tracked),
                tracked_bytes=self._tracked_bytes(),
                resident_bytes=resident,
                prefetch_bytes_total=self._counters.prefetch_bytes,
                evicted_bytes_total=self._counters.evicted_bytes,
                lock_failures=self._counters.lock_failures,
            )

    def close(self) -> None:
        with self._lock:
            for expert in list(self._state.locked):
                self._unlock(expert)
            self._pages.close()

    # -- synchronisation with the policy -------------------------------------------------------------

    def _sync(self) -> None:
        desired = {(layer, e) for layer in self.index.layers for e in self._policy.resident(layer)}
        desired = self._within_budget(desired)
        drop: list[PageRun] = []
        for expert in self._state.tracked - desired:
            self._untrack(expert, drop)
        self._pages.drop(drop)
        for expert in sorted(desired - self._state.tracked):
            self._track(expert)
        want = {x for x in desired if x in self._state.hot}
        for expert in self._state.locked - want:
            self._unlock(expert)
        self._state.pinned = want
        if self.lock_mode == "mlock":
            for expert in sorted(want - self._state.locked, key=self._state.hot.__getitem__):
                if not self._try_lock(expert, want):
                    break

    def _within_budget(self, desired: set[Expert]) -> set[Expert]:
        # The policy's capacity already fits the budget; this guard keeps the promise whatever it returns.
        total = self._bytes(desired)
        if total <= self.budget_bytes:
            return desired
        keep: set[Expert] = set()
        used = 0
        order = sorted(desired, key=lambda x: (self._state.hot.get(x, len(self._state.hot)), x))
        for expert in order:
            size = self.index.expert_bytes(expert[0])
            if used + size <= self.budget_bytes:
                keep.add(expert)
                used += size
        return keep

    def _try_lock(self, expert: Expert, want: set[Expert]) -> bool:
        try:
            self._lock_expert(expert)
            return True
        except OSError as e:
            self._counters.lock_failures += 1
            self._degrade(e, want)
            return False

    def _degrade(self, exc: OSError, want: set[Expert]) -> None:
        limit = memlock_limit()
        limit_text = "unlimited" if limit is None else f"{limit} bytes"
        hint = (
            "raise it (ulimit -l unlimited, or compose's memlock ulimit) or grant CAP_IPC_LOCK"
            if exc.errno in (errno.ENOMEM, errno.EPERM, errno.EAGAIN)
            else "see the error"
        )
        self.lock_problem = (
            f"mlock failed ({errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror}); RLIMIT_MEMLOCK is "
            f"{limit_text}: locked {self._locked_bytes()} of {self._bytes(want)} hot-set bytes; "
            f"the rest is prefetched only ({hint})"
        )
        self.lock_mode = "prefetch-only"
        log.warning("expert pool: %s", self.lock_problem)

    # -- per expert ---------------------------------------------------------------------------------

    def _track(self, expert: Expert) -> None:
        for span in self._spans_of(expert):
            self._pages.hold(span)
            self._counters.prefetch_bytes += span.length
        self._state.tracked.add(expert)

    def _untrack(self, expert: Expert, drop: list[PageRun]) -> None:
        """Stop holding an expert; the page runs nobody else holds go to `drop` (ModelPages.drop)."""
        if expert in self._state.locked:
            self._unlock(expert)
        for span in self._spans_of(expert):
            drop += self._pages.release(span)
            self._counters.evicted_bytes += span.length
        self._state.tracked.discard(expert)
        self._state.pinned.discard(expert)

    def _lock_expert(self, expert: Expert) -> None:
        self._pages.lock(self._spans_of(expert))
        self._state.locked.add(expert)

    def _unlock(self, expert: Expert) -> None:
        for span in self._spans_of(expert):
            self._pages.unlock(span)
        self._state.locked.discard(expert)

    def _spans_of(self, expert: Expert) -> list[Span]:
        spans = self._spans.get(expert)
        if spans is None:
            layer, e = expert
            spans = [self._pages.span(r) for r in self.index.expert_ranges(layer, e)]
            self._spans[expert] = spans
        return spans

    def _check_layer(self, layer: int) -> None:
        if layer not in self.index.layers:
            raise ValueError(f"layer {layer} has no routed experts (MoE layers: {self.index.moe_layers})")

    def _bytes(self, experts: Iterable[Expert]) -> int:
        return sum(self.index.expert_bytes(layer) for layer, _ in experts)

    def _locked_bytes(self) -> int:
        return self._bytes(self._state.locked)

    def _tracked_bytes(self) -> int:
        return self._bytes(self._state.tracked)


def _make_policy(name: str | None, index: ExpertIndex, capacity: int) -> tuple[str, ExpertCachePolicy]:
    chosen = name or DEFAULT_POLICY
    try:
        # top_k: the pool feeds the policy one expert at a time, not a token's k experts at once
        policy = make_policy(chosen, index.n_layer, index.n_expert, capacity, top_k=index.n_expert_used)
        return policy.name, policy
    except PolicyError as e:
        raise PoolError(f"MOE_L2_CACHE_POLICY: {e}") from e
