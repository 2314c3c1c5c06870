"""The expert pool on a real file: mlock, mincore, eviction and the budget, checked against the kernel
(/proc/self/status VmLck and mincore), and the degraded prefetch-only mode without CAP_IPC_LOCK."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_l2_cache.pages import PAGE
from moe_l2_cache.residency import ExpertPool
from moe_l2_gguf.index import ExpertIndex, load_index

from .conftest import WITHOUT_IPC_LOCK, drop_page_cache


def vm_locked() -> int:
    """Bytes this process has locked, as the kernel counts them."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmLck:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


def pages_of(index: ExpertIndex, layer: int, expert: int) -> set[int]:
    out = set()
    for r in index.expert_ranges(layer, expert):
        out |= set(range(r.offset // PAGE, (r.offset + r.length - 1) // PAGE + 1))
    return out


@pytest.fixture
def index(demo_model: Path, tmp_path: Path) -> ExpertIndex:
    # a private copy: a llama-server of another test maps the demo model, and pages it maps stay resident
    private = tmp_path / "model.gguf"
    shutil.copyfile(demo_model, private)
    drop_page_cache(private)
    return load_index(private)


def test_pinning_locks_and_makes_resident_within_the_budget(index: ExpertIndex) -> None:
    size = index.max_expert_bytes
    pool = ExpertPool(index, budget_bytes=5 * len(index.layers) * size)
    try:
        # the default without transition tables (the pool learns none) is the hybrid, and says so
        assert pool.capacity_per_layer == 5 and pool.policy_name == "hybrid"
        base = vm_locked()
        hot = {layer: list(range(8)) for layer in index.layers}  # 8 per layer: more than the budget holds
        result = pool.pin("math", hot)
        held = pool.holds()
        assert result.pinned == 5 * len(index.layers) and result.dropped == 3 * len(index.layers)
        # the most useful (first) experts of each layer are the ones kept
        assert held["pinned"] == {(layer, e) for layer in index.layers for e in range(5)}
        assert held["locked"] == held["pinned"]

        stats = pool.stats()
        assert stats.tracked_bytes <= stats.budget_bytes and stats.pinned_bytes <= stats.budget_bytes
        resident, total = pool.resident_bytes(held["pinned"])
        assert resident == total == stats.pinned_bytes == stats.locked_bytes
        pages = set().union(*(pages_of(index, layer, e) for layer, e in held["pinned"]))
        assert vm_locked() - base == len(pages) * PAGE

        # every later admission keeps the pool within the budget
        pool.prefetch({layer: list(range(8, 20)) for layer in index.layers})
        pool.observe({layer: {e: float(e) for e in range(20, 32)} for layer in index.layers})
        assert pool.stats().tracked_bytes <= pool.budget_bytes
    finally:
        pool.close()


def test_eviction_unlocks_and_drops_pages(index: ExpertIndex) -> None:
    pool = ExpertPool(index, budget_bytes=6 * len(index.layers) * index.max_expert_bytes)
    try:
        base = vm_locked()
        pool.pin("math", {layer: [0, 1, 2] for layer in index.layers})
        held = pool.holds()["locked"]
        assert vm_locked() > base
        released = pool.evict_all()
        assert released == len(held) * index.max_expert_bytes
        assert vm_locked() == base
        assert pool.holds() == {"tracked": set(), "pinned": set(), "locked": set()}
        resident, _ = pool.resident_bytes(held)
        assert resident == 0  # nobody else maps the file: DONTNEED dropped the pages
        assert pool.stats().evicted_bytes_total == released
    finally:
        pool.close()


def test_unlocking_one_expert_keeps_a_shared_page_of_its_neighbour_locked(index: ExpertIndex) -> None:
    # adjacent experts of a tensor share a page when their slices are not page-aligned
    layer = index.moe_layers[0]
    a, b = next(
        (e, e + 1) for e in range(index.n_expert - 1) if pages_of(index, layer, e) & pages_of(index, layer, e + 1)
    )
    # one expert per layer, least recently used out
    pool = ExpertPool(index, budget_bytes=1 * len(index.layers) * index.max_expert_bytes, policy="lru")
    try:
        base = vm_locked()
        pool.pin("x", {layer: [b]})
        pool.pin("x", {layer: [a, b]})  # a becomes the most recent: the policy keeps a, evicts b
        assert pool.holds()["locked"] == {(layer, a)}
        assert vm_locked() - base == len(pages_of(index, layer, a)) * PAGE
        # a's pages (the one it shares with b included) are all still locked and resident
        resident, total = pool.resident_bytes([(layer, a)])
        assert resident == total
        pool.evict_all()
        assert vm_locked() == base
    finally:
        pool.close()


_DEGRADED = (
    WITHOUT_IPC_LOCK
    + r"""
import json, logging, sys
from moe_l2_gguf.index import load_index
from moe_l2_cache.residency import ExpertPool


warnings = []
class Catch(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("moe_l2_cache.residency").addHandler(Catch())

index = load_index(sys.argv[1])
pool = ExpertPool(index, budget_bytes=20 * len(index.layers) * index.max_expert_bytes)
first = pool.pin("math", {layer: list(range(10)) for layer in index.layers})
after_first = pool.stats()
second = pool.pin("code", {layer: list(range(10, 20)) for layer in index.layers})
stats = pool.stats()
print(json.dumps({"first": first.lock_mode, "second": second.lock_mode, "warnings": warnings,
                  "after_first": after_first.model_dump(), "stats": stats.model_dump()}))
"""
)


def test_low_memlock_limit_degrades_to_prefetch_only_and_says_so_once(demo_model: Path) -> None:
    run = subprocess.run([sys.executable, "-c", _DEGRADED, str(demo_model)], capture_output=True, text=True)
    if run.returncode != 0 and "capset" in run.stderr:
        pytest.skip("cannot drop CAP_IPC_LOCK here")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    first, stats = out["after_first"], out["stats"]
    assert out["first"] == out["second"] == "prefetch-only"
    assert stats["lock_mode"] == "prefetch-only"
    assert stats["memlock_limit_bytes"] == 65536
    # it locked what the limit allowed, and says how much
    assert 0 < first["locked_bytes"] <= 65536
    assert f"RLIMIT_MEMLOCK is 65536 bytes: locked {first['locked_bytes']} of" in stats["lock_problem"]
    assert stats["locked_bytes"] == 0  # the second hot set replaced the first, and nothing new is locked
    assert len(out["warnings"]) == 1, out["warnings"]  # said once, not once per expert or per pin
    assert stats["pinned_experts"] == 10 * 8  # the hot set is still held, prefetched instead of locked
    assert stats["lock_failures"] == 1


def test_bad_policy_name_is_a_clear_error(index: ExpertIndex) -> None:
    from moe_l2_cache.residency import PoolError

    with pytest.raises(PoolError, match="MOE_L2_CACHE_POLICY"):
        ExpertPool(index, budget_bytes=1 << 20, policy="no-such-policy")


def test_pool_is_thread_safe(index: ExpertIndex) -> None:
    import threading

    pool = ExpertPool(index, budget_bytes=6 * len(index.layers) * index.max_expert_bytes)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(20):
                experts = [(seed * 7 + i * 3 + j) % index.n_expert for j in range(6)]
                pool.pin(f"d{seed}", {layer: experts for layer in index.layers})
                pool.stats()
        except BaseException as e:  # any failure in a thread fails the test
            errors.append(e)

    base = vm_locked()
    try:
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        held = pool.holds()
        assert pool.stats().tracked_bytes <= pool.budget_bytes
        pages = set().union(*(pages_of(index, layer, e) for layer, e in held["locked"])) if held["locked"] else set()
        assert vm_locked() - base == len(pages) * PAGE  # no page left locked by a lost update
    finally:
        pool.close()
    assert vm_locked() == base
