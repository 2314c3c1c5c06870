"""Expert-affinity routing on real routing: which llama replica each request of the ESFT traces goes
to under each gateway policy, and how much of its experts that replica's hot set holds.

The traces (bench/data/routing/deepseek-ai__ESFT: DeepSeek-V2-Lite, 64 routed experts, top-6,
26 MoE layers, 4 domains) are split by sequence: even sequences build each domain's table, odd ones
are the requests. The requests arrive with `--concurrency` in flight, each lasting its token count
(a random order, `--seed`), and the gateway's own policies (moe_l2_proxy.routing, affinity with
ε = `--epsilon`, round-robin, least-loaded) choose a replica with the in-flight counts they would
see. Each replica's hot set is what its cache-manager in the traffic scope would hold for the whole
run: the domains' tables mixed by that replica's share of the requests (moe_l2_cache.hotset.mix_tables),
`--budgets` experts per layer. A request's hit rate is the share of its tokens' expert selections
inside its replica's hot set, per layer, as llama's `moe_hot_hits` counts them.

Modelled, not measured: the arrival process and a run-long mix (the service's mix decays, with a
60 s half-life). Measured: the routing, the tables, the selections.

    .venv/bin/python bench/affinity_replay.py --out bench-results/affinity_replay.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own modules

from cache_policies import Trace, load_esft
from data_paths import routing_data

from moe_l2_cache.hotset import mix_tables, select_hot_set
from moe_l2_proxy.routing import AffinityRouting, LeastLoadedRouting, RoundRobinRouting, RoutingPolicy


@dataclass
class Replica:
    key: str
    in_flight: int = 0


def domain_tables(trace: Trace, seqs: set[int]) -> dict[str, dict[int, dict[int, float]]]:
    """Per domain, per layer, each expert's selection count over the given sequences."""
    tables: dict[str, dict[int, dict[int, float]]] = {}
    mask = np.isin(trace.seq, list(seqs))
    for domain in sorted(set(trace.domain[mask])):
        rows = trace.experts[mask & (trace.domain == domain)]
        table = tables.setdefault(str(domain), {})
        for layer in range(rows.shape[1]):
            ids, counts = np.unique(rows[:, layer, :], return_counts=True)
            table[layer] = {int(e): float(c) for e, c in zip(ids, counts, strict=True)}
    return tables


def route(policy: RoutingPolicy, requests: list[tuple[int, str, int]], n_replicas: int, concurrency: int) -> list[int]:
    """The replica each request goes to, with `concurrency` requests in flight, each lasting its length."""
    replicas = [Replica(f"10.0.0.{i + 1}:11436") for i in range(n_replicas)]
    index = {r.key: i for i, r in enumerate(replicas)}
    running: list[tuple[float, int]] = []  # (end time, replica)
    now = 0.0
    chosen: list[int] = []
    for _, domain, length in requests:
        if len(running) == concurrency:
            now, done = heapq.heappop(running)
            replicas[done].in_flight -= 1
        ordered, _ = policy.order(domain, replicas)
        target = index[ordered[0].key]
        replicas[target].in_flight += 1
        heapq.heappush(running, (now + length, target))
        chosen.append(target)
    return chosen


def hit_rate(trace: Trace, seq: int, hot: dict[int, set[int]]) -> tuple[int, int]:
    rows = trace.experts[trace.seq == seq]
    hits = sum(int(np.isin(rows[:, layer, :], list(hot.get(layer, ()))).sum()) for layer in range(rows.shape[1]))
    return hits, rows.shape[0] * rows.shape[1] * rows.shape[2]


def replay(trace: Trace, policies: dict[str, RoutingPolicy], budgets: list[int], args: argparse.Namespace) -> dict:
    seqs = sorted(set(trace.seq.tolist()))
    train, test = set(seqs[0::2]), seqs[1::2]
    tables = domain_tables(trace, train)
    rng = random.Random(args.seed)
    requests = []
    for seq in test:
        where = trace.seq == seq
        requests.append((seq, str(trace.domain[where][0]), int(where.sum())))
    requests = [requests[rng.randrange(len(requests))] for _ in range(args.requests)]
    unit = {layer: 1 for layer in range(trace.experts.shape[1])}  # budgets in experts per layer
    out: dict[str, dict] = {}
    for name, policy in policies.items():
        chosen = route(policy, requests, args.replicas, args.concurrency)
        mixes = [
            Counter(d for (_, d, _), r in zip(requests, chosen, strict=True) if r == i) for i in range(args.replicas)
        ]
        by_budget = {}
        for budget in budgets:
            hot_sets = []
            for mix in mixes:
                total = sum(mix.values()) or 1
                table = mix_tables(tables, {d: n / total for d, n in mix.items()})
                hot_sets.append({k: set(v) for k, v in select_hot_set(table, unit, budget * len(unit)).layers.items()})
            hits = seen = 0
            for (seq, _, _), replica in zip(requests, chosen, strict=True):
                h, n = hit_rate(trace, seq, hot_sets[replica])
                hits, seen = hits + h, seen + n
            by_budget[str(budget)] = round(hits / seen, 4)
        out[name] = {
            "hit_rate_by_budget": by_budget,
            "domains_per_replica": [dict(sorted(m.items())) for m in mixes],
            "requests_per_replica": [sum(m.values()) for m in mixes],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--epsilon", type=float, default=0.25)
    parser.add_argument("--budgets", default="8,16,24,32", help="hot-set sizes, experts per layer (of 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    trace = load_esft(routing_data())
    domains = sorted(set(trace.domain.tolist()))
    policies: dict[str, RoutingPolicy] = {
        "affinity": AffinityRouting(domains, args.epsilon),
        "round_robin": RoundRobinRouting(),
        "least_loaded": LeastLoadedRouting(),
    }
    budgets = [int(b) for b in args.budgets.split(",")]
    results = replay(trace, policies, budgets, args)
    report = {"trace": "esft", "replicas": args.replicas, "concurrency": args.concurrency, "policies": results}
    print(f"{'budget':>8}" + "".join(f"{name:>14}" for name in results) + f"{'affinity-rr':>14}")
    for budget in budgets:
        rates = [results[name]["hit_rate_by_budget"][str(budget)] for name in results]
        gain = (
            results["affinity"]["hit_rate_by_budget"][str(budget)]
            - results["round_robin"]["hit_rate_by_budget"][str(budget)]
        )
        print(f"{budget:>8}" + "".join(f"{r:>14.3f}" for r in rates) + f"{gain * 100:>+13.1f}p")
    for name, result in results.items():
        print(f"{name}: requests per replica {result['requests_per_replica']}, domains {result['domains_per_replica']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
