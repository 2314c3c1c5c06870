"""bench/affinity_replay.py on the real ESFT routing: the gateway's policies, replayed."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benches import load_bench

bench = load_bench("affinity_replay")
cache_policies = load_bench("cache_policies")


def test_affinity_keeps_domains_apart_and_holds_more_of_their_experts(tmp_path: Path) -> None:
    out = tmp_path / "affinity.json"
    assert bench.main(["--replicas", "4", "--concurrency", "16", "--requests", "200", "--out", str(out)]) == 0
    report = json.loads(out.read_text())["policies"]
    affinity, round_robin = report["affinity"], report["round_robin"]
    # round-robin gives every replica every domain; affinity a home to each (spills aside)
    assert all(len(d) == 4 for d in round_robin["domains_per_replica"])
    assert all(len(d) < 4 for d in affinity["domains_per_replica"])
    for budget, rate in affinity["hit_rate_by_budget"].items():
        assert 0 < round_robin["hit_rate_by_budget"][budget] < rate < 1
    assert sum(affinity["requests_per_replica"]) == sum(round_robin["requests_per_replica"]) == 200


def test_the_replicas_see_the_load_the_policy_saw() -> None:
    requests = [(i, "law" if i % 2 else "intent", 10) for i in range(40)]
    policy = bench.RoundRobinRouting()
    assert bench.route(policy, requests, n_replicas=2, concurrency=4) == [i % 2 for i in range(40)]
    least = bench.route(bench.LeastLoadedRouting(), [(0, "law", 100), *requests], 2, 2)
    assert least[0] != least[1]  # the long first request keeps its replica busy
