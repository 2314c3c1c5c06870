"""For the engine's `auto` mode: the split of a device budget between whole layers and the cache
(`choose_layers_and_cache`; the engine's own `engine_auto_split`, operation for operation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from moe_l2_placement.curve import ESFT_HIT_CURVE, CacheStats, esft_stats
from moe_l2_placement.estimate import Placement, decode
from moe_l2_placement.hit_curve import HitCurve
from moe_l2_placement.machine import Machine
from moe_l2_placement.shape import Shape


@dataclass(frozen=True)
class LayersAndCache:
    """choose_layers_and_cache's answer."""

    n_dev: int  # MoE layers wholly on the device (the last ones, as --n-cpu-moe keeps them)
    n_cache: int  # MoE layers behind the cache
    n_cpu: int  # MoE layers computed on the CPU (a budget under top-k slots for the rest)
    slots: int  # slots a cached layer
    decode_tps: float
    why: str


def choose_layers_and_cache(
    budget_bytes: int,
    shape: Shape,
    machine: Machine,
    *,
    cpu_misses: bool = True,
    stats_at: Callable[[int], CacheStats] | None = None,
) -> LayersAndCache:
    """The split of a device budget between whole layers and the cache that decodes fastest.

    The arithmetic (the engine's `--moe-cache-bytes auto` mirrors it):

        layer = n_expert * expert_bytes
        if budget >= L * layer: every expert on the device ("everything fits")
        for n_dev in 0 .. floor(budget / layer):
            rest  = L - n_dev
            slots = min(n_expert, floor((budget - n_dev * layer) / (rest * expert_bytes)))
            if slots < top_k: the rest on the CPU, T = T_gpu + rest * (t_rt + k * S / B_cpu)
            else: T = T_gpu + rest * (t_rt + p(slots) * t_x + sum over m of P_slots(m) * time(m, choose_split(m)))
                  (without CPU misses: time(m) = m * t_x), and with CPU misses T >= rest * (m + p) * t_x
        the n_dev of least T; on a tie the larger n_dev (its prompt copies less)

    P_slots(m), p(slots): the policy's replay at that slot count (ESFT_CURVE here; the engine may use a
    binomial(k, 1 - hit rate) of its own live hit rate). T_gpu does not depend on n_dev.
    """
    stats_for = stats_at or (lambda s: esft_stats(s, shape.top_k, shape.n_expert))
    layer = shape.layer_bytes
    if budget_bytes >= shape.n_moe * layer:
        t = decode(shape, machine, Placement("a", n_dev=shape.n_moe)).tokens_per_s
        return LayersAndCache(shape.n_moe, 0, 0, 0, t, "everything fits: every expert on the device")
    best: LayersAndCache | None = None
    for n_dev in range(0, min(shape.n_moe - 1, budget_bytes // layer) + 1):
        rest = shape.n_moe - n_dev
        slots = min(shape.n_expert, (budget_bytes - n_dev * layer) // (rest * shape.expert_bytes))
        if slots < shape.top_k:
            pl = Placement("c", n_dev=n_dev, n_cpu=rest)
            cand = LayersAndCache(n_dev, 0, rest, 0, decode(shape, machine, pl).tokens_per_s, "")
        else:
            pl = Placement("lc", n_dev=n_dev, n_cache=rest, slots=slots, cpu_misses=cpu_misses)
            cand = LayersAndCache(n_dev, rest, 0, slots, decode(shape, machine, pl, stats_for(slots)).tokens_per_s, "")
        if best is None or cand.decode_tps >= best.decode_tps * (1 - 1e-9):
            best = cand
    assert best is not None
    why = f"{best.n_dev} layers on the device, " + (
        f"{best.n_cache} behind a cache of {best.slots} slots" if best.n_cache else f"{best.n_cpu} on the CPU"
    )
    return replace(best, why=why)


# -- the engine's --moe-cache-bytes auto (patch 0020), the same arithmetic -----------------------------------------

# The hit curve the engine chooses the placement with (it does so before the model loads, before any routing is
# seen): the file of --moe-cache-hit-curve. `moe-l2 up` passes the cache-manager's curve of the model's routing
# once written, else the shipped one, ESFT_CURVE's hit rates (moe_l2_placement.hit_curve); this is the latter.
ENGINE_HIT_CURVE: HitCurve = ESFT_HIT_CURVE
# A llama-server started without --moe-cache-hit-curve assumes uniform routing: a cache of a share of a layer's
# experts hits that share of its uses.
UNIFORM_HIT_CURVE = HitCurve(((0.5, 0.5), (1.0, 1.0)))


@dataclass(frozen=True)
class EngineSplit:
    """common_moe_choose_split's answer."""

    n_dev: int  # MoE layers wholly on the device (the last ones)
    n_slot: int  # slots a cached layer; 0: no cache
    cost_s: float  # the round trips and misses a decode step the split leaves

    def why(self, n_layer: int, n_expert: int) -> str:
        rest = n_layer - self.n_dev
        if rest == 0:
            return f"every expert fits: all {n_layer} MoE layers on the device"
        if self.n_slot == 0:
            return f"{self.n_dev} layers on the device, {rest} on the CPU (fewer slots than top-k)"
        return f"{self.n_dev} layers on the device, a cache of {self.n_slot} of {n_expert} slots for {rest}"


def engine_auto_split(
    n_layer: int,
    n_expert: int,
    n_used: int,
    expert_bytes: int,
    budget: int,
    t_rt_s: float,
    t_miss_s: float,
    hit_curve: HitCurve = ENGINE_HIT_CURVE,
) -> EngineSplit:
    """The engine's `--moe-cache-bytes auto`, operation for operation (common.cpp common_moe_choose_split).

    A cached layer costs a decode step one round trip (t_rt) and n_used * (1 - hit(slots)) misses of t_miss;
    a layer on the device neither. The n_dev of least cost, the larger on a tie; where no split leaves top-k
    slots, whole layers only. It is choose_layers_and_cache with the CPU's share of the misses, the prefetch
    and the prompt left out, on `hit_curve` (the shipped ESFT curve unless given): `predictions` prints what the
    full model predicts for its choice next to the full model's own."""
    layer = n_expert * expert_bytes
    if budget >= n_layer * layer:
        return EngineSplit(n_layer, 0, 0.0)
    max_dev = min(n_layer - 1, budget // layer)
    best: EngineSplit | None = None
    for n_dev in range(max_dev + 1):
        rest = n_layer - n_dev
        n_slot = min(n_expert, (budget - n_dev * layer) // (rest * expert_bytes))
        if n_slot < n_used:
            continue
        cost = rest * (t_rt_s + n_used * (1.0 - hit_curve.hit(n_slot / n_expert)) * t_miss_s)
        if best is None or cost <= best.cost_s * (1.0 + 1e-9):
            best = EngineSplit(n_dev, n_slot, cost)
    return best if best is not None else EngineSplit(max_dev, 0, 0.0)
