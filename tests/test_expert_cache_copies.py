"""Where the expert cache's copies come from (patches 0004, 0013-0014): a prompt through the cache, the staging
ring for a mapped model, and the choice of pinned host memory.

Which device, and why it proves the claim:
- The prompt and staging tests run on the **RPC device** (tests/conftest.py): the scheduler treats it
  as a GPU, so the cache fills the scheduler's full-size copy of a layer's experts from its slots and
  from host memory there, with the same code a GPU runs; a slot copied to the wrong expert, or a miss
  copied from the wrong offset, changes the tokens against the cache-off run of the same device.
  The RPC device has no pinned host buffer, so the ring is forced on (`--moe-cache-staging on`) and
  runs in plain host memory: its chunking, offsets and copy threads are the code a GPU runs; the
  speed of pinned chunks is the GPU check's to measure (`make bench-gpu`).
- The choice of load mode needs a device with a pinned host buffer: **llvmpipe** (Vulkan's host
  memory), start-up only (no prompt: the choice is made before the model loads, and lavapipe faults
  on some batches on some machines, tests/llvmpipe_probe.py).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from moe_l2_cache.policy.replay import read_access_log, replay_accesses
from moe_l2_llama.settings import SOFTWARE_VULKAN_ENV, LlamaSettings, llama_server_command
from tests.conftest import RpcDevice
from tests.test_expert_cache import (
    EXPERT_BYTES,
    N_MOE,
    N_PREDICT,
    SHAPE,
    cache_off_reference,
    cache_settings,
    metric,
    run_until_ready_or_exit,
    serve_on,
)
from tests.test_vulkan import Model, greedy, serve
from tests.test_vulkan import models as models  # the module's fixture
from tests.test_vulkan import settings as base_settings

pytestmark = [pytest.mark.llama, pytest.mark.slow]

EXPERT_TENSORS = 3  # gate, up, down: each run of used experts is followed by a little of the next in each
PADDING = 512  # bytes after a run of used experts the copy writes (the scheduler's own copy does the same)


def runs_before_the_last(experts: tuple[int, ...], n_expert: int) -> int:
    """Runs of consecutive used experts that end before the layer's last expert (each gets its padding)."""
    used = set(experts)
    return sum(1 for e in used if e + 1 not in used and e < n_expert - 1)


@pytest.mark.parametrize("policy", ["lru", "default"])
def test_a_prompt_over_the_slots_copies_only_its_misses(
    rpc_device: RpcDevice, models: dict[str, Model], policy: str, tmp_path: Path
) -> None:
    """A prompt whose batch uses more experts than the 7 slots is computed on the scheduler's full-size
    copy: the experts in slots come from their slots, only the others from host memory. The engine's
    counts of both equal what the replay of its own access log says was resident, and the tokens equal
    the cache off."""
    model = models["ds-v2-lite"]
    expected = cache_off_reference(rpc_device, model, tmp_path)
    log = tmp_path / "access.log"
    slots = SHAPE.n_expert_used + 1
    env = {"LLAMA_ARG_MOE_CACHE_LOG": str(log)}
    with serve_on(rpc_device, model.path, cache_settings(slots, policy), env, tmp_path) as (client, _):
        got = greedy(client, N_PREDICT)
        engine = {m: metric(client, f"moe_cache_{m}_total") for m in ("bypass", "bypass_hits", "bypass_bytes")}
    assert got == expected

    accesses = read_access_log(log)
    replay = replay_accesses(accesses, policy, N_MOE, SHAPE.n_expert, slots, SHAPE.n_expert_used)
    bypassed = [a for a in accesses if a.bypass]
    used = sum(len(a.experts) for a in bypassed)
    padding = sum(runs_before_the_last(a.experts, SHAPE.n_expert) for a in bypassed) * EXPERT_TENSORS * PADDING
    assert replay.bypass > 0 and replay.bypass_hits > 0, "the prompt should use experts the decode left in slots"
    assert engine["bypass"] == replay.bypass
    assert engine["bypass_hits"] == replay.bypass_hits
    assert engine["bypass_bytes"] == (used - replay.bypass_hits) * EXPERT_BYTES + padding
    # what the scheduler's own copy moved for the same batches: every used expert
    assert engine["bypass_bytes"] < used * EXPERT_BYTES


@pytest.mark.parametrize("slots", [SHAPE.n_expert_used + 1, 14, 32], ids=["7", "14", "32"])
def test_the_staging_ring_changes_no_token(
    rpc_device: RpcDevice, models: dict[str, Model], slots: int, tmp_path: Path
) -> None:
    """Every copy from host memory through the ring (forced on: this device has no pinned memory): the
    chunks, offsets and threads deliver the same bytes, so the tokens equal the cache off, and the
    counts equal the replay's."""
    model = models["ds-v2-lite"]
    expected = cache_off_reference(rpc_device, model, tmp_path)
    log = tmp_path / "access.log"
    s = cache_settings(slots)
    s = s.model_copy(update={"extra_args": f"{s.extra_args} --moe-cache-staging on"})
    with serve_on(rpc_device, model.path, s, {"LLAMA_ARG_MOE_CACHE_LOG": str(log)}, tmp_path) as (client, log_path):
        got = greedy(client, N_PREDICT)
        engine = {m: metric(client, f"moe_cache_{m}_total") for m in ("accesses", "hits", "loads", "bypass_hits")}
        log_text = log_path.read_text(errors="replace")
    assert "through a staging ring of 4 x 4.00 MiB of plain memory" in log_text
    assert got == expected
    replay = replay_accesses(read_access_log(log), "default", N_MOE, SHAPE.n_expert, slots, SHAPE.n_expert_used)
    assert engine == {
        "accesses": replay.accesses,
        "hits": replay.hits,
        "loads": replay.loads,
        "bypass_hits": replay.bypass_hits,
    }


def test_without_pinned_memory_the_misses_are_said_to_be_pageable(
    rpc_device: RpcDevice, models: dict[str, Model], tmp_path: Path
) -> None:
    """The RPC device has no pinned host buffer: the model stays mapped, no ring is made unless asked,
    and the one line says so."""
    model = models["ds-v2-lite"]
    with serve_on(rpc_device, model.path, cache_settings(16), {}, tmp_path) as (_, log_path):
        log_text = log_path.read_text(errors="replace")
    assert "host experts in" not in log_text  # no choice made: nothing to pin into
    assert (
        f"expert cache: misses are copied from pageable host memory for {N_MOE * EXPERT_TENSORS} of "
        f"{N_MOE * EXPERT_TENSORS} expert tensors (they are mapped from the file" in log_text
    )
    assert "copied directly (no staging ring" in log_text


# -- the load mode, on a device with pinned host memory (llvmpipe), start-up only -------------------


def vulkan_cache_settings(slots: int, extra: str = "") -> LlamaSettings:
    s = cache_settings(slots)
    return s.model_copy(update={"extra_args": f"{s.extra_args} {extra}".strip()})


def started_log(binary: Path, model: Path, s: LlamaSettings, logs: Path, env: dict[str, str] | None = None) -> str:
    """llama-server's log once it answers /health (the model loaded, the cache made), then stopped."""
    with serve(binary, model, s, env or {}, logs) as (_, log_path):
        return log_path.read_text(errors="replace")


@pytest.mark.vulkan
def test_the_experts_go_to_pinned_memory_when_the_model_fits(
    vulkan_binary: Path, models: dict[str, Model], tmp_path: Path
) -> None:
    model = models["ds-v2-lite"]
    log_text = started_log(vulkan_binary, model.path, vulkan_cache_settings(16), tmp_path)
    assert "expert cache: host experts in Vulkan0 pinned memory (load mode none)" in log_text
    assert f"misses are copied from pinned host memory ({N_MOE * EXPERT_TENSORS} of" in log_text


@pytest.mark.vulkan
def test_a_load_mode_the_user_chose_is_kept(vulkan_binary: Path, models: dict[str, Model], tmp_path: Path) -> None:
    model = models["ds-v2-lite"]
    log_text = started_log(vulkan_binary, model.path, vulkan_cache_settings(16, "--load-mode mmap"), tmp_path)
    assert "host experts in" not in log_text
    assert "misses are copied from pageable host memory" in log_text
    assert "through a staging ring of 4 x 4.00 MiB of pinned memory" in log_text


@dataclass(frozen=True)
class MemoryGroup:
    path: Path
    limit_file: str  # memory.limit_in_bytes (v1) or memory.max (v2)


@pytest.fixture
def memory_cgroup() -> Iterator[MemoryGroup]:
    """A memory cgroup of this machine's (v1 at /sys/fs/cgroup/memory, or v2 at /sys/fs/cgroup with the
    memory controller enabled for children), removed afterwards. Root only."""
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    if os.geteuid() != 0:
        pytest.skip("a memory cgroup needs root")
    controls = v2 / "cgroup.subtree_control"
    if (v1 / "memory.limit_in_bytes").is_file():
        root, limit_file = v1, "memory.limit_in_bytes"
    elif controls.is_file() and "memory" in controls.read_text(errors="replace").split():
        root, limit_file = v2, "memory.max"
    else:
        pytest.skip("no memory cgroup hierarchy to make a group in (v1 memory, or v2 with +memory)")
    group = root / f"moe-l2-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        yield MemoryGroup(group, limit_file)
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            (root / "cgroup.procs").write_text(pid)
        group.rmdir()


@pytest.mark.vulkan
def test_a_machine_short_of_memory_keeps_the_mapping_and_stages_the_misses(
    vulkan_binary: Path, models: dict[str, Model], memory_cgroup: MemoryGroup, tmp_path: Path
) -> None:
    """Under a memory limit that the model and the margin do not fit (a container's, here a cgroup's),
    the experts stay mapped and their misses go through the pinned ring; the line says why."""
    model = models["ds-v2-lite"]
    limit = model.path.stat().st_size + (1 << 30)  # under the model plus its 2 GiB margin
    (memory_cgroup.path / memory_cgroup.limit_file).write_text(str(limit))
    s = vulkan_cache_settings(16)
    # the server joins the group before it execs (the supervisor starts the argv given)
    wrapper = tmp_path / "in-cgroup.sh"
    wrapper.write_text(f'#!/bin/sh\necho $$ > {memory_cgroup.path}/cgroup.procs\nexec {vulkan_binary} "$@"\n')
    wrapper.chmod(0o755)
    # the wrapper has no build-info.json beside it, from which the service would set the Vulkan device's env
    log_text = started_log(wrapper, model.path, s, tmp_path, SOFTWARE_VULKAN_ENV)
    assert "expert cache: host experts mapped (load mode mmap): the model's" in log_text
    assert "do not fit in" in log_text
    assert "through a staging ring of 4 x 4.00 MiB of pinned memory" in log_text


def test_the_staging_mode_is_checked_by_the_flag_parser(llama_binary: Path, models: dict[str, Model]) -> None:
    cmd = [
        *llama_server_command(llama_binary, models["ds-v2-lite"].path, base_settings()),
        "--moe-cache-staging",
        "maybe",
    ]
    code, log = run_until_ready_or_exit(cmd, {})
    assert code not in (None, 0)
    assert "unknown --moe-cache-staging 'maybe' (known: auto, on, off)" in log
