"""Two GPUs and more (issue 45, the cost model): llama.cpp's layer split (`-ngl 99 --split-mode layer
--tensor-split ...`) over N devices, each with its own memory and its own host link, and three placements of
the routed experts on it:

    stock       --n-cpu-moe N --tensor-split c0,c1: the first N layers' experts on the CPU, every other layer's
                on the device that computes the layer (`stock_plan`; `stock_even` with llama.cpp's default
                split, `stock_best` searching N and the split for the fastest decode that fits every device)
    one cache   today's engine: the cache's slots on device 0 for every cached layer (`one_cache_plan`); a
                layer computed on device 1 runs its experts on device 0 (the scheduler offloads a MUL_MAT_ID
                whose weights are in host memory to its first backend, where the slots are): its
                activations cross to device 0 and back, two synchronised copies a layer and step
    per device  the plan of issue 45: each device's `--moe-cache-bytes auto` (engine_auto_split) over the
                layers it computes, on its own free memory (`per_device_plan`); its misses cross its own link

A step is the sum of the devices' parts (a layer split computes one device after the other): each part is
estimate.decode / estimate.prompt of that device's layers on a Machine whose link is the one its copies
cross, with the GPU's step, the host's page cache and the drive taken once for the whole step. Every term is
the single-GPU model's; on one device `step` equals estimate.decode and estimate.prompt of the same placement
(tests/test_placement_two_gpus.py holds it to that).

Assumptions (docs/placement-model.md, "Two GPUs"): the routed experts' bytes by the shape; each device's dense
weights the shape's other weights pro rata to the layers it computes (the embedding and the output head too);
each device's KV cache and compute buffers DEVICE_RESERVE_BYTES (2 GB, as on one card: the compute buffer is
per device); the activations between devices (n_embd floats a token, ~16 KB) cost their synchronisation only,
T_HOP_S a crossing, through the host (consumer cards have no peer-to-peer).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from moe_l2_placement.choose import engine_auto_split
from moe_l2_placement.curve import CacheStats, esft_stats
from moe_l2_placement.estimate import (
    OFFLOAD_MIN_BATCH,
    PROMPT_USED_SHARE,
    Estimate,
    Placement,
    decode,
    distinct_used,
    layer_misses_at,
    nvme_bps,
    prompt,
    ram_share,
    split_gpu_time,
)
from moe_l2_placement.machine import (
    CONSUMER_HOST_RAM_BYTES,
    DEVICE_RESERVE_BYTES,
    NVME_GBPS,
    T_RT_S,
    Machine,
    consumer_machine,
)
from moe_l2_placement.shape import Shape

# One crossing of the activations between two devices: a synchronised copy of ~16 KB through the host, the
# same kind of synchronisation as the host round trip T_RT_S was fitted on (assumed equal to it).
T_HOP_S = T_RT_S

# PCIe 4.0: 16 GT/s a lane, 128b/130b: 31.5 GB/s at x16, 15.75 at x8. The 24 GB desktop's 25 GB/s pinned at
# x16 (consumer_machine, given) is 79% of it; x8 keeps the same share: half, 12.5 GB/s. The pageable rate
# (12 GB/s at x16, a staging copy through the driver) halves with it: the link, not the memcpy, bounds it then.
LINKS: dict[str, float] = {"x16": 1.0, "x8/x8": 0.5}  # a card's link against PCIe 4.0 x16 alone
X16_PINNED_GBPS = 25.0
X16_PAGEABLE_GBPS = 12.0


@dataclass(frozen=True)
class Gpus:
    """N devices on one host: a Machine each (its card's step for the whole shape, its own host link; the host's
    CPU, memory and drive the same in all) and each device's memory."""

    name: str
    machines: tuple[Machine, ...]
    memory_bytes: tuple[int, ...]
    reserve_bytes: int = DEVICE_RESERVE_BYTES  # a device's KV cache and compute buffers
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.machines)


def with_link(machine: Machine, share: float) -> Machine:
    """`machine` on a link of `share` of PCIe 4.0 x16 (LINKS): the pinned and pageable rates scaled, one copy's
    fixed cost kept (it is the DMA setup, not the link)."""
    lat_per_byte = machine.copy_latency_s / machine.ref_bytes
    big = X16_PINNED_GBPS * share
    return replace(
        machine,
        h2d_pinned_big_gbps=big,
        h2d_pinned_expert_gbps=1 / (lat_per_byte + 1 / (big * 1e9)) / 1e9,
        h2d_pageable_big_gbps=X16_PAGEABLE_GBPS * share,
        name=f"{machine.name} ({share:.2g} of its link)",
    )


def desktop_gpus(shape: Shape, h200: Machine, link: str = "x16", n: int = 2, card_bytes: int = 24 * 10**9) -> Gpus:
    """n 24 GB cards on the 24 GB desktop of the real-shapes table (consumer_machine: an 8-core DDR5 CPU, 96 GB
    of host memory, an NVMe drive), each on its own PCIe 4.0 link: `x16` (each card 25 GB/s pinned, as if alone:
    a workstation's lanes) or `x8/x8` (the desktop's 16 CPU lanes shared: 12.5 each)."""
    base = replace(consumer_machine(shape, h200), host_ram_bytes=CONSUMER_HOST_RAM_BYTES, nvme_gbps=NVME_GBPS)
    m = base if link == "x16" else with_link(base, LINKS[link])
    return Gpus(
        f"{n} x 24 GB, PCIe 4.0 {link}",
        (m,) * n,
        (card_bytes,) * n,
        sources={
            "link": f"PCIe 4.0 {link}: {m.h2d_pinned_big_gbps:g} GB/s pinned, {m.h2d_pageable_big_gbps:g} pageable a "
            "card (x16 the 24 GB desktop's given 25/12; x8 half: 15.75 of 31.5 GB/s raw, the same 79%)",
            "card": "consumer_machine: the H200's per-layer step overhead, 1008 GB/s at 80%",
            "host": "CONSUMER_HOST_RAM_BYTES 96 GB, CONSUMER_CPU_GBPS 40 GB/s, NVME_GBPS 5 (assumed, one host)",
        },
    )


# -- llama.cpp's layer split -------------------------------------------------------------------------------------


def layer_counts(n_layer: int, fractions: Sequence[float]) -> tuple[int, ...]:
    """The repeating layers each device computes under `--tensor-split` `fractions` with -ngl 99, as
    llama_model::load_tensors assigns them: layer il to the first device d with il / (n_layer + 1) < the
    cumulative share of devices 0..d (the output layer is the (n_layer + 1)-th)."""
    total = sum(fractions)
    cum = list(itertools.accumulate(f / total for f in fractions))
    counts = [0] * len(fractions)
    for il in range(n_layer):
        x = il / (n_layer + 1)
        counts[next((d for d, c in enumerate(cum) if x < c), len(cum) - 1)] += 1
    return tuple(counts)


def default_counts(shape: Shape, gpus: Gpus) -> tuple[int, ...]:
    """llama.cpp's split without --tensor-split: by each device's free memory (equal cards: even)."""
    return layer_counts(shape.n_layer, gpus.memory_bytes)


def tensor_split_arg(counts: Sequence[int]) -> str:
    """The --tensor-split that gives `counts` (the output layer with the last device)."""
    return ",".join(str(c + (i == len(counts) - 1)) for i, c in enumerate(counts))


@dataclass(frozen=True)
class DeviceShare:
    """What one device computes under a layer split, and what is left of its memory for routed experts."""

    device: int
    first: int  # its first repeating layer
    n_layer: int  # repeating layers it computes
    moe: tuple[int, ...]  # the MoE layers among them (layer indices)
    dense_bytes: int
    budget_bytes: int  # its memory less its dense weights and the reserve (may be < 0: it does not fit)


def shares(shape: Shape, gpus: Gpus, counts: Sequence[int]) -> list[DeviceShare]:
    assert len(counts) == gpus.n and sum(counts) == shape.n_layer, (counts, shape.n_layer)
    first_moe = shape.n_layer - shape.n_moe  # dense leading layers first (glm-4.5-air: 1, deepseek: 1-3)
    out, start = [], 0
    for d, c in enumerate(counts):
        dense = (
            shape.other_bytes * c // shape.n_layer
            if d < gpus.n - 1
            else shape.other_bytes - sum(s.dense_bytes for s in out)
        )
        moe = tuple(il for il in range(start, start + c) if il >= first_moe)
        out.append(DeviceShare(d, start, c, moe, dense, gpus.memory_bytes[d] - dense - gpus.reserve_bytes))
        start += c
    return out


# -- plans --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DevicePlan:
    """One device's part of a placement: its MoE layers wholly on it, behind a cache, on the CPU."""

    device: int
    n_layer: int  # repeating layers it computes (its share of the GPU's step)
    n_dev: int
    n_cache: int
    n_cpu: int
    slots: int  # slots a cached layer
    cache_on: int  # the device whose slots (and host link) its cached layers use; stock: where prompts offload
    dense_bytes: int
    budget_bytes: int

    @property
    def n_moe(self) -> int:
        return self.n_dev + self.n_cache + self.n_cpu


@dataclass(frozen=True)
class Plan:
    label: str
    devices: tuple[DevicePlan, ...]
    tensor_split: str
    n_cpu_moe: int | None = None  # stock only
    why: str = ""

    def used_bytes(self, shape: Shape, gpus: Gpus) -> list[int]:
        """Each device's memory in use: its dense weights, the reserve, its whole layers, the slots it hosts."""
        used = [p.dense_bytes + gpus.reserve_bytes + p.n_dev * shape.layer_bytes for p in self.devices]
        for p in self.devices:
            used[p.cache_on] += p.n_cache * p.slots * shape.expert_bytes
        return used

    def fits(self, shape: Shape, gpus: Gpus) -> bool:
        return all(u <= m for u, m in zip(self.used_bytes(shape, gpus), gpus.memory_bytes, strict=True))


def stock_plan(shape: Shape, gpus: Gpus, counts: Sequence[int], n_cpu_moe: int) -> Plan:
    """--n-cpu-moe N over the split `counts`: layers il < N keep their experts on the CPU, every other MoE
    layer's experts sit on the device that computes it."""
    devs = []
    for s in shares(shape, gpus, counts):
        on_cpu = sum(il < n_cpu_moe for il in s.moe)
        devs.append(
            DevicePlan(s.device, s.n_layer, len(s.moe) - on_cpu, 0, on_cpu, 0, 0, s.dense_bytes, s.budget_bytes)
        )
    return Plan("stock", tuple(devs), tensor_split_arg(counts), n_cpu_moe)


def least_n_cpu_moe(shape: Shape, gpus: Gpus, counts: Sequence[int]) -> Plan | None:
    """The stock plan of the fewest --n-cpu-moe that fits every device (decode only gets slower with more)."""
    for n in range(shape.n_layer + 1):
        plan = stock_plan(shape, gpus, counts, n)
        if plan.fits(shape, gpus):
            return plan
    return None


def stock_even(shape: Shape, gpus: Gpus) -> Plan | None:
    """What a user gets with --n-cpu-moe and llama.cpp's default split: the least N that fits."""
    plan = least_n_cpu_moe(shape, gpus, default_counts(shape, gpus))
    return replace(plan, label="stock, default split") if plan else None


def splits(n_layer: int, n: int) -> list[tuple[int, ...]]:
    """Every contiguous split of n_layer layers over n devices (each device at least one layer)."""
    return [
        tuple(b - a for a, b in zip((0, *cuts), (*cuts, n_layer), strict=True))
        for cuts in itertools.combinations(range(1, n_layer), n - 1)
    ]


def stock_best(shape: Shape, gpus: Gpus) -> Plan | None:
    """The fastest stock decode that fits: the least N over every split; among the splits that reach it, the
    fastest prompt, then the one nearest the default."""
    default = default_counts(shape, gpus)
    best: tuple[float, float, int, Plan] | None = None
    for counts in splits(shape.n_layer, gpus.n) if gpus.n > 1 else [default]:
        plan = least_n_cpu_moe(shape, gpus, counts)
        if plan is None:
            continue
        d, p = step(shape, gpus, plan)
        key = (
            round(d.tokens_per_s, 9),
            round(p.tokens_per_s, 9),
            -sum(abs(a - b) for a, b in zip(counts, default, strict=True)),
        )
        if best is None or key > best[:3]:
            best = (*key, plan)
    return replace(best[3], label="stock, best split") if best else None


def _auto(n_layer: int, shape: Shape, budget: int, machine: Machine) -> tuple[int, int]:
    """engine_auto_split over n_layer layers: (whole layers, slots)."""
    if n_layer == 0:
        return 0, 0
    a = engine_auto_split(
        n_layer,
        shape.n_expert,
        shape.top_k,
        shape.expert_bytes,
        max(0, budget),
        machine.t_rt_s,
        machine.expert_copy_s(shape.expert_bytes, "pinned"),
    )
    return a.n_dev, a.n_slot


def per_device_plan(shape: Shape, gpus: Gpus, counts: Sequence[int] | None = None) -> Plan:
    """Issue 45's plan: each device's engine auto over the MoE layers it computes, on its own free memory."""
    counts = tuple(counts or default_counts(shape, gpus))
    devs = []
    for s in shares(shape, gpus, counts):
        n_dev, slots = _auto(len(s.moe), shape, s.budget_bytes, gpus.machines[s.device])
        rest = len(s.moe) - n_dev
        devs.append(
            DevicePlan(
                s.device,
                s.n_layer,
                n_dev,
                rest if slots else 0,
                0 if slots else rest,
                slots,
                s.device,
                s.dense_bytes,
                s.budget_bytes,
            )
        )
    return Plan("a cache per device", tuple(devs), tensor_split_arg(counts))


def one_cache_plan(shape: Shape, gpus: Gpus, counts: Sequence[int] | None = None) -> Plan:
    """Today's engine at its best: the other devices fill with whole layers of their own (the engine today counts
    them against device 0's budget; here each gets its own room), and device 0's free memory holds the engine
    auto's whole layers of its own and the slots of every other cached layer, its own and the other devices'."""
    counts = tuple(counts or default_counts(shape, gpus))
    sh = shares(shape, gpus, counts)
    whole = [0] + [min(len(s.moe), max(0, s.budget_bytes) // shape.layer_bytes) for s in sh[1:]]
    rest_other = sum(len(s.moe) - w for s, w in zip(sh[1:], whole[1:], strict=True))
    n_dev0, slots = _auto(len(sh[0].moe) + rest_other, shape, sh[0].budget_bytes, gpus.machines[0])
    if n_dev0 > len(sh[0].moe):  # the whole layers it chose would be other devices' layers: keep to its own
        n_dev0 = len(sh[0].moe)
        r = rest_other
        slots = min(shape.n_expert, max(0, sh[0].budget_bytes - n_dev0 * shape.layer_bytes) // (r * shape.expert_bytes))
        slots = slots if slots >= shape.top_k else 0
    whole[0] = n_dev0
    devs = []
    for s, w in zip(sh, whole, strict=True):
        rest = len(s.moe) - w
        devs.append(
            DevicePlan(
                s.device,
                s.n_layer,
                w,
                rest if slots else 0,
                0 if slots else rest,
                slots,
                0,
                s.dense_bytes,
                s.budget_bytes,
            )
        )
    return Plan("one cache on device 0", tuple(devs), tensor_split_arg(counts))


# -- a step of a plan ---------------------------------------------------------------------------------------------


def _stats(shape: Shape, p: DevicePlan) -> CacheStats | None:
    return esft_stats(p.slots, shape.top_k, shape.n_expert) if p.n_cache else None


def _placement(p: DevicePlan, host: str) -> Placement:
    if p.n_cache:
        return Placement("lc", n_dev=p.n_dev, n_cache=p.n_cache, slots=p.slots, cpu_misses=True, host=host)
    if p.n_cpu:
        return Placement("c", n_dev=p.n_dev, n_cpu=p.n_cpu, host=host)
    return Placement("a", n_dev=p.n_dev, host=host)


def _add(terms: dict[str, float], more: dict[str, float]) -> None:
    for k, v in more.items():
        terms[k] = terms.get(k, 0.0) + v


def step(shape: Shape, gpus: Gpus, plan: Plan, n_prompt: int = 117) -> tuple[Estimate, Estimate]:
    """One decode step and one prompt micro-batch of n_prompt tokens of `plan` (the module docstring)."""
    host0 = gpus.machines[0]
    held = sum((p.n_cpu + p.n_cache) * shape.layer_bytes for p in plan.devices)
    share = ram_share(host0.host_ram_bytes, held)
    host = "mapped" if share < 1.0 else "pinned"  # nothing can be pinned past the host's memory
    dec: dict[str, float] = {}
    pro: dict[str, float] = {}
    links = [0.0] * gpus.n
    nvme_misses, copied = 0.0, 0.0
    for p in plan.devices:
        part = p.n_layer / shape.n_layer  # its share of the GPU's step (the per-layer launches, the weights)
        _add(dec, {k: v * part for k, v in split_gpu_time(shape, gpus.machines[p.device]).items()})
        _add(pro, {"GPU prompt compute": part * gpus.machines[p.device].gpu_prompt_s(n_prompt)})
        if not p.n_moe:
            continue
        # its layers on the link its copies cross: no GPU step, no host memory bound (both taken once, above)
        m = replace(
            gpus.machines[p.cache_on],
            gpu_token_s=0.0,
            gpu_prompt_fixed_s=0.0,
            gpu_prompt_token_s=0.0,
            host_ram_bytes=0.0,
        )
        pl, st = _placement(p, host), _stats(shape, p)
        _add(dec, decode(shape, m, pl, st).terms)
        _add(pro, prompt(shape, m, pl, n_prompt, None, st).terms)
        if st is not None:
            links[p.cache_on] += p.n_cache * (st.misses + st.prefetch) * m.expert_copy_s(shape.expert_bytes, host)
        hops = p.n_cache if p.cache_on != p.device else 0
        prompt_hops = hops + (p.n_cpu if p.device != 0 and n_prompt >= OFFLOAD_MIN_BATCH else 0)
        if hops:
            dec["device hops"] = dec.get("device hops", 0.0) + 2 * hops * T_HOP_S
        if prompt_hops:
            pro["device hops"] = pro.get("device hops", 0.0) + 2 * prompt_hops * T_HOP_S
        # the host's page cache over every device's host-held layers (estimate.page_cache_misses, once)
        if share < 1.0:
            E = shape.n_expert
            nvme_misses += p.n_cpu * layer_misses_at(shape, share * E) + p.n_cache * layer_misses_at(
                shape, p.slots + share * E
            )
        if p.n_cpu + p.n_cache and not (n_prompt < OFFLOAD_MIN_BATCH and not p.n_cache):
            used = min(distinct_used(shape, n_prompt), PROMPT_USED_SHARE * shape.n_expert)
            cs = st.prompt_copy_share if st is not None else 1.0
            copied += (p.n_cpu + p.n_cache) * used * cs * shape.expert_bytes
    nvme = nvme_bps(host0)
    dec["NVMe reads"] = nvme_misses * shape.expert_bytes / nvme
    host_layers = sum(p.n_cpu + p.n_cache for p in plan.devices)
    if host_layers and nvme_misses:
        pro["NVMe reads"] = copied * nvme_misses / (host_layers * shape.top_k) / nvme
    d = Estimate(1, {k: v for k, v in dec.items() if v > 0})
    if max(links) > d.total_s:
        d.total_s = max(links)
        d.bound_override = "PCIe link (demand copies, admissions, prefetch) 100%"
    return d, Estimate(n_prompt, {k: v for k, v in pro.items() if v > 0})


# -- the table ----------------------------------------------------------------------------------------------------


@dataclass
class TwoGpuRow:
    shape: str
    machine: str
    placement: str
    tensor_split: str
    n_cpu_moe: int | None
    decode_tps: float
    prompt_tps: float
    decode_bound: str
    devices: list[dict[str, object]]  # per device: layers, whole / cached / CPU layers, slots, used / memory


def describe(shape: Shape, gpus: Gpus, plan: Plan) -> TwoGpuRow:
    d, p = step(shape, gpus, plan)
    used = plan.used_bytes(shape, gpus)
    devs = [
        {
            "device": x.device,
            "layers": x.n_layer,
            "moe_layers": x.n_moe,
            "whole": x.n_dev,
            "cached": x.n_cache,
            "cpu": x.n_cpu,
            "slots": x.slots,
            "cache_on": x.cache_on,
            "used_bytes": used[x.device],
            "memory_bytes": gpus.memory_bytes[x.device],
        }
        for x in plan.devices
    ]
    return TwoGpuRow(
        shape.name,
        gpus.name,
        plan.label,
        plan.tensor_split,
        plan.n_cpu_moe,
        d.tokens_per_s,
        p.tokens_per_s,
        d.bound,
        devs,
    )


def device_words(row: TwoGpuRow) -> str:
    """Each device's placement in a few words: `whole/cached@slots/cpu, used of memory GB`."""
    out = []
    for x in row.devices:
        cache = f" + {x['cached']} cached x {x['slots']} slots" if x["cached"] else ""
        if x["cached"] and x["cache_on"] != x["device"]:
            cache += f" (on dev {x['cache_on']})"
        cpu = f" + {x['cpu']} CPU" if x["cpu"] else ""
        out.append(
            f"dev {x['device']}: {x['whole']} whole{cache}{cpu}; "
            f"{int(x['used_bytes']) / 1e9:.1f}/{int(x['memory_bytes']) / 1e9:.0f} GB"
        )
    return "; ".join(out)
