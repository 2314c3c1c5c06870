"""A layer's misses split between copies and the CPU threads (`choose_split`): the engine's `auto` mirrors it
per layer and micro-batch, and the cost model's `e+cpu` rows use it.
"""

from __future__ import annotations

from moe_l2_placement.machine import CPU_TOKEN_COST


def split_time(m: int, c: int, t_copy_s: float, t_cpu_s: float, t_return_s: float = 0.0) -> float:
    """A layer's critical time with m misses, c of them on the CPU: max(copies, CPU)."""
    return max((m - c) * t_copy_s, c * t_cpu_s + (t_return_s if c > 0 else 0.0))


def choose_split(
    n_miss: int,
    tokens_per_miss: float,
    expert_bytes: int,
    h2d_gbps: float,
    cpu_gbps: float,
    *,
    cpu_token_cost: float = CPU_TOKEN_COST,
    t_copy_s: float | None = None,
    t_cpu_s: float | None = None,
    t_return_s: float = 0.0,
) -> int:
    """How many of a layer's `n_miss` missing experts the CPU computes; the others are copied.

    The arithmetic (the engine's `auto` mirrors it, per layer and micro-batch):

        t_copy = expert_bytes / (h2d_gbps * 1e9)                 one miss copied (the one-expert rate)
        t_cpu  = expert_bytes / (cpu_gbps * 1e9) * (1 + cpu_token_cost * (tokens_per_miss - 1))
        time(c) = max((n_miss - c) * t_copy, c * t_cpu + (c > 0 ? t_return : 0))
        return the c in 0..n_miss with the least time(c), the smaller c on a tie (a copied miss is also
        admitted to the cache at once)

    which is c = round(n_miss * t_copy / (t_copy + t_cpu)) give or take one. t_copy_s / t_cpu_s, when
    given, replace the first two lines (the model passes the copy latency in). A very slow link (t_copy
    >> t_cpu) puts every miss on the CPU; a very slow CPU, none.
    """
    if n_miss <= 0:
        return 0
    if t_copy_s is None:
        t_copy_s = expert_bytes / (h2d_gbps * 1e9)
    if t_cpu_s is None:
        t_cpu_s = expert_bytes / (cpu_gbps * 1e9) * (1 + cpu_token_cost * max(0.0, tokens_per_miss - 1))
    best, best_t = 0, split_time(n_miss, 0, t_copy_s, t_cpu_s, t_return_s)
    for c in range(1, n_miss + 1):
        t = split_time(n_miss, c, t_copy_s, t_cpu_s, t_return_s)
        if t < best_t - 1e-15:
            best, best_t = c, t
    return best
