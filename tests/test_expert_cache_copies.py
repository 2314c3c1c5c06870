"""Where the expert cache's copies come from (patches 0004, 0017-0018, 0021): a prompt through the cache, its
copies one expert tensor ahead, the staging ring for a mapped model, and the choice of pinned host memory.

Which device, and why it proves the claim:
- The prompt and staging tests run on the **RPC device** (tests/conftest.py): the scheduler treats it
  as a GPU, so the cache fills the scheduler's full-size copy of a layer's experts from its slots and
  from host memory there, with the same code a GPU runs; a slot copied to the wrong expert, or a miss
  copied from the wrong offset, changes the tokens against the cache-off run of the same device.
  The copies ahead (0021) run there as on a GPU: the RPC device has events, so they go to a second
  backend of the device behind an event the compute waits for, into the same two buffers and through
  the same fills. The reduced shape's buffers are more than an eighth of any budget, so the tests force
  them on (`--moe-cache-prompt-ahead on`); what they overlap is the GPU check's to measure.
  The RPC device has no pinned host buffer, so the ring is forced on (`--moe-cache-staging on`) and
  runs in plain host memory: its chunking, offsets and copy threads are the code a GPU runs; the
  speed of pinned chunks is the GPU check's to measure (`make bench-gpu`).
- The choice of load mode needs a device with a pinned host buffer: **llvmpipe** (Vulkan's host
  memory), start-up only (no prompt: the choice is made before the model loads, and lavapipe faults
  on some batches on some machines, tests/llvmpipe_probe.py). They take the unprobed build
  (`vulkan_build`): the probe judges the batches the other tests send, these send none, so they run on
  every machine and need no RPC twin, which could not hold their assertion (the RPC device has no
  pinned host memory).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from moe_l2_cache.policy.replay import read_access_log, replay_accesses
from moe_l2_contracts.schemas.llama import ExpertCacheShape
from moe_l2_llama.command_line import llama_server_command
from moe_l2_llama.settings import LlamaSettings
from moe_l2_llama.vulkan_env import SOFTWARE_VULKAN_ENV
from tests.conftest import RpcDevice
from tests.test_expert_cache import (
    AHEAD_BYTES,
    EXPERT_BYTES,
    N_MOE,
    N_PREDICT,
    SHAPE,
    budget,
    cache_off_reference,
    cache_settings,
    metric,
    run_until_ready_or_exit,
    serve_on,
    with_prompt_ahead,
)
from tests.test_vulkan import Model, greedy, greedy_one, serve
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


# a prompt of many different words, so that a layer uses at least three quarters of its experts and the
# copies go one layer ahead too, not only from a layer's tensor to its next
LONG_PROMPT = (
    "seven amber lanterns drifted over quiet harbors while merchants counted silver coins beneath "
    "crooked towers; a violinist rehearsed forgotten melodies, children chased copper kites across "
    "windy meadows, and the old astronomer mapped distant comets with trembling patience before dawn "
    "painted frozen rivers gold. ninety weary travelers argued about maps, bread, thunder, glaciers, "
    "pianos, volcanoes, orchids, submarines, algebra, cinnamon, lighthouses and rusty bicycles"
)


def ahead_settings(slots: int, policy: str = "default") -> LlamaSettings:
    """The cache of `slots` slots, with the copies ahead forced on: their buffers come out of the bytes."""
    return with_prompt_ahead(cache_settings(slots, policy), slots)


def bypass_bytes_of_replay(accesses: list, hits: int) -> int:
    """What the replay says a prompt's bypassed micro-batches copy from host memory: their used experts
    not in slots, and the padding after each run of used experts."""
    bypassed = [a for a in accesses if a.bypass]
    used = sum(len(a.experts) for a in bypassed)
    padding = sum(runs_before_the_last(a.experts, SHAPE.n_expert) for a in bypassed) * EXPERT_TENSORS * PADDING
    return (used - hits) * EXPERT_BYTES + padding


AHEAD_METRICS = ("bypass", "bypass_hits", "bypass_bytes", "ahead_bytes", "ahead_unused_bytes", "accesses", "hits")


@pytest.mark.parametrize("slots", [SHAPE.n_expert_used + 1, 14, 32], ids=["7", "14", "32"])
def test_a_prompt_copied_one_tensor_ahead_changes_no_token(
    rpc_device: RpcDevice, models: dict[str, Model], slots: int, tmp_path: Path
) -> None:
    """Each of a prompt's expert tensors after the first of its layer computes on a buffer its misses
    crossed into ahead of it: the tokens equal the cache off, the slots are the budget less the two
    buffers, and what crossed is what the replay of the access log says was missing, plus the copies
    ahead the tensor then did not use."""
    model = models["ds-v2-lite"]
    expected = cache_off_reference(rpc_device, model, tmp_path)
    log = tmp_path / "access.log"
    with serve_on(rpc_device, model.path, ahead_settings(slots), {"LLAMA_ARG_MOE_CACHE_LOG": str(log)}, tmp_path) as (
        client,
        log_path,
    ):
        got = greedy(client, N_PREDICT)
        engine = {m: metric(client, f"moe_cache_{m}_total") for m in AHEAD_METRICS}
        n_slot = metric(client, "moe_cache_slots")
        shape = ExpertCacheShape.model_validate(client.get("/moe/cache").json())
        log_text = log_path.read_text(errors="replace")
    assert f"a prompt's misses copied one expert tensor ahead into 2 x {AHEAD_BYTES / 2 / 2**20:.2f} MiB" in log_text
    assert "on a second backend, overlapping compute: RPC0" in log_text  # the RPC device has events
    assert n_slot == slots
    assert shape.ahead_bytes == AHEAD_BYTES
    # the slabs, the two buffers, and the slot id tables (a few KiB)
    assert 0 <= shape.device_bytes - (slots * N_MOE * EXPERT_BYTES + AHEAD_BYTES) < 2**20
    assert got == expected

    accesses = read_access_log(log)
    replay = replay_accesses(accesses, "default", N_MOE, SHAPE.n_expert, slots, SHAPE.n_expert_used)
    assert replay.bypass > 0, "the prompts should use more experts than the slots"
    assert (engine["accesses"], engine["hits"], engine["bypass"], engine["bypass_hits"]) == (
        replay.accesses,
        replay.hits,
        replay.bypass,
        replay.bypass_hits,
    )
    assert engine["ahead_bytes"] > 0
    expected_bytes = bypass_bytes_of_replay(accesses, replay.bypass_hits) + engine["ahead_unused_bytes"]
    assert engine["bypass_bytes"] == expected_bytes


def test_a_long_prompt_is_copied_one_layer_ahead(
    rpc_device: RpcDevice, models: dict[str, Model], tmp_path: Path
) -> None:
    """A prompt whose first layer uses at least three quarters of its experts: after its last tensor the
    next layer's first one gets every expert not in a slot ahead of its ids, so everything but the first
    layer's first tensor crossed ahead; what crossed is the replay's misses and the copies ahead it did
    not use, exactly, and the tokens equal the cache off. The model's last layer computes only the
    prompt's last row (no prompt's batch there), and nothing is copied ahead into it."""
    model = models["ds-v2-lite"]
    s_off = base_settings(gpu_layers=99, extra_args="--cpu-moe -lv 4")
    with serve_on(rpc_device, model.path, s_off, {}, tmp_path) as (client, _):
        expected = greedy_one(client, LONG_PROMPT, N_PREDICT)
    log = tmp_path / "access.log"
    slots = 14
    with serve_on(rpc_device, model.path, ahead_settings(slots), {"LLAMA_ARG_MOE_CACHE_LOG": str(log)}, tmp_path) as (
        client,
        _,
    ):
        got = greedy_one(client, LONG_PROMPT, N_PREDICT)
        engine = {m: metric(client, f"moe_cache_{m}_total") for m in AHEAD_METRICS}
    assert got == expected

    accesses = read_access_log(log)
    prompt = [a for a in accesses if a.bypass]
    assert [a.layer for a in prompt] == list(range(N_MOE - 1)), "a prompt's batch in every layer but the last"
    assert 4 * len(prompt[0].experts) >= 3 * SHAPE.n_expert, "the first layer should use 3/4 of its experts"
    replay = replay_accesses(accesses, "default", N_MOE, SHAPE.n_expert, slots, SHAPE.n_expert_used)
    assert engine["bypass_bytes"] == bypass_bytes_of_replay(accesses, replay.bypass_hits) + engine["ahead_unused_bytes"]
    # In expert-tensors (one tensor's bytes of one expert): the first layer's misses crossed ahead for its
    # second and third tensors; the second layer's first tensor got every expert not in a slot (its ids not
    # known yet), its other two exactly its misses. Before the prompt (no profile: no prefetch) a layer
    # holds the distinct experts it used, up to its slots.
    tensor = EXPERT_BYTES // EXPERT_TENSORS
    hits = [
        replay_accesses(accesses[: accesses.index(a) + 1], "default", N_MOE, SHAPE.n_expert, slots, SHAPE.n_expert_used)
        for a in prompt[:2]
    ]
    misses = [
        len(prompt[0].experts) - hits[0].bypass_hits,
        len(prompt[1].experts) - (hits[1].bypass_hits - hits[0].bypass_hits),
    ]
    before = {e for a in accesses[: accesses.index(prompt[0])] if a.layer == 1 for e in a.experts}
    not_in_slots = SHAPE.n_expert - min(slots, len(before))
    assert engine["ahead_bytes"] == (2 * misses[0] + not_in_slots + 2 * misses[1]) * tensor
    assert engine["ahead_unused_bytes"] == (not_in_slots - misses[1]) * tensor


def test_the_copies_ahead_say_why_they_are_off(rpc_device: RpcDevice, models: dict[str, Model], tmp_path: Path) -> None:
    """auto: off where the buffers would take more than an eighth of the cache's bytes (the reduced shape's
    do at any budget under every expert), and where no second queue can overlap them; forced on with a
    budget the buffers would leave under top-k slots: a warning. Each in one line, and the cache keeps
    every slot of its budget."""
    model = models["ds-v2-lite"]
    with serve_on(rpc_device, model.path, cache_settings(16), {}, tmp_path) as (client, log_path):
        auto_log = log_path.read_text(errors="replace")
        auto_slots = metric(client, "moe_cache_slots")
    assert "no copies one tensor ahead for prompts" in auto_log
    assert "they would take more than an eighth of the cache's bytes" in auto_log
    assert auto_slots == 16
    one_queue = {"LLAMA_ARG_MOE_CACHE_COPY_STREAM": "0"}
    with serve_on(rpc_device, model.path, cache_settings(16), one_queue, tmp_path) as (client, log_path):
        one_queue_log = log_path.read_text(errors="replace")
    assert "no second queue to copy on (no events on the device, or --no-moe-cache-copy-stream)" in one_queue_log
    tight = ahead_settings(SHAPE.n_expert_used + 1).model_copy(update={"expert_cache_bytes": budget(16)})
    with serve_on(rpc_device, model.path, tight, {}, tmp_path) as (client, log_path):
        forced_log = log_path.read_text(errors="replace")
        forced_slots = metric(client, "moe_cache_slots")
    assert "no copies one tensor ahead for prompts" in forced_log
    assert "they would leave fewer than top-k slots" in forced_log
    assert forced_slots == 16


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
    vulkan_build: Path, models: dict[str, Model], tmp_path: Path
) -> None:
    model = models["ds-v2-lite"]
    log_text = started_log(vulkan_build, model.path, vulkan_cache_settings(16), tmp_path)
    assert "expert cache: host experts in Vulkan0 pinned memory (load mode none)" in log_text
    assert f"misses are copied from pinned host memory ({N_MOE * EXPERT_TENSORS} of" in log_text


@pytest.mark.vulkan
def test_a_load_mode_the_user_chose_is_kept(vulkan_build: Path, models: dict[str, Model], tmp_path: Path) -> None:
    model = models["ds-v2-lite"]
    log_text = started_log(vulkan_build, model.path, vulkan_cache_settings(16, "--load-mode mmap"), tmp_path)
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
    vulkan_build: Path, models: dict[str, Model], memory_cgroup: MemoryGroup, tmp_path: Path
) -> None:
    """Under a memory limit that the model and the margin do not fit (a container's, here a cgroup's),
    the experts stay mapped and their misses go through the pinned ring; the line says why."""
    model = models["ds-v2-lite"]
    limit = model.path.stat().st_size + (1 << 30)  # under the model plus its 2 GiB margin
    (memory_cgroup.path / memory_cgroup.limit_file).write_text(str(limit))
    s = vulkan_cache_settings(16)
    # the server joins the group before it execs (the supervisor starts the argv given)
    wrapper = tmp_path / "in-cgroup.sh"
    wrapper.write_text(f'#!/bin/sh\necho $$ > {memory_cgroup.path}/cgroup.procs\nexec {vulkan_build} "$@"\n')
    wrapper.chmod(0o755)
    # the wrapper has no build-info.json beside it, from which the service would set the Vulkan device's env
    log_text = started_log(wrapper, model.path, s, tmp_path, SOFTWARE_VULKAN_ENV)
    assert "expert cache: host experts mapped (load mode mmap): the model's" in log_text
    assert "do not fit in" in log_text
    assert "through a staging ring of 4 x 4.00 MiB of pinned memory" in log_text


@pytest.mark.parametrize(
    ("flag", "value"), [("--moe-cache-staging", "maybe"), ("--moe-cache-prompt-ahead", "sometimes")]
)
def test_the_copy_modes_are_checked_by_the_flag_parser(
    llama_binary: Path, models: dict[str, Model], flag: str, value: str
) -> None:
    cmd = [*llama_server_command(llama_binary, models["ds-v2-lite"].path, base_settings()), flag, value]
    code, log = run_until_ready_or_exit(cmd, {})
    assert code not in (None, 0)
    assert f"unknown {flag} '{value}' (known: auto, on, off)" in log
