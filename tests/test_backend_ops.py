"""Upstream's test-backend-ops on the scheduler's expert cache hook (patch 0035, docs/llama-fork.md).

test-backend-ops compares each op of a backend with the CPU's one node at a time, never through
ggml_backend_sched, so the hook of patch 0004 (ggml_backend_sched_set_expert_cache) is not on its path.
Patch 0035's `--expert-cache` puts it there: each MUL_MAT_ID case keeps its experts in a host buffer and
runs through a scheduler of [device, CPU] with a test cache installed (fewer slots than experts, slots
handed out from the last one down so that no mapping is the identity, LRU eviction, the missing experts
copied on the device), three batches of ids per case (misses, then hits and evictions), each compared
with the CPU under the case's own error bound; a batch with more experts than slots takes the other path
of the hook, the scheduler's full-size copy filled by the cache (slot_ids NULL). A case whose hook was
never asked fails. The CPU backend reads host experts itself and never asks the hook: there each case
runs in two halves of its ids, each with -1 for the other's pairs (patch 0005, what the cache's CPU-miss
split gives the CPU), and the halves must add up to the whole. `--expert-cache-broken-remap` plants a bug:
every slot id one slot off (on the CPU, the second half takes the first half's pairs).

The subset: CASES, 15 of the 945 MUL_MAT_ID cases. All 945 ran past 11 minutes on the CPU backend alone
before they were stopped (2026-12-06; one case holds 128 Q8_0 experts of 8192x5120, 5 GB), and the hook
does not change the kernels the other cases vary (it hands them other weights and other ids), so the
subset covers the hook's paths, on the expert types of the models the tests run:
- F16 (the demo model), Q4_0 and Q4_K (the reduced ds-v2-lite shape) with 2 of 8 experts per token, in
  batches of 1 row (decode: the slot path, 2 experts in 4 slots) and 32 and 129 rows (a prompt: more
  experts than slots, the full-size copy filled; 129 rows cross the matrix kernel's tiles);
- every token on all 4 of 4 experts in 4 slots (upstream's tile-boundary cases), 16 rows (the vector
  kernel) and 33 rows (the matrix kernel): remapped ids in a prompt-sized batch;
- experts strided by 64 rows of which 8 are used (upstream's `m_v` cases), F32 and F16: a slot is not a
  copy of the host stride.
Measured on this 2-core machine (2026-12-06): the CPU runs in about 2 s, llvmpipe in about 8 s. The same
cases run on the RPC device too (patch 0035's `--rpc`: the device `RPC0` of a ggml-rpc-server), the twins
of the llvmpipe ones (tests/ci_policy.py): where llvmpipe faults and those skip, the hook's paths still
run through a device's scheduler.

On llvmpipe every case runs in a process of its own. Measured (Mesa 22.3.6, LP_NUM_THREADS=1): with 11 of
these cases in one process, the scheduler's path crashed in lavapipe's queue thread in 5 runs of 8, and in
6 of 8 with the hook declining (the scheduler's own copy of the used experts, no cache involved), while
upstream's compare path on the same cases passed 14 of 14; valgrind shows lavapipe reading memory it had
freed with an LLVM module it destroyed in that thread, then calling through a null pointer, the crash
tests/llvmpipe_probe.py describes. One case per process: 45 of 45 passed, 0.5 s each.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from moe_l2_llama import build as build_mod
from moe_l2_llama.vulkan_env import device_env
from tests.conftest import ON_RPC_AND_LLVMPIPE, EngineDevice, RpcDevice


def _case(type_a: str, n_mats: int, n_used: int, m: int, n: int, k: int, m_v: int = 0) -> str:
    """A case's full name, as test-backend-ops prints it and as `-o` takes it (an exact match)."""
    return (
        f"MUL_MAT_ID(type_a={type_a},type_b=f32,n_mats={n_mats},n_used={n_used},b=0,m={m},n={n},k={k},"
        f"amax=1.000000,m_v={m_v})"
    )


# The cases whose three batches all take the slot path (their experts fit the slots: n_slots is the larger of
# the experts per token and half the experts) and those whose three all fill the full-size copy (32 or more
# rows of 2 of 8 experts use more than 4; 16 rows of 2 of 4 more than 2: each 1e-11 likely or less otherwise).
SLOT_CASES = (
    *(_case(t, 8, 2, 512, 1, 256) for t in ("f16", "q4_0", "q4_K")),
    *(_case(t, 4, 4, 512, n, 256) for t in ("f16", "q4_K") for n in (16, 33)),
    _case("f32", 4, 2, 8, 1, 64, m_v=64),
)
FILL_CASES = (
    *(_case(t, 8, 2, 512, n, 256) for t in ("f16", "q4_0", "q4_K") for n in (32, 129)),
    _case("f16", 4, 2, 8, 16, 64, m_v=64),
)
CASES = SLOT_CASES + FILL_CASES
# The expert types of the models people run, through the hook on the RPC device (issue 43): MXFP4 (gpt-oss),
# Q8_0, an IQ type (IQ2_XXS) with upstream's 2-of-8 cases, Q6_K and Q2_K (the K-quants of Q4_K_M and Q2_K
# models' experts) with its 2-of-4 cases, each a decode batch (slots) and a prompt batch (the full-size copy).
# Only on the RPC device: on a cold shader cache each new type costs llvmpipe its own pipelines' compile.
TYPE_SLOT_CASES = (
    *(_case(t, 8, 2, 512, 1, 256) for t in ("mxfp4", "q8_0", "iq2_xxs")),
    *(_case(t, 4, 2, 512, 1, 256) for t in ("q6_K", "q2_K")),
)
TYPE_FILL_CASES = (
    *(_case(t, 8, 2, 512, 32, 256) for t in ("mxfp4", "q8_0", "iq2_xxs")),
    *(_case(t, 4, 2, 512, 32, 256) for t in ("q6_K", "q2_K")),
)
BATCHES = 3  # batches of ids per case through one cache (patch 0035)
CASE_TIMEOUT_S = 600  # a case on a cold shader cache compiles its pipelines first (tests/llvmpipe_probe.py)

_SUMMARY_RE = re.compile(r"^\s*(\d+)/(\d+) tests passed$", re.MULTILINE)
_HOOK_RE = re.compile(
    r"expert cache: (?P<cases_sched>\d+) cases through the scheduler's hook, asked (?P<asked>\d+) times: "
    r"(?P<on_slots>\d+) on slots \((?P<copied>\d+) experts copied, (?P<evicted>\d+) evicted\), "
    r"(?P<filled>\d+) filled the full-size copy; (?P<cases_cpu>\d+) cases on the CPU in two halves"
)
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class CaseRun:
    """One case of test-backend-ops in its own process, as its output reports it."""

    case: str
    returncode: int
    run: int  # cases run, as test-backend-ops counts them (0 when it died before its summary)
    passed: int
    hook: dict[str, int]  # the counters of its `expert cache:` line, {} without one
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.run == self.passed == 1

    def describe(self) -> str:
        tail = "\n".join(self.output.strip().splitlines()[-6:])
        return f"{self.case}: exit {self.returncode}, {self.passed}/{self.run} passed, hook {self.hook}\n{tail}"


def parse_case_run(case: str, returncode: int, output: str) -> CaseRun:
    text = _ANSI_RE.sub("", output)
    summary = _SUMMARY_RE.search(text)
    hook = _HOOK_RE.search(text)
    return CaseRun(
        case=case,
        returncode=returncode,
        run=int(summary[2]) if summary else 0,
        passed=int(summary[1]) if summary else 0,
        hook={k: int(v) for k, v in hook.groupdict().items()} if hook else {},
        output=text,
    )


def backend_ops(server: Path) -> Path:
    """The test-backend-ops of the build `server` (a llama-server) comes from; a build without it fails here."""
    binary = build_mod.backend_ops_binary(server)
    if not binary.is_file():
        pytest.fail(f"no {binary.name} next to {server}: a test build has it (`moe-l2 build-llama`, test hooks on)")
    return binary


def run_cases(
    binary: Path,
    backend: str,
    cases: tuple[str, ...],
    *,
    broken: bool = False,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
) -> tuple[list[CaseRun], float]:
    """Each case in a process of its own (see the module's docstring), and the seconds they took."""
    flag = "--expert-cache-broken-remap" if broken else "--expert-cache"
    runs, started = [], time.monotonic()
    for case in cases:
        proc = subprocess.run(
            [str(binary), "test", "-b", backend, flag, *args, "-o", case],
            capture_output=True,
            text=True,
            errors="replace",
            env={**os.environ, **(env or {})},
            timeout=CASE_TIMEOUT_S,
        )
        runs.append(parse_case_run(case, proc.returncode, proc.stdout + proc.stderr))
    return runs, time.monotonic() - started


def total(runs: list[CaseRun], counter: str) -> int:
    return sum(r.hook.get(counter, 0) for r in runs)


def report(backend: str, runs: list[CaseRun], seconds: float) -> str:
    """One line of what ran, for the log (`-rP` / `-s`)."""
    passed = sum(r.ok for r in runs)
    counters = ", ".join(f"{k} {total(runs, k)}" for k in ("asked", "on_slots", "copied", "evicted", "filled"))
    return f"{backend}: {len(runs)} cases run, {passed} passed in {seconds:.1f} s; hook: {counters}"


@pytest.fixture(scope="module")
def cpu_backend_ops(llama_binary: Path) -> Path:
    return backend_ops(llama_binary)


@dataclass(frozen=True)
class DeviceOps:
    """test-backend-ops of a device's build, and how it reaches the device."""

    binary: Path
    backend: str  # -b: the device's name in ggml
    args: tuple[str, ...]
    env: dict[str, str]

    def run(self, cases: tuple[str, ...], *, broken: bool = False) -> tuple[list[CaseRun], float]:
        return run_cases(self.binary, self.backend, cases, broken=broken, env=self.env, args=self.args)


@pytest.fixture
def device_ops(device: EngineDevice) -> DeviceOps:
    """On llvmpipe: the environment that finds it (LP_NUM_THREADS=1 too). On the RPC device: patch 0035's
    --rpc, which adds the ggml-rpc-server's device as RPC0, as llama-server's --rpc does."""
    if isinstance(device, RpcDevice):
        return DeviceOps(backend_ops(device.binary), "RPC0", ("--rpc", device.endpoint), {})
    return DeviceOps(backend_ops(device.binary), device.device, (), device_env(device.binary))


def test_the_subset_is_what_the_docstring_says() -> None:
    assert len(CASES) == len(set(CASES)) == 15
    assert len(SLOT_CASES) == 8 and len(FILL_CASES) == 7


def test_a_case_that_dies_or_runs_nothing_is_not_ok() -> None:
    passed = "  \x1b[1;32mOK\x1b[0m\n  1/1 tests passed\n  expert cache: 1 cases through the scheduler's hook, "
    passed += "asked 3 times: 3 on slots (5 experts copied, 1 evicted), 0 filled the full-size copy; 0 cases on the "
    passed += "CPU in two halves of -1-masked ids\n"
    run = parse_case_run("c", 0, passed)
    assert run.ok and run.hook == {
        "cases_sched": 1,
        "asked": 3,
        "on_slots": 3,
        "copied": 5,
        "evicted": 1,
        "filled": 0,
        "cases_cpu": 0,
    }
    assert not parse_case_run("c", -11, "  MUL_MAT_ID(...): ").ok  # lavapipe's crash: no summary
    assert not parse_case_run("c", 0, "  0/0 tests passed\n").ok  # a case name that matches nothing
    assert not parse_case_run("c", 1, "  0/1 tests passed\n").ok


def test_mul_mat_id_on_the_cpu_in_halves_of_negative_ids(cpu_backend_ops: Path) -> None:
    """Every case passes on the CPU as two -1-masked halves; none goes through the hook (the CPU reads host
    experts itself)."""
    runs, seconds = run_cases(cpu_backend_ops, "CPU", CASES)
    print(report("CPU", runs, seconds))
    failed = [r.describe() for r in runs if not r.ok]
    assert not failed, "\n".join(failed)
    assert total(runs, "cases_cpu") == len(CASES) and total(runs, "asked") == 0


@pytest.mark.llama
@ON_RPC_AND_LLVMPIPE
def test_mul_mat_id_on_a_device_through_the_expert_cache(device_ops: DeviceOps) -> None:
    """Every case passes on the device (llvmpipe, or its twin the RPC device) with the hook asked for each
    of its three batches: the slot cases on slots every time, the others filling the full-size copy every
    time."""
    runs, seconds = device_ops.run(CASES)
    print(report(device_ops.backend, runs, seconds))
    failed = [r.describe() for r in runs if not r.ok]
    assert not failed, "\n".join(failed)
    for r in runs:
        path = "on_slots" if r.case in SLOT_CASES else "filled"
        assert r.hook["cases_sched"] == 1 and r.hook["asked"] == r.hook[path] == BATCHES, r.describe()
    # the slots start empty: the first batch of every slot case copies its experts to the device
    assert total(runs, "copied") >= sum(r.hook["on_slots"] > 0 for r in runs)


@pytest.mark.llama
def test_the_model_expert_types_through_the_expert_cache_on_the_rpc_device(rpc_device: RpcDevice) -> None:
    """MXFP4, Q8_0, IQ2_XXS, Q6_K and Q2_K experts through the hook: each decode case on slots and each prompt
    case filling the full-size copy, every batch within the case's error bound; with the slot ids one off, every
    decode case fails."""
    ops = DeviceOps(backend_ops(rpc_device.binary), "RPC0", ("--rpc", rpc_device.endpoint), {})
    runs, seconds = ops.run(TYPE_SLOT_CASES + TYPE_FILL_CASES)
    print(report("RPC0, expert types", runs, seconds))
    failed = [r.describe() for r in runs if not r.ok]
    assert not failed, "\n".join(failed)
    for r in runs:
        path = "on_slots" if r.case in TYPE_SLOT_CASES else "filled"
        assert r.hook["cases_sched"] == 1 and r.hook["asked"] == r.hook[path] == BATCHES, r.describe()
    broken, _ = ops.run(TYPE_SLOT_CASES, broken=True)
    assert [r.case for r in broken if not r.ok] == list(TYPE_SLOT_CASES), "\n".join(r.describe() for r in broken)


@pytest.mark.llama
@ON_RPC_AND_LLVMPIPE
def test_a_broken_slot_remap_fails_on_a_device(device_ops: DeviceOps) -> None:
    """With every slot id one slot off, exactly the cases that compute on slots fail, each on its first
    batch, by far more than their error bound; those that fill the full-size copy keep their ids and pass."""
    runs, seconds = device_ops.run(CASES, broken=True)
    print(report(f"{device_ops.backend}, broken remap", runs, seconds))
    assert all(r.run == 1 for r in runs), "\n".join(r.describe() for r in runs if r.run != 1)
    assert [r.case for r in runs if not r.ok] == list(SLOT_CASES)
    for r in runs[: len(SLOT_CASES)]:
        assert r.hook["on_slots"] == 1 and re.search(r"\[MUL_MAT_ID\] ERR = [0-9.]+ > 0\.000500000", r.output)


def test_a_broken_split_fails_on_the_cpu(cpu_backend_ops: Path) -> None:
    """With the second half given the first half's pairs, every case counts half its pairs twice and the
    others never: all fail."""
    runs, seconds = run_cases(cpu_backend_ops, "CPU", CASES, broken=True)
    print(report("CPU, broken split", runs, seconds))
    assert all(r.run == 1 and r.passed == 0 for r in runs), "\n".join(r.describe() for r in runs if r.passed)
