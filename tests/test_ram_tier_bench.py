"""bench/balloon.py on its own (small sizes, so CI is safe) and a smoke run of bench/ram_tier.py on the
demo model: the plumbing of issue 17's benchmark, not its figures (those need a real-shape model)."""

from __future__ import annotations

import json
import mmap
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.benches import load_bench

balloon = load_bench("balloon")
BALLOON = Path(balloon.__file__)
MIB = 1 << 20


def start_balloon(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(BALLOON), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def next_event(proc: subprocess.Popen[str], timeout_s: float = 30) -> dict:
    """The balloon's next JSON line (it flushes each one), or a failure after `timeout_s`."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"no event from the balloon within {timeout_s}s"
    line = proc.stdout.readline()
    assert line, f"balloon exited ({proc.wait()}): {proc.stderr.read() if proc.stderr else ''}"
    return json.loads(line)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


def test_plan_refuses_what_would_cross_the_margin() -> None:
    gib = 1 << 30
    assert balloon.plan(10 * gib, gib, None, gib) == (gib, None)
    size, why = balloon.plan(2 * gib, int(1.5 * gib), None, gib)
    assert size == 0 and "margin" in why
    assert balloon.plan(10 * gib, None, 4 * gib, gib) == (6 * gib, None)  # leave 4: hold the other 6
    assert "cannot run at that budget" in balloon.plan(3 * gib, None, 4 * gib, gib)[1]
    assert "below the margin" in balloon.plan(10 * gib, None, gib // 2, gib)[1]


def test_it_refuses_with_one_line_when_the_machine_cannot_leave_that_much() -> None:
    avail = balloon.mem_available()
    result = subprocess.run(
        [sys.executable, str(BALLOON), "--leave-mib", str(avail // MIB + 4096), "--margin-mib", "64"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == balloon.EXIT_REFUSED
    assert result.stderr.strip().count("\n") == 0 and "cannot run at that budget" in result.stderr


def rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def test_it_holds_the_memory_it_says() -> None:
    # the balloon's own resident anonymous memory is exact; MemAvailable is the whole machine's, which
    # other processes move by a few hundred MiB at times (CI saw drops of 158, 130 and -23 MiB for a
    # 256 MiB balloon), so the balloon is large against that noise and the best of three tries counts
    size = 1024 * MIB
    drops = []
    for _ in range(3):
        before = balloon.mem_available()
        proc = start_balloon("--size-mib", str(size // MIB), "--margin-mib", "128", "--max-s", "60")
        try:
            ready = next_event(proc)
            assert ready["event"] == "ready" and ready["held_bytes"] == size
            assert ready["oom_score_adj"] == 1000
            assert Path(f"/proc/{proc.pid}/oom_score_adj").read_text().strip() == "1000"
            assert rss_anon(proc.pid) >= size
            time.sleep(1.5)  # the kernel folds its per-CPU counters into MemAvailable about once a second
            drops.append(before - balloon.mem_available())
        finally:
            stop(proc)
        assert next_event(proc)["event"] == "exit"
        if size // 2 < drops[-1] < 2 * size:
            break
    assert any(size // 2 < d < 2 * size for d in drops), [d / MIB for d in drops]


def test_it_gives_memory_back_when_the_margin_is_crossed() -> None:
    avail = balloon.mem_available()
    margin_mib = avail // MIB - 400  # the balloon's 192 MiB fit above it
    proc = start_balloon("--size-mib", "192", "--margin-mib", str(margin_mib), "--chunk-mib", "32", "--max-s", "60")
    ours: list[mmap.mmap] = []
    try:
        assert next_event(proc)["event"] == "ready"
        # ours, 64 MiB at a time, until MemAvailable is under the margin (other processes move it too)
        ready: list = []
        while not ready and len(ours) < 24:
            chunk = mmap.mmap(-1, 64 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            for off in range(0, len(chunk), mmap.PAGESIZE):
                chunk[off] = 1  # touched: real memory
            ours.append(chunk)
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        freed = next_event(proc, timeout_s=10)
        assert freed["event"] == "freed" and freed["freed_bytes"] >= 32 * MIB, freed
        assert freed["held_bytes"] < 192 * MIB
        assert freed["mem_available_was"] < margin_mib * MIB
    finally:
        for chunk in ours:
            chunk.close()
        stop(proc)


def test_it_exits_when_its_parent_dies(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            f"subprocess.Popen([sys.executable, {str(BALLOON)!r}, '--size-mib', '32', '--margin-mib', '0',"
            f" '--max-s', '120'], stdout=open({str(events)!r}, 'w'))\n"
            "time.sleep(120)\n",
        ]
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and '"ready"' not in (events.read_text() if events.exists() else ""):
            time.sleep(0.1)
        pid = json.loads(events.read_text().splitlines()[0])["pid"]
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            if "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]:
                break  # exited; only its reaping (by init) is left
            time.sleep(0.1)
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[-1]
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


# -- the benchmark -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ram_tier():
    return load_bench("ram_tier")


def test_budgets_are_checked(ram_tier, capsys) -> None:
    assert ram_tier.main(["--budgets", "0,150", "--model", "/nonexistent.gguf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --budgets")


def test_ratios() -> None:
    results = load_bench("ram_tier_results")
    assert results.ratio(3.0, 2.0) == 1.5
    assert results.ratio(0.0, 0.0) == 1.0  # neither faulted: no difference
    assert results.ratio(1.0, 0.0) is None and results.ratio(None, 1.0) is None


def test_configs_always_hold_stock_and_moe_l2_in_a_fixed_order(ram_tier, capsys) -> None:
    assert ram_tier.parse_args([]).configs == ("stock", "moe-l2")
    assert ram_tier.parse_args(["--configs", "moe-l2,willneed"]).configs == ("stock", "willneed", "moe-l2")
    with pytest.raises(SystemExit):
        ram_tier.parse_args(["--configs", "stock,fast"])
    assert "unknown fast" in capsys.readouterr().err


@pytest.mark.llama
def test_smoke_run_on_the_demo_model(ram_tier, llama_binary: Path, demo_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "ram_tier.json"
    argv = ["--model", str(demo_model), "--binary", str(llama_binary), "--no-balloon", "--budgets", "50"]
    argv += ["--rounds", "1", "--requests", "1", "--tokens", "4", "--out", str(out)]
    started = time.monotonic()
    assert ram_tier.main(argv) == 0
    assert time.monotonic() - started < 120
    report = json.loads(out.read_text())
    assert {"machine", "model", "settings", "routing", "budgets", "runs"} <= set(report)
    assert {"mem_total_bytes", "cpu_count", "kernel"} <= set(report["machine"])
    assert report["model"]["expert_bytes"] + report["model"]["non_expert_bytes"] == report["model"]["file_bytes"]
    b = report["budgets"]["50"]
    assert b["budget_bytes"] == report["model"]["kept_bytes"] + report["model"]["expert_bytes"] // 2
    assert report["model"]["kept_bytes"] >= report["model"]["non_expert_bytes"]
    assert b["greedy_identical"] is True
    for name, value in b["ratios_moe_l2_vs_stock"].items():
        # x / 0 has no ratio: the demo model stays in the page cache, so stock may read nothing at all
        assert isinstance(value, float) or b["configs"]["stock"][name] == 0, (name, value)
    for config in ("stock", "moe-l2"):
        c = b["configs"][config]
        assert c["requests"] == 1 and c["decode_tokens_per_s"] > 0
        assert c["max_model_resident_bytes"] > 0 and c["residency_samples"] >= 1
        assert isinstance(c["resident_within_budget"], bool)
    moe = next(r for r in report["runs"] if r["config"] == "moe-l2")
    assert moe["samples"][0]["hint_status"] == 200
    # the cache-manager's ram_tier stats, or why there are none
    assert moe["ram_tier"] is not None or moe["cache_stats_problem"]
