"""The replica choice (moe_l2_proxy.routing) on its own: the ring, the domains' homes, the load bound."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from moe_l2_domains.known import known_domains
from moe_l2_proxy.routing import (
    AffinityRouting,
    HashRing,
    LeastLoadedRouting,
    RoundRobinRouting,
    assign_homes,
    load_bound,
)

DOMAINS = sorted(known_domains())


@dataclass
class Replica:
    key: str
    in_flight: int = 0


def replicas(n: int, base_port: int = 11436) -> list[Replica]:
    return [Replica(f"10.0.0.{i + 1}:{base_port}") for i in range(n)]


def test_the_taxonomy_has_the_eight_domains_these_figures_assume() -> None:
    assert len(DOMAINS) == 8


def test_a_ring_walk_names_every_replica_once_whatever_the_order_they_were_given_in() -> None:
    keys = [r.key for r in replicas(5)]
    walk = HashRing(keys).walk("codegen")
    assert sorted(walk) == sorted(keys)
    assert HashRing(reversed(keys)).walk("codegen") == walk
    assert HashRing([]).walk("codegen") == []


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_every_replica_is_home_to_the_same_number_of_domains_give_or_take_one(n: int) -> None:
    ring = HashRing(r.key for r in replicas(n))
    homes = assign_homes(DOMAINS, ring)
    assert set(homes) == set(DOMAINS)
    per_replica = Counter(preference[0] for preference in homes.values())
    assert max(per_replica.values()) - min(per_replica.values(), default=0) <= 1
    assert len(per_replica) == min(n, len(DOMAINS))
    for preference in homes.values():
        assert sorted(preference) == sorted(r.key for r in replicas(n))


def test_plain_hashing_would_not_balance_the_homes_on_these_addresses() -> None:
    # the reason for assign_homes: over many replica address pairs, the ring alone often puts 6+
    # of the 8 domains on one replica
    lumpy = 0
    for port in range(20000, 20100):
        ring = HashRing(r.key for r in replicas(2, port))
        lumpy += max(Counter(ring.walk(d)[0] for d in DOMAINS).values()) >= 6
        assert max(Counter(p[0] for p in assign_homes(DOMAINS, ring).values()).values()) == 4
    assert lumpy >= 20


def test_a_dead_replicas_domains_move_and_come_back_when_it_returns() -> None:
    pool = replicas(3)
    routing = AffinityRouting(DOMAINS, epsilon=0.25)
    before = {d: routing.home(d, pool) for d in DOMAINS}
    dead = pool[0].key
    survivors = pool[1:]
    during = {d: routing.home(d, survivors) for d in DOMAINS}
    assert all(home != dead for home in during.values())
    assert {d for d in DOMAINS if before[d] == dead} and all(during[d] in {r.key for r in survivors} for d in DOMAINS)
    assert {d: routing.home(d, pool) for d in DOMAINS} == before


def test_a_domain_goes_home_while_home_is_under_the_bound() -> None:
    pool = replicas(2)
    routing = AffinityRouting(DOMAINS, epsilon=0.25)
    for domain in DOMAINS:
        home = routing.home(domain, pool)
        ordered, outcome = routing.order(domain, pool)
        assert (ordered[0].key, outcome) == (home, "home")
        assert len(ordered) == 2


def test_a_request_spills_to_the_next_replica_when_home_is_full() -> None:
    pool = replicas(2)
    routing = AffinityRouting(DOMAINS, epsilon=0.25)
    domain = DOMAINS[0]
    home = next(r for r in pool if r.key == routing.home(domain, pool))
    other = next(r for r in pool if r is not home)
    home.in_flight, other.in_flight = 5, 2  # bound after one more: ceil(1.25 * 8 / 2) = 5
    ordered, outcome = routing.order(domain, pool)
    assert (ordered[0], outcome) == (other, "spill")
    assert ordered[1] is home  # still the fallback if the other fails


def test_no_replica_is_ever_given_a_request_above_the_bound() -> None:
    rng = random.Random(7)
    routing = AffinityRouting(DOMAINS, epsilon=0.25)
    for _ in range(2000):
        pool = replicas(rng.randint(1, 6))
        for r in pool:
            r.in_flight = rng.randint(0, 12)
        bound = load_bound(pool, 0.25)
        ordered, _ = routing.order(rng.choice(DOMAINS), pool)
        assert ordered[0].in_flight + 1 <= bound


def test_a_request_without_a_domain_goes_to_the_least_loaded() -> None:
    pool = replicas(3)
    pool[0].in_flight, pool[1].in_flight, pool[2].in_flight = 4, 1, 3
    ordered, outcome = AffinityRouting(DOMAINS, 0.25).order(None, pool)
    assert (ordered[0], outcome) == (pool[1], "least_loaded")


def simulate(policy: AffinityRouting | RoundRobinRouting | LeastLoadedRouting, seed: int) -> tuple[float, float, int]:
    """8 concurrent clients, requests of the 8 domains at random with random lengths: (share of the
    requests each replica served from its busiest domains' point of view, max/mean of time-averaged
    in-flight, distinct domains per replica)."""
    rng = random.Random(seed)
    pool = replicas(2)
    running: list[tuple[float, Replica]] = []
    now = 0.0
    area = Counter[str]()
    seen: dict[str, set[str]] = {r.key: set() for r in pool}
    home_share = 0
    n = 4000
    for _ in range(n):
        if len(running) == 8:
            running.sort(key=lambda x: x[0])
            end, done = running.pop(0)
            for r in pool:
                area[r.key] += r.in_flight * (end - now)
            now = end
            done.in_flight -= 1
        domain = rng.choice(DOMAINS)
        ordered, outcome = policy.order(domain, pool)
        chosen = ordered[0]
        chosen.in_flight += 1
        seen[chosen.key].add(domain)
        home_share += outcome == "home"
        running.append((now + rng.uniform(0.5, 1.5), chosen))
    loads = [area[r.key] for r in pool]
    return home_share / n, max(loads) / (sum(loads) / len(loads)), max(len(s) for s in seen.values())


def test_under_full_load_affinity_keeps_most_requests_home_within_the_bound() -> None:
    home_share, max_over_mean, _ = simulate(AffinityRouting(DOMAINS, 0.25), seed=1)
    assert home_share >= 0.75
    assert max_over_mean <= 1.25
    # round-robin balances as well, but every replica sees every domain
    _, rr_balance, rr_domains = simulate(RoundRobinRouting(), seed=1)
    assert rr_balance <= 1.25 and rr_domains == 8


def test_round_robin_takes_turns_and_least_loaded_breaks_ties_by_turns() -> None:
    pool = replicas(3)
    rr = RoundRobinRouting()
    assert [rr.order(None, pool)[0][0].key for _ in range(4)] == [pool[0].key, pool[1].key, pool[2].key, pool[0].key]
    least = LeastLoadedRouting()
    assert len({least.order("codegen", pool)[0][0].key for _ in range(3)}) == 3
    pool[2].in_flight = -1
    assert least.order("codegen", pool)[0][0] is pool[2]
