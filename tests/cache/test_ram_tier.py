"""The RAM tier (MOE_L2_RAM_BUDGET) against the kernel: a real file of a real model's shape, another
process mapping it as llama does, residency read back with mincore and /proc/PID/status, and the
real cache-manager process for the refusal and a replaced model file."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from moe_l2_cache.pages import PAGE
from moe_l2_cache.ram_tier import RamTier, RamTierError, page_owners, plan_ram, ram_tier_replicas_problem
from moe_l2_cache.residency import ExpertPool
from moe_l2_gguf.index import ExpertIndex, load_index
from moe_l2_gguf.model_shapes import SHAPES, write_shape_model

from .conftest import WITHOUT_IPC_LOCK, CacheManager, RedisServer, drop_page_cache

MIB = 1 << 20


@pytest.fixture(scope="module")
def shape_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V2-Lite's shape, its dense layer and one MoE layer: 64 experts of 4.9 MB, 0.45 GB in all."""
    path = tmp_path_factory.mktemp("ram-tier") / "ds2.gguf"
    write_shape_model(path, SHAPES["ds-v2-lite"].reduced(n_layer=2, n_vocab=8192), seed=0)
    return path


@pytest.fixture
def model(shape_model: Path, tmp_path: Path) -> Path:
    private = tmp_path / "model.gguf"  # each test its own inode: nothing another test mapped stays resident
    shutil.copyfile(shape_model, private)
    drop_page_cache(private)
    return private


_TOUCHER = r"""
import mmap, sys
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
print("ready", flush=True)
for line in sys.stdin:
    off, length = map(int, line.split())
    s = 0
    for i in range(off - off % 4096, min(off + length, len(m)), 4096):
        s += m[i]
    print("ok", flush=True)
"""


class Toucher:
    """Another process mapping the model and reading ranges on request: llama's page faults, in miniature."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _TOUCHER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def touch(self, offset: int, length: int) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{offset} {length}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def touch_expert(self, index: ExpertIndex, layer: int, expert: int) -> None:
        for r in index.expert_ranges(layer, expert):
            self.touch(r.offset, r.length)

    def rss_file(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"RssFile:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def toucher(model: Path) -> Iterator[Toucher]:
    t = Toucher(model)
    yield t
    t.close()


def test_budget_below_the_non_expert_tensors_is_refused_with_both_figures(model: Path) -> None:
    index = load_index(model)
    non_expert = sum(index.file_sizes) - index.routed_bytes
    with pytest.raises(RamTierError, match=r"non-expert tensors take .* give at least") as e:
        plan_ram(index, non_expert - MIB)
    assert str(non_expert) in str(e.value)
    # enough for the non-expert tensors but not one expert per layer: refused too
    with pytest.raises(RamTierError):
        plan_ram(index, non_expert + index.max_expert_bytes // 2)
    plan = plan_ram(index, non_expert + 8 * index.max_expert_bytes)
    assert plan.pool_bytes + plan.headroom_bytes + plan.kept_bytes == plan.budget_bytes
    # the budget counts pages: those with a non-expert byte and those two experts share are always kept
    owners = page_owners(index)
    assert plan.kept_bytes == sum(int((o < 0).sum()) for o in owners) * PAGE >= plan.non_expert_bytes
    assert plan.pool_bytes >= index.max_expert_bytes


def test_the_default_headroom_holds_a_token_and_a_prefill_layer_of_misses(model: Path) -> None:
    index = load_index(model)
    non_expert = sum(index.file_sizes) - index.routed_bytes
    per_layer = sum(index.expert_bytes(layer) for layer in index.layers)  # one expert of every layer
    widest = max(index.expert_bytes(layer) for layer in index.layers) * index.n_expert
    want = index.n_expert_used * per_layer + widest
    roomy = plan_ram(index, non_expert + 4 * want)
    assert roomy.headroom_bytes == want
    # a tight budget: the headroom leaves the pool two thirds of the expert budget
    tight = plan_ram(index, non_expert + want)
    assert tight.headroom_bytes == tight.expert_budget_bytes // 3
    assert tight.pool_bytes >= 2 * tight.expert_budget_bytes // 3


def test_the_service_refuses_a_budget_too_small_in_one_line(model: Path) -> None:
    env = {**os.environ, "MOE_L2_MODEL_PATH": str(model), "MOE_L2_RAM_BUDGET": "64MiB"}
    run = subprocess.run([sys.executable, "-m", "moe_l2_cache"], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr  # no traceback
    assert "MOE_L2_RAM_BUDGET is 0.06 GiB" in lines[0] and "give at least" in lines[0]


def test_the_service_refuses_the_tier_with_llama_replicas_in_one_line(model: Path) -> None:
    """compose's ram-tier override passes the replicas llama is scaled to: more than one is refused."""
    env = {**os.environ, "MOE_L2_MODEL_PATH": str(model), "MOE_L2_RAM_BUDGET": "6GiB", "MOE_L2_LLAMA_REPLICAS": "2"}
    run = subprocess.run([sys.executable, "-m", "moe_l2_cache"], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        "moe_l2_cache: MOE_L2_RAM_BUDGET with 2 llama replicas: replicas on one host share the model file's page "
        "cache, which one RAM tier must manage alone (two page out each other's experts): run one llama replica "
        "with the tier (MOE_L2_LLAMA_REPLICAS=1), or one per host (docs/ram-tier.md)"
    ]
    assert ram_tier_replicas_problem(None, 4) is None and ram_tier_replicas_problem(6 << 30, 1) is None


def _tier(model: Path, experts_held: int, lock: bool = True, headroom_experts: int = 2) -> RamTier:
    index = load_index(model)
    non_expert = sum(index.file_sizes) - index.routed_bytes
    per_layer = sum(index.expert_bytes(layer) for layer in index.layers)
    plan = plan_ram(index, non_expert + experts_held * per_layer, headroom_bytes=headroom_experts * per_layer)
    pool = ExpertPool(index, plan.pool_bytes, lock=lock)
    return RamTier(index, pool, plan, lock=lock)


def test_sweep_pages_out_of_the_other_process_what_the_pool_does_not_hold(model: Path, toucher: Toucher) -> None:
    tier = _tier(model, experts_held=16)
    try:
        index = tier.index
        toucher.touch(0, sum(index.file_sizes))  # llama's load reads the whole file
        before = tier.stats()
        assert before.resident_expert_bytes > 0.95 * index.routed_bytes
        mapped_before = toucher.rss_file()
        for _ in range(3):
            tier.sweep()
        after = tier.stats()
        assert after.llama_pids == [toucher.proc.pid]
        held = tier.pool.tracked()
        assert 0 < len(held) <= 16 - 2  # the pool's share: the budget less the headroom
        held_resident, held_total = tier.pool.resident_bytes(held)
        assert held_resident == held_total  # what the pool holds stays
        # what it does not hold left the page cache, and the other process's mapping
        assert after.resident_expert_bytes <= held_total + 16 * PAGE * 3 + 4 * MIB  # slice-edge pages, folio ends
        assert after.resident_non_expert_bytes >= tier.plan.non_expert_bytes  # locked, never paged out
        assert after.resident_expert_bytes + after.resident_non_expert_bytes <= tier.plan.budget_bytes
        assert toucher.rss_file() < mapped_before - 0.5 * index.routed_bytes
        assert after.paged_out_bytes_total > 0.5 * index.routed_bytes
        assert after.max_resident_bytes >= before.resident_expert_bytes  # the peak is the one before paging out
        assert after.over_budget_sweeps >= 1
    finally:
        tier.close()
        tier.pool.close()


def test_a_quick_pass_on_one_page_per_expert_pages_out_what_the_pool_does_not_hold(
    model: Path, toucher: Toucher
) -> None:
    """The loop's passes between full ones probe one page per expert (~20 ms where the full mincore over a
    9.5 GB file takes ~200 ms), and are skipped while llama reads nothing."""
    tier = _tier(model, experts_held=16)
    try:
        index = tier.index
        toucher.touch(0, sum(index.file_sizes))  # every expert resident, in the other process's mapping
        mapped_before = toucher.rss_file()
        assert tier.quick_sweep() > 0.5 * index.routed_bytes
        stats = tier.stats()
        held = tier.pool.tracked()
        assert 0 < len(held) <= 16 - 2
        assert stats.resident_expert_bytes <= tier.pool.resident_bytes(held)[1] + 16 * PAGE * 3 + 4 * MIB
        assert stats.resident_non_expert_bytes >= tier.plan.non_expert_bytes
        assert toucher.rss_file() < mapped_before - 0.5 * index.routed_bytes
        assert stats.misses_seen_total >= len(held)
        tier.quick_sweep()  # the pass after new misses runs anyway: it decides the ones given grace
        # nothing read since: no pass
        sweeps = tier.stats().sweeps
        assert tier.quick_sweep() == 0 and tier.stats().sweeps == sweeps
        # llama reads a cold expert again: the next quick pass sees it
        layer = index.moe_layers[0]
        cold = next(e for e in range(index.n_expert) if (layer, e) not in tier.pool.tracked())
        drop_page_cache(model)  # what nobody maps: the toucher's next touch reads from storage
        toucher.touch_expert(index, layer, cold)
        tier.quick_sweep()
        assert tier.stats().sweeps == sweeps + 1
        assert tier.stats().misses_seen_total > stats.misses_seen_total
    finally:
        tier.close()
        tier.pool.close()


def test_the_loop_takes_a_full_pass_at_least_once_a_second(model: Path) -> None:
    tier = _tier(model, experts_held=16)
    try:
        full, quick = [], []
        tier.sweep, tier.quick_sweep = (lambda: full.append(1) or 0), (lambda: quick.append(1) or 0)  # type: ignore[method-assign]
        tier._last_full = time.monotonic()
        tier.step()
        assert (len(full), len(quick)) == (0, 1)
        tier._last_full -= 1.0
        tier.step()
        assert (len(full), len(quick)) == (1, 1)
    finally:
        tier.close()
        tier.pool.close()


def test_over_the_budget_new_misses_get_no_grace(model: Path, toucher: Toucher) -> None:
    tier = _tier(model, experts_held=16)
    try:
        tier.sweep()
        layer = tier.index.moe_layers[0]
        cold = [e for e in range(tier.index.n_expert) if (layer, e) not in tier.pool.tracked()]
        toucher.touch_expert(tier.index, layer, cold[0])  # within the budget: kept one more pass
        tier._faults = -1
        tier.sweep()
        assert tier.pool.resident_bytes([(layer, cold[0])])[0] > 0 or (layer, cold[0]) in tier.pool.tracked()
        toucher.touch(0, sum(tier.index.file_sizes))  # far over the budget: one pass brings it back under
        tier._faults = -1
        tier.sweep()
        stats = tier.stats()
        assert stats.max_resident_bytes > stats.budget_bytes
        assert stats.resident_expert_bytes + stats.resident_non_expert_bytes <= stats.budget_bytes
    finally:
        tier.close()
        tier.pool.close()


def test_a_burst_of_misses_gets_no_grace_even_within_the_budget(model: Path) -> None:
    """Grace (one more pass resident, read whole) only while the misses, and as many again arriving before
    the next pass, fit: a prefill reads every expert of a layer in a burst that outran the passes while
    they granted grace to whatever was within the budget (docs/ram-tier.md)."""
    tier = _tier(model, experts_held=24, headroom_experts=8)
    try:
        n = len(tier._layout.experts)
        one = int(tier._layout.expert_bytes.max())
        held_16 = tier.plan.non_expert_bytes + 16 * one  # the pool's share resident

        def misses(k: int) -> np.ndarray:
            fresh = np.zeros(n, dtype=bool)
            fresh[:k] = True
            return fresh

        # counted as resident (their first pages at least), then read whole, then as many again arriving
        assert tier._grace(misses(1), held_16 + one).sum() == 1  # 16 + 1 + 1 + 1 <= 24
        assert tier._grace(misses(2), held_16 + 2 * one).sum() == 2  # 16 + 2 + 2 + 2 = 22
        # 16 + 3 is within the budget, but not with the rest read and 3 more arriving (25): out at once
        assert held_16 + 3 * one <= tier.plan.budget_bytes
        assert tier._grace(misses(3), held_16 + 3 * one).sum() == 0
    finally:
        tier.close()
        tier.pool.close()


def test_misses_reach_the_policy_and_an_expert_used_again_and_again_is_kept(model: Path, toucher: Toucher) -> None:
    tier = _tier(model, experts_held=16)
    try:
        index = tier.index
        layer = index.moe_layers[0]
        tier.sweep()
        cold = next(e for e in range(index.n_expert) if (layer, e) not in tier.pool.tracked())
        kept = False
        for _ in range(6):  # llama uses it token after token
            toucher.touch_expert(index, layer, cold)
            tier._faults = -1  # the toucher's faults are minor after the first time: force the full pass
            tier.sweep()
            if (layer, cold) in tier.pool.tracked():
                kept = True
                break
        assert tier.stats().misses_seen_total >= 1
        assert kept, "the policy never admitted an expert that missed on every token"
        resident, total = tier.pool.resident_bytes([(layer, cold)])
        assert resident == total
    finally:
        tier.close()
        tier.pool.close()


def test_nothing_is_swept_while_llama_takes_no_fault(model: Path, toucher: Toucher) -> None:
    tier = _tier(model, experts_held=16)
    try:
        tier.sweep()
        tier.sweep()  # the misses of the first pass are decided at the second, faults or not
        first = tier.stats().sweeps
        for _ in range(5):
            tier.sweep()  # the toucher is idle: no major fault
        assert tier.stats().sweeps == first
        toucher.touch(0, sum(tier.index.file_sizes))  # faults: the next pass runs
        tier.sweep()
        assert tier.stats().sweeps == first + 1
    finally:
        tier.close()
        tier.pool.close()


_DEGRADED = (
    WITHOUT_IPC_LOCK
    + r"""
import json, logging, sys
from moe_l2_gguf.index import load_index
from moe_l2_cache.residency import ExpertPool
from moe_l2_cache.ram_tier import RamTier, plan_ram


warnings = []
class Catch(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("moe_l2_cache").addHandler(Catch())

index = load_index(sys.argv[1])
non_expert = sum(index.file_sizes) - index.routed_bytes
plan = plan_ram(index, non_expert + 16 * index.max_expert_bytes)
pool = ExpertPool(index, plan.pool_bytes)
tier = RamTier(index, pool, plan)
import time
deadline = time.monotonic() + 20
sweeps = 0
def short() -> bool:
    return tier.stats().resident_non_expert_bytes < 0.9 * plan.non_expert_bytes
while sweeps < 3 or (short() and time.monotonic() < deadline):
    tier._faults = -1
    tier.sweep()
    sweeps += 1
    time.sleep(0.1)
print(json.dumps({"stats": tier.stats().model_dump(), "warnings": warnings}))
"""
)


def test_memlock_limited_keeps_the_budget_by_prefetch_only_and_says_so_once(model: Path) -> None:
    run = subprocess.run([sys.executable, "-c", _DEGRADED, str(model)], capture_output=True, text=True, timeout=120)
    if run.returncode != 0 and "capset" in run.stderr:
        pytest.skip("cannot drop CAP_IPC_LOCK here")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    stats = out["stats"]
    assert stats["lock_mode"] == "prefetch-only"
    assert "cannot lock the non-expert tensors" in stats["problem"] and "RLIMIT_MEMLOCK" in stats["problem"]
    tier_warnings = [w for w in out["warnings"] if w.startswith("RAM tier")]
    assert len(tier_warnings) == 1, out["warnings"]
    assert stats["sweeps"] >= 3  # it still keeps the budget
    assert stats["resident_non_expert_bytes"] > 0.9 * stats["non_expert_bytes"]  # read ahead instead


# -- the service ------------------------------------------------------------------------------------


def _wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _tier_stats(manager: CacheManager) -> dict:
    return manager.stats()["ram_tier"]  # type: ignore[no-any-return]


def _start_tier(
    start_cache_manager: Callable[..., CacheManager], redis_server: RedisServer, model: Path, budget: int
) -> CacheManager:
    """The service with a RAM budget on `model`, no llama to pull from."""
    return start_cache_manager(
        MOE_L2_MODEL_PATH=str(model),
        MOE_L2_REDIS_URL=redis_server.url,
        MOE_L2_LLAMA_URL="http://127.0.0.1:9",
        MOE_L2_RAM_BUDGET=str(budget),
        MOE_L2_CACHE_PULL_INTERVAL_S="0",
    )


def _wait_within_budget(manager: CacheManager, toucher: Toucher, budget: int) -> None:
    """The tier finds the toucher's process and brings the model's residency within the budget itself."""
    _wait_for(lambda: toucher.proc.pid in _tier_stats(manager)["llama_pids"], 10, "the tier to find the process")
    _wait_for(
        lambda: (s := _tier_stats(manager))["resident_expert_bytes"] + s["resident_non_expert_bytes"] <= budget,
        15,
        "the residency to fall within the budget",
    )


def test_the_budget_holds_to_the_byte_on_the_demo_model_whose_slices_share_pages(
    redis_server: RedisServer, start_cache_manager: Callable[..., CacheManager], tmp_path: Path
) -> None:
    """The demo model's 8 KiB expert slices start off page boundaries: most of its expert pages are shared by
    two slices and never paged out, so its always-kept pages (6.16 MB) are twice its non-expert bytes (3.02
    MB). A budget counted in tensor bytes let the model stay 3% over it, idle (the compose test of
    2026-12-06: 6.35 MB for 6.16 MB). Counted in pages, the tier holds it: everything touched, then idle,
    the model's resident pages are within the budget, not the budget plus the misses' headroom."""
    from moe_l2_gguf.demo_model import make_demo_model

    demo = tmp_path / "demo.gguf"
    make_demo_model(demo, seed=0)
    index = load_index(demo)
    non_expert = sum(index.file_sizes) - index.routed_bytes
    with pytest.raises(RamTierError, match="give at least"):
        plan_ram(index, non_expert + index.routed_bytes // 2)  # the old budget: the kept pages alone fill it
    kept = sum(int((o < 0).sum()) for o in page_owners(index)) * PAGE
    assert kept > 2 * non_expert
    one_per_layer = sum(index.expert_bytes(layer) for layer in index.layers)
    budget = kept + 4 * one_per_layer  # tight: a pool sized by tensor bytes would take 3.1 MB more
    manager = _start_tier(start_cache_manager, redis_server, demo, budget)
    toucher = Toucher(demo)
    try:
        toucher.touch(0, sum(index.file_sizes))  # every page faulted in: the whole file resident
        _wait_within_budget(manager, toucher, budget)
        time.sleep(3)  # idle: full passes only, and the residency stays within it
        stats = _tier_stats(manager)
        assert stats["resident_expert_bytes"] + stats["resident_non_expert_bytes"] <= budget, stats
        assert stats["kept_bytes"] == kept and stats["expert_budget_bytes"] == budget - kept
    finally:
        toucher.close()


def test_service_keeps_the_budget_and_rebuilds_the_pool_when_the_model_file_is_replaced(
    model: Path,
    toucher: Toucher,
    redis_server: RedisServer,
    start_cache_manager: Callable[..., CacheManager],
    tmp_path: Path,
) -> None:
    index = load_index(model)
    non_expert = sum(index.file_sizes) - index.routed_bytes
    budget = non_expert + 24 * index.max_expert_bytes
    manager = _start_tier(start_cache_manager, redis_server, model, budget)
    stats = _tier_stats(manager)
    assert stats["budget_bytes"] == budget and stats["generation"] == 0
    assert manager.stats()["pool"]["budget_bytes"] == stats["pool_bytes"]  # the tier sets the pool's budget

    toucher.touch(0, sum(index.file_sizes))
    _wait_within_budget(manager, toucher, budget)
    metrics = manager.client.get("/metrics").text
    value = re.search(r"^moe_l2_cache_ram_budget_bytes (\S+)$", metrics, re.M)
    assert value is not None and float(value.group(1)) == budget
    assert 'moe_l2_cache_ram_resident_bytes{kind="expert"}' in metrics

    # replaced the way a download or a re-quantization replaces it: a new file renamed over the old one
    fresh = tmp_path / "model.gguf.new"
    shutil.copyfile(model, fresh)
    os.replace(fresh, model)
    # while it is rebuilt there is no tier for a moment (detached before closed)
    _wait_for(lambda: (_tier_stats(manager) or {}).get("generation") == 1, 15, "the pool to be rebuilt on the new file")
    assert manager.proc is not None and manager.proc.poll() is None
    stats = manager.stats()
    assert stats["pool"] is not None and stats["ram_tier"]["problem"] is None
    assert manager.client.post("/v1/hint", json={"domain": "math"}).status_code == 200
    log = manager.log.read_text()
    assert "rebuilding the expert pool on the new file" in log and "Traceback" not in log

    # another model in its place: the pool stops, says why, and the service stays up
    other = tmp_path / "other.gguf"
    write_shape_model(other, SHAPES["ds-v2-lite"].reduced(n_layer=3, n_vocab=8192), seed=1)
    os.replace(other, model)
    _wait_for(lambda: "now holds another model" in manager.stats()["reason"], 15, "the pool to stop on another model")
    assert manager.stats()["pool"] is None and manager.stats()["ram_tier"] is None
    assert manager.client.get("/healthz").status_code == 200
    with pytest.raises(httpx.HTTPStatusError):
        manager.client.get("/v1/nope").raise_for_status()
