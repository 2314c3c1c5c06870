"""Which llama replica serves a request: expert affinity (the default), round-robin, or least loaded.

Affinity is consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018) over the
request's domain: a domain keeps going to the replica whose expert cache already holds its experts,
unless that replica has more than (1+ε) x the mean in-flight requests, when the request spills to
the next replica on the domain's ring walk. A hot domain thus overflows to a second replica
instead of queueing, and no replica ever takes a request above the bound.

Two levels, because the domains are few. Hashing 8 domains onto 2 replicas puts 4 on each only
27% of the time (C(8,4)/2^8); 6 on one replica and 2 on the other is as likely, and then the
bounded loads make the crowded replica spill all the time, so both end up holding most domains.
So the known domains are first given *homes* by the same rule applied to domains (each replica
takes at most ceil(domains / replicas)), walked in an order that does not depend on the replicas:
every replica is home to the same number of domains, and a replica that joins or leaves moves
only the domains the ring walk moves (a dead replica's domains go to their next replica, and come
back when it returns). A domain outside the known set (none reach here today) just takes its
ring walk. Requests without a domain go to the least loaded replica.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Literal, Protocol, TypeVar

Outcome = Literal["home", "spill", "least_loaded", "round_robin"]
PolicyName = Literal["affinity", "round_robin", "least_loaded"]

# points per replica on the ring: enough that a replica's share of the ring is even to a few percent
VIRTUAL_NODES = 64


class Loaded(Protocol):
    key: str  # stable name of the replica on the ring (host:port)
    in_flight: int


R = TypeVar("R", bound=Loaded)


def ring_point(text: str) -> int:
    # blake2b, not hash(): the same on every gateway process, so replicas of the gateway agree
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, keys: Iterable[str], vnodes: int = VIRTUAL_NODES) -> None:
        points = sorted((ring_point(f"{key}#{i}"), key) for key in set(keys) for i in range(vnodes))
        self._points = [p for p, _ in points]
        self._keys = [k for _, k in points]
        self.n_keys = len(set(self._keys))

    def walk(self, item: str) -> list[str]:
        """Every key once, clockwise from the item's point: its preference order."""
        if not self._points:
            return []
        start = bisect_left(self._points, ring_point(item)) % len(self._points)
        order: list[str] = []
        for key in itertools.chain(self._keys[start:], self._keys[:start]):
            if key not in order:
                order.append(key)
                if len(order) == self.n_keys:
                    break
        return order


def assign_homes(domains: Iterable[str], ring: HashRing) -> dict[str, list[str]]:
    """domain -> its replicas in preference order, home first; at most ceil(domains / replicas) homes each."""
    ordered = sorted(set(domains), key=ring_point)  # the same order whatever the replicas
    if not ordered or not ring.n_keys:
        return {}
    cap = math.ceil(len(ordered) / ring.n_keys)
    homed: Counter[str] = Counter()
    homes: dict[str, list[str]] = {}
    for domain in ordered:
        walk = ring.walk(domain)
        home = next(key for key in walk if homed[key] < cap)
        homed[home] += 1
        homes[domain] = [home, *(key for key in walk if key != home)]
    return homes


def load_bound(replicas: Sequence[Loaded], epsilon: float) -> int:
    """The most requests a replica may have in flight after taking one more: ceil((1+ε) x mean).
    Always reachable: some replica holds at most the mean before the new request."""
    total = sum(r.in_flight for r in replicas) + 1
    return max(1, math.ceil((1 + epsilon) * total / len(replicas)))


class AffinityRouting:
    name: PolicyName = "affinity"

    def __init__(self, domains: Iterable[str], epsilon: float) -> None:
        self.domains = frozenset(domains)
        self.epsilon = epsilon
        self._keys: tuple[str, ...] = ()
        self._ring = HashRing(())
        self._homes: dict[str, list[str]] = {}
        self._least = LeastLoadedRouting()

    def _update(self, keys: tuple[str, ...]) -> None:
        if keys != self._keys:
            self._keys = keys
            self._ring = HashRing(keys)
            self._homes = assign_homes(self.domains, self._ring)

    def home(self, domain: str, replicas: Sequence[R]) -> str | None:
        """The key of the replica the domain sticks to among these replicas."""
        self._update(tuple(sorted(r.key for r in replicas)))
        preference = self._homes.get(domain) or self._ring.walk(domain)
        return preference[0] if preference else None

    def order(self, domain: str | None, replicas: Sequence[R]) -> tuple[list[R], Outcome]:
        if not replicas:
            return [], "home"
        if domain is None:
            return self._least.order(None, replicas)
        self._update(tuple(sorted(r.key for r in replicas)))
        by_key = {r.key: r for r in replicas}
        preference = [by_key[key] for key in self._homes.get(domain) or self._ring.walk(domain)]
        bound = load_bound(replicas, self.epsilon)
        chosen = next(i for i, r in enumerate(preference) if r.in_flight + 1 <= bound)
        ordered = [preference[chosen], *preference[:chosen], *preference[chosen + 1 :]]
        return ordered, "home" if chosen == 0 else "spill"


class RoundRobinRouting:
    name: PolicyName = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def order(self, domain: str | None, replicas: Sequence[R]) -> tuple[list[R], Outcome]:
        if not replicas:
            return [], "round_robin"
        start = self._next % len(replicas)
        self._next = start + 1
        return [*replicas[start:], *replicas[:start]], "round_robin"


class LeastLoadedRouting:
    name: PolicyName = "least_loaded"

    def __init__(self) -> None:
        self._rotation = RoundRobinRouting()  # breaks ties, so an idle pool is still shared

    def order(self, domain: str | None, replicas: Sequence[R]) -> tuple[list[R], Outcome]:
        rotated, _ = self._rotation.order(domain, replicas)
        return sorted(rotated, key=lambda r: r.in_flight), "least_loaded"  # sorted() is stable


RoutingPolicy = AffinityRouting | RoundRobinRouting | LeastLoadedRouting


def routing_policy(name: PolicyName, domains: Iterable[str], epsilon: float) -> RoutingPolicy:
    if name == "affinity":
        return AffinityRouting(domains, epsilon)
    if name == "round_robin":
        return RoundRobinRouting()
    return LeastLoadedRouting()
