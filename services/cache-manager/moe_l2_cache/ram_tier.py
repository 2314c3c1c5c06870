"""The RAM tier: the model file's resident memory held within MOE_L2_RAM_BUDGET.

llama-server maps the whole GGUF; on a machine smaller than the model the kernel's page cache is
then the expert cache, and it evicts by page age, not by what the routing will need next. With a
budget the cache-manager decides instead:

* the non-expert tensors (attention, norms, embeddings, shared experts, the GGUF header) are
  locked: every token needs them;
* the experts the pool holds (its policy, the project's default, fed by the domain's hot set, the
  routing llama reports and the misses seen here) are read ahead and kept, the hot set locked;
* every sweep (MOE_L2_CACHE_RAM_SWEEP_S) finds, with one mincore over the file, the expert pages
  resident but not held: experts llama just faulted in (misses). They are reported to the policy as
  accesses; what it still does not hold is paged out of llama's own mapping (foreign_maps.py) and
  dropped from the page cache.

The budget covers the whole file's residency, counted in pages as the kernel holds it: the pages
always kept (every page with a non-expert byte, and the pages two experts' slices share at a
boundary, which are never paged out) + the pool's experts + a headroom for the misses llama faults
in before they are paged out (one token's routed experts and one layer's every expert by default, at
most a third of the expert budget). On a real model the kept pages exceed the non-expert bytes by
about a page per slice boundary (0.25% of a 4.6 MiB expert); on the demo model, whose 8 KiB slices
start off page boundaries, they are twice its non-expert bytes (6.16 MB against 3.02 MB), which is
what left it 3% over a budget counted in bytes.

The file is watched by identity: replaced (a new inode, size or mtime) -> ModelReplaced, and the
service rebuilds the pool on the new file (app.py).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moe_l2_cache.foreign_maps import ProcessPager, find_mappers
from moe_l2_cache.pages import PAGE, PageRun, Span, page_runs
from moe_l2_cache.residency import ExpertPool
from moe_l2_contracts.schemas.cache import RamTierStats
from moe_l2_gguf.index import ByteRange, ExpertIndex

log = logging.getLogger(__name__)

_NON_EXPERT = -1  # a page holding non-expert bytes: always kept
_SHARED = -2  # a page two experts' slices share: never paged out
_FULL_SWEEP_EVERY_S = 1.0  # a full pass at least this often: partial residency, other readers of the file


class RamTierError(Exception):
    """The budget cannot be met (smaller than what must stay resident); the message is for the user."""


class ModelReplaced(Exception):
    """The file at the model path is no longer the file the tier mapped."""


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


@dataclass(frozen=True)
class RamPlan:
    budget_bytes: int
    file_bytes: int
    non_expert_bytes: int
    expert_bytes: int  # every routed expert slice
    headroom_bytes: int
    kept_bytes: int  # the pages always resident: those with a non-expert byte, and those two experts share

    @property
    def expert_budget_bytes(self) -> int:
        return self.budget_bytes - self.kept_bytes

    @property
    def pool_bytes(self) -> int:
        """What the expert pool may hold: the expert budget less the misses' headroom."""
        return self.expert_budget_bytes - self.headroom_bytes


def plan_ram(index: ExpertIndex, budget_bytes: int, headroom_bytes: int | None = None) -> RamPlan:
    """Split MOE_L2_RAM_BUDGET; RamTierError when it cannot hold the pages always kept and one expert per layer."""
    file_bytes = sum(index.file_sizes)
    expert_bytes = index.routed_bytes
    non_expert = file_bytes - expert_bytes
    kept = kept_page_bytes(index)
    one_per_layer = sum(index.expert_bytes(layer) for layer in index.layers)
    minimum = kept + one_per_layer
    if budget_bytes < minimum:
        raise RamTierError(
            f"MOE_L2_RAM_BUDGET is {gib(budget_bytes)} ({budget_bytes} bytes), but the model's non-expert tensors "
            f"take {gib(non_expert)} ({non_expert} bytes; {kept} bytes in the pages they and the experts' shared "
            f"boundaries occupy) and always stay in memory, with at least one expert per MoE layer "
            f"({gib(one_per_layer)}): give at least {gib(minimum)} ({minimum} bytes); the whole model "
            f"{index.path.name} is {gib(file_bytes)}"
        )
    expert_budget = budget_bytes - kept
    if headroom_bytes is None:
        headroom_bytes = min(default_headroom(index), expert_budget // 3)
    headroom_bytes = max(0, min(headroom_bytes, expert_budget - one_per_layer))
    return RamPlan(budget_bytes, file_bytes, non_expert, expert_bytes, headroom_bytes, kept)


def default_headroom(index: ExpertIndex) -> int:
    """The misses llama may read between two passes: one token's routed experts (decode) plus one layer's
    every expert (a prompt's prefill routes nearly all of them, read at once by --moe-willneed while the
    previous layer's still wait for a pass). Measured on the 9.5 GB ds-v2-lite shape at 50%: with one
    token's routed experts alone (0.71 GiB) the model went 0.03 and 0.12 GiB over the budget in two runs of
    three, between passes (a full pass takes ~330 ms); 256 MiB (the disk's ~1 GB/s x two 0.1 s
    intervals) was measured too small: 0.4 GiB over."""
    one_per_layer = sum(index.expert_bytes(layer) for layer in index.layers)
    widest_layer = max(index.expert_bytes(layer) * index.n_expert for layer in index.layers)
    return index.n_expert_used * one_per_layer + widest_layer


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class _Counters:
    sweeps: int = 0
    paged_out_bytes: int = 0
    misses_seen: int = 0
    sweep_seconds: float = 0.0
    max_resident_bytes: int = 0
    over_budget_sweeps: int = 0


@dataclass
class _Layout:
    """Per file, the owner of every page: a global expert id, _NON_EXPERT or _SHARED."""

    owners: list[np.ndarray]
    non_expert_runs: list[PageRun]
    experts: list[tuple[int, int]] = field(default_factory=list)  # global id -> (layer, expert)
    expert_runs: list[list[PageRun]] = field(default_factory=list)  # global id -> the pages it alone owns
    probes: list[tuple[int, int]] = field(default_factory=list)  # global id -> (file, page): its first own page
    expert_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # global id -> bytes


def _experts(index: ExpertIndex) -> list[tuple[int, int]]:
    """Global expert id -> (layer, expert)."""
    return [(layer, e) for layer in index.moe_layers for e in range(index.n_expert)]


def page_owners(index: ExpertIndex) -> list[np.ndarray]:
    """Per file, the owner of every page: a global expert id (_experts' order), _NON_EXPERT (a page with a
    non-expert byte) or _SHARED (a page two experts' slices share). From the index alone: the plan needs it
    before any file is mapped."""
    files = {path: i for i, path in enumerate(index.files)}
    sizes = [(size + PAGE - 1) // PAGE for size in index.file_sizes]
    owners = [np.full(n, _NON_EXPERT, dtype=np.int32) for n in sizes]
    marked = [np.zeros(n, dtype=bool) for n in sizes]  # pages with some expert byte
    expert_bytes = [np.zeros(n, dtype=np.int64) for n in sizes]
    for gid, (layer, e) in enumerate(_experts(index)):
        for r in index.expert_ranges(layer, e):
            f, first, last = files[r.path], r.offset // PAGE, (r.offset + r.length - 1) // PAGE
            shared = marked[f][first : last + 1] & (owners[f][first : last + 1] != gid)
            owners[f][first : last + 1] = np.where(shared, _SHARED, gid)
            marked[f][first : last + 1] = True
            _add_bytes(expert_bytes[f], r)
    for f, owner in enumerate(owners):
        # a page is expert-only when expert slices cover all of its bytes
        full = np.full(sizes[f], PAGE, dtype=np.int64)
        full[-1] = index.file_sizes[f] - (sizes[f] - 1) * PAGE
        owner[expert_bytes[f] < full] = _NON_EXPERT
    return owners


def kept_page_bytes(index: ExpertIndex) -> int:
    """The bytes of the pages the tier always keeps: those with a non-expert byte and those two experts share."""
    return sum(int(((owner == _NON_EXPERT) | (owner == _SHARED)).sum()) for owner in page_owners(index)) * PAGE


def _layout(index: ExpertIndex, pool: ExpertPool) -> _Layout:
    pages = pool.pages
    owners = page_owners(index)
    experts = _experts(index)
    runs = [(f, int(a), int(b)) for f, owner in enumerate(owners) for a, b in page_runs(owner == _NON_EXPERT)]
    expert_runs: list[list[PageRun]] = []
    for gid, (layer, e) in enumerate(experts):
        own: list[PageRun] = []
        for r in index.expert_ranges(layer, e):
            span = pages.span(r)
            mine = owners[span.file][span.first : span.last + 1] == gid
            own += [(span.file, span.first + int(a), span.first + int(b)) for a, b in page_runs(mine)]
        expert_runs.append(own)
    probes = [(run[0][0], run[0][1]) if run else (-1, -1) for run in expert_runs]
    sizes = np.array([index.expert_bytes(layer) for layer, _ in experts], dtype=np.int64)
    return _Layout(owners, runs, experts, expert_runs, probes, sizes)


def _add_bytes(acc: np.ndarray, r: ByteRange) -> None:
    first, last = r.offset // PAGE, (r.offset + r.length - 1) // PAGE
    if first == last:
        acc[first] += r.length
        return
    acc[first] += PAGE - r.offset % PAGE
    acc[first + 1 : last] += PAGE
    acc[last] += r.offset + r.length - last * PAGE


class RamTier:
    """Keeps the model's resident pages within the plan's budget. sweep() runs in a worker thread."""

    def __init__(
        self, index: ExpertIndex, pool: ExpertPool, plan: RamPlan, *, lock: bool = True, generation: int = 0
    ) -> None:
        self.index = index
        self.generation = generation  # how many times the model file was replaced and the tier rebuilt
        self.pool = pool
        self.plan = plan
        self._identity = [_identity(p) for p in index.files]
        self._layout = _layout(index, pool)
        self._ids = {x: i for i, x in enumerate(self._layout.experts)}
        self._counters = _Counters()
        self._pagers: dict[int, ProcessPager] = {}
        self._refused: set[int] = set()  # processes the kernel would not let us page out
        self._locked: list[Span] = []
        self._was_missing = np.zeros(len(self._layout.experts), dtype=bool)
        self._was_tracked = np.zeros(len(self._layout.experts), dtype=bool)
        self._next_scan = 0.0
        self.rescan_s = 2.0
        self._faults = -1
        self._reads = -1
        self._last_full = 0.0
        self._grace_pending = False
        self.problem: str | None = None
        self.lock_mode = "mlock" if lock else "prefetch-only"
        self._keep_non_expert(lock)
        pool.pages.page_out_elsewhere = self._page_out  # the pool's evictions leave llama's mapping at once

    # -- setup ---------------------------------------------------------------------------------------

    def _keep_non_expert(self, lock: bool) -> None:
        pages = self.pool.pages
        spans = [Span(f, a * PAGE, (b - a + 1) * PAGE) for f, a, b in self._layout.non_expert_runs]
        with self.pool.mutex:
            pages.keep(self._layout.non_expert_runs)
            pages.read_ahead(self._layout.non_expert_runs)
            if not lock:
                return
            try:
                pages.lock(spans)
                self._locked = spans
            except OSError as e:
                self.lock_mode = "prefetch-only"
                self._say(
                    f"cannot lock the non-expert tensors ({gib(self.plan.non_expert_bytes)}: {e.strerror}); they are "
                    "read ahead and never paged out, but the kernel may still evict them under pressure (raise "
                    "RLIMIT_MEMLOCK: ulimit -l unlimited, compose's memlock ulimit, or CAP_IPC_LOCK)"
                )

    def _say(self, problem: str) -> None:
        """A degraded mode is said once (log and stats), not once per sweep."""
        if problem != self.problem:
            self.problem = problem
            log.warning("RAM tier: %s", problem)

    # -- the sweep -----------------------------------------------------------------------------------

    def check_file(self) -> None:
        """ModelReplaced when a model file is no longer the one mapped (a missing file is not: it is being replaced)."""
        for path, known in zip(self.index.files, self._identity, strict=True):
            try:
                now = _identity(path)
            except FileNotFoundError:
                continue
            if now != known:
                raise ModelReplaced(f"{path} changed (inode, size or modification time)")

    def step(self) -> int:
        """The loop's pass: a full one at least every _FULL_SWEEP_EVERY_S, quick ones in between."""
        if time.monotonic() - self._last_full >= _FULL_SWEEP_EVERY_S:
            return self.sweep()
        return self.quick_sweep()

    def quick_sweep(self) -> int:
        """A pass on one page per expert: its first page resident = llama read it (the engine reads a chosen
        expert's slices at once with --moe-willneed; a fault reads around the first page it touches). ~45 ms
        over the 9.5 GB ds-v2-lite shape (13 ms of probes) where the full pass takes ~330 ms. With the full
        pass alone, run once a second since --moe-willneed's reads take no major fault, the model went
        0.23 GiB over the budget at 50%; with quick passes too, 0.08-0.26 GiB: a prefill's burst of reads
        still outruns them (docs/ram-tier.md). Skipped while llama read nothing."""
        started = time.monotonic()
        self.check_file()
        self._refresh_pagers(started)
        reads = self._llama_reads()
        if reads == self._reads and not self._grace_pending:
            return 0
        self._reads = reads
        pages = self.pool.pages
        with self.pool.mutex:
            present = self._probe()
            fresh = self._fresh(present)
            self._grace_pending = bool(fresh.any())
            if fresh.any():
                self._counters.misses_seen += int(fresh.sum())
                self.pool.prefetch(self._by_layer(fresh))
            held = self._flags(self.pool.tracked())
            estimate = self.plan.non_expert_bytes + int(self._layout.expert_bytes[present].sum())
            grace = self._grace(fresh, estimate)
            runs = self._layout.expert_runs
            out_runs = [run for gid in np.flatnonzero(present & ~held & ~grace) for run in runs[gid]]
            # held experts the kernel evicted come back, and the rest of a miss kept one more pass
            in_runs = [run for gid in np.flatnonzero((held & ~present) | grace) for run in runs[gid]]
            self._page_out(out_runs)
            pages.forget(out_runs)
            paged = sum((b - a + 1) * PAGE for _, a, b in out_runs)
            pages.read_ahead(in_runs)
        c = self._counters
        c.sweeps += 1
        c.paged_out_bytes += paged
        c.sweep_seconds += time.monotonic() - started
        return paged

    def _probe(self) -> np.ndarray:
        """Per expert: its probe page is in the page cache."""
        present = np.zeros(len(self._layout.experts), dtype=bool)
        probes = np.array(self._layout.probes, dtype=np.int64).reshape(-1, 2)
        for f in range(len(self._layout.owners)):
            ids = np.flatnonzero(probes[:, 0] == f)
            present[ids] = self.pool.pages.resident_pages(f, probes[ids, 1])
        return present

    def _llama_reads(self) -> int:
        """Bytes llama's processes read from storage (/proc/PID/io), plus their major faults: what the
        engine's read-ahead brings in takes no fault, a stock llama's faults may read nothing new."""
        total = self._llama_faults()
        for pid in self._pagers:
            try:
                text = Path(f"/proc/{pid}/io").read_text()
            except OSError:
                continue
            total += int(next((ln.split()[1] for ln in text.splitlines() if ln.startswith("read_bytes:")), 0))
        return total

    def sweep(self) -> int:
        """One pass: report misses to the policy, page out what it does not hold. Returns bytes paged out.

        Skipped (a stat read) while llama took no major fault since the last pass: no fault, no miss to
        page out. A pass over a 10 GB model costs tens of milliseconds of CPU, mostly mincore."""
        started = time.monotonic()
        self.check_file()
        self._refresh_pagers(started)
        faults = self._llama_faults()
        idle = faults == self._faults and not self._grace_pending
        if idle and started - self._last_full < _FULL_SWEEP_EVERY_S:
            return 0
        self._faults, self._last_full = faults, started
        pages = self.pool.pages
        with self.pool.mutex:
            resident = [pages.resident_map(f) for f in range(len(self._layout.owners))]
            fresh = self._fresh_misses(resident)
            self._grace_pending = bool(fresh.any())  # the next pass decides them, faults or not
            if fresh.any():
                self._counters.misses_seen += int(fresh.sum())
                self.pool.prefetch(self._by_layer(fresh))  # accesses: the policy may admit them (and evict others)
            held = self._flags(self.pool.tracked())
            total = sum(int(r.sum()) for r in resident) * PAGE
            grace = self._grace(fresh, total)
            out_runs, in_runs = self._runs_to_move(resident, held, grace)
            self._page_out(out_runs)
            pages.forget(out_runs)
            paged = sum((b - a + 1) * PAGE for _, a, b in out_runs)
            pages.read_ahead(in_runs)
        # the peak: what was resident before this sweep paged anything out
        self._count(total, paged, time.monotonic() - started)
        return paged

    def _fresh_misses(self, resident: list[np.ndarray]) -> np.ndarray:
        """Experts resident now, not held by the pool, and not already so at the last pass: llama's new misses.
        Reported once per arrival: one nobody could page out would otherwise count as a miss every pass."""
        seen = np.zeros(len(self._layout.experts), dtype=bool)
        for owner, res in zip(self._layout.owners, resident, strict=True):
            seen[owner[res & (owner >= 0)]] = True
        return self._fresh(seen)

    def _fresh(self, seen: np.ndarray) -> np.ndarray:
        """Of the experts resident now (some page of each), the new misses; remembers this pass's state."""
        tracked = self._flags(self.pool.tracked())
        missing = seen & ~tracked
        # an expert the pool let go since the last pass is no miss: it is paged out now, without grace
        fresh = missing & ~self._was_missing & ~self._was_tracked
        self._was_missing, self._was_tracked = missing, tracked
        return fresh

    def _flags(self, experts: set[tuple[int, int]]) -> np.ndarray:
        flags = np.zeros(len(self._layout.experts), dtype=bool)
        for x in experts:
            flags[self._ids[x]] = True
        return flags

    def _by_layer(self, flags: np.ndarray) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for gid in np.flatnonzero(flags):
            layer, e = self._layout.experts[gid]
            out.setdefault(layer, []).append(e)
        return out

    def _grace(self, fresh: np.ndarray, resident_bytes: int) -> np.ndarray:
        """The new misses kept one more pass, or none. Kept only when the model stays within the budget with
        them read whole and as many bytes again arriving before the next pass (the engine reads at the rate
        it just did): a prefill's burst (every expert of each layer, 311 MB a layer on ds-v2-lite) then
        leaves at once. Granting grace while the model was merely within the budget let it reach
        0.08-0.26 GiB over at 50% (docs/ram-tier.md)."""
        arriving = 2 * int(self._layout.expert_bytes[fresh].sum())
        if resident_bytes + arriving <= self.plan.budget_bytes:
            return fresh
        return np.zeros_like(fresh)

    def _runs_to_move(
        self, resident: list[np.ndarray], held: np.ndarray, fresh: np.ndarray
    ) -> tuple[list[PageRun], list[PageRun]]:
        """(page out, read ahead). Out: expert pages the pool does not hold, except the new misses, which
        llama is likely still reading (its matmul goes through gate, up and down of the layer's experts):
        they go at the next pass if the policy did not take them. In: what the pool holds that the kernel
        evicted, and the rest of every new miss (one large read instead of llama's 128 KiB faults)."""
        out: list[PageRun] = []
        into: list[PageRun] = []
        for f, (owner, res) in enumerate(zip(self._layout.owners, resident, strict=True)):
            expert = owner >= 0
            is_held = np.zeros(len(owner), dtype=bool)
            is_held[expert] = held[owner[expert]]
            is_fresh = np.zeros(len(owner), dtype=bool)
            is_fresh[expert] = fresh[owner[expert]]
            wanted = is_held | is_fresh
            if self.lock_mode != "mlock":  # unlocked non-expert pages the kernel took come back too
                wanted |= owner == _NON_EXPERT
            out += [(f, a, b) for a, b in page_runs(res & expert & ~is_held & ~is_fresh)]
            into += [(f, a, b) for a, b in page_runs(~res & wanted)]
        return out, into

    def _page_out(self, runs: list[PageRun]) -> int:
        ranges = [(f, a * PAGE, (b - a + 1) * PAGE) for f, a, b in runs]
        done = 0
        for pid, pager in list(self._pagers.items()) if ranges else []:
            try:
                done += pager.page_out(ranges)
            except OSError as e:
                self._say(
                    f"cannot page out llama's mapping (pid {pid}): {e.strerror}; the experts llama touched stay "
                    "resident until the kernel reclaims them (needs root or CAP_SYS_NICE + ptrace access, and in a "
                    "container llama's PID namespace: pid: service:llama)"
                )
                pager.close()
                del self._pagers[pid]
                self._refused.add(pid)
        return done

    def _llama_faults(self) -> int:
        """Major page faults of the processes mapping the model (/proc/PID/stat field 12), summed."""
        total = 0
        for pid in self._pagers:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            total += int(stat.rsplit(")", 1)[1].split()[9])  # fields after the command name start at 3
        return total

    def _refresh_pagers(self, now: float) -> None:
        """Find the processes mapping the model file every rescan_s, and drop the ones that exited."""
        for pid, pager in list(self._pagers.items()):
            if not pager.alive():
                pager.close()
                del self._pagers[pid]
        if now < self._next_scan:
            return
        self._next_scan = now + self.rescan_s
        found = find_mappers(list(self.index.files))
        for pid, maps in found.items():
            if pid in self._refused:
                continue
            if pid in self._pagers:
                self._pagers[pid].mappings = maps
                continue
            try:
                self._pagers[pid] = ProcessPager(pid, maps)
            except OSError as e:
                self._say(f"cannot reach llama's process {pid} ({e.strerror}); its mapped pages stay resident")

    def _count(self, resident_bytes: int, paged: int, seconds: float) -> None:
        c = self._counters
        c.sweeps += 1
        c.paged_out_bytes += paged
        c.sweep_seconds += seconds
        c.max_resident_bytes = max(c.max_resident_bytes, resident_bytes)
        if resident_bytes > self.plan.budget_bytes:
            c.over_budget_sweeps += 1

    # -- reporting -----------------------------------------------------------------------------------

    def stats(self) -> RamTierStats:
        pages = self.pool.pages
        with self.pool.mutex:
            resident = [pages.resident_map(f) for f in range(len(self._layout.owners))]
        pairs = list(zip(resident, self._layout.owners, strict=True))
        non_expert = sum(int((r & (o == _NON_EXPERT)).sum()) for r, o in pairs)
        expert = sum(int((r & (o != _NON_EXPERT)).sum()) for r, o in pairs)
        c = self._counters
        return RamTierStats(
            budget_bytes=self.plan.budget_bytes,
            non_expert_bytes=self.plan.non_expert_bytes,
            kept_bytes=self.plan.kept_bytes,
            expert_bytes=self.plan.expert_bytes,
            expert_budget_bytes=self.plan.expert_budget_bytes,
            headroom_bytes=self.plan.headroom_bytes,
            pool_bytes=self.plan.pool_bytes,
            resident_expert_bytes=expert * PAGE,
            resident_non_expert_bytes=non_expert * PAGE,
            max_resident_bytes=c.max_resident_bytes,
            over_budget_sweeps=c.over_budget_sweeps,
            paged_out_bytes_total=c.paged_out_bytes,
            misses_seen_total=c.misses_seen,
            sweeps=c.sweeps,
            mean_sweep_ms=1000 * c.sweep_seconds / c.sweeps if c.sweeps else 0.0,
            llama_pids=sorted(self._pagers),
            lock_mode=self.lock_mode,
            problem=self.problem,
            generation=self.generation,
        )

    def close(self) -> None:
        with self.pool.mutex:
            for span in self._locked:
                self.pool.pages.unlock(span)
            self._locked = []
            self.pool.pages.keep(self._layout.non_expert_runs, keep=False)
            self.pool.pages.page_out_elsewhere = None
        for pager in self._pagers.values():
            pager.close()
        self._pagers.clear()


def ram_tier_replicas_problem(ram_budget: object, llama_replicas: int) -> str | None:
    """The RAM tier with more than one llama replica on a host: refused in one line (every launcher says the
    same). The replicas map one model file, whose pages the host's page cache holds once: a tier beside each
    would page out the experts the other keeps, and one tier sees only its own llama's routing."""
    if ram_budget is None or llama_replicas <= 1:
        return None
    return (
        f"MOE_L2_RAM_BUDGET with {llama_replicas} llama replicas: replicas on one host share the model file's "
        "page cache, which one RAM tier must manage alone (two page out each other's experts): run one llama "
        "replica with the tier (MOE_L2_LLAMA_REPLICAS=1), or one per host (docs/ram-tier.md)"
    )
