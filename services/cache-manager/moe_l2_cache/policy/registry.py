"""The product's policies by name, and the default the study chose (its offline baselines: bench/study_policies.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from moe_l2_cache.policy import hybrid, online, prefetch
from moe_l2_cache.policy.base import ExpertCachePolicy, PolicyError
from moe_l2_cache.policy.hybrid import DomainPriorHybrid
from moe_l2_cache.policy.online import LFRU, LFU, LRU
from moe_l2_cache.policy.prefetch import CrossLayerPrefetch
from moe_l2_cache.policy.profile import RoutingProfile

# The policy docs/cache-policy-study.md chooses (tests/policy checks that the two agree). Without
# transition tables (the cache-manager's host pool, which sees no per-token routing) it is `hybrid`.
DEFAULT_POLICY = "hybrid_threshold_prefetch"


Factory = Callable[[int, int, int, Mapping[str, Any]], ExpertCachePolicy]


def _need(profile: Mapping[str, Any], key: str, policy: str) -> Any:
    value = profile.get(key)
    if value is None:
        raise PolicyError(f"policy {policy!r} needs a profile with {key!r} (see moe_l2_cache.policy.profile)")
    return value


def _hybrid(
    n_layer: int, n_expert: int, capacity: int, profile: Mapping[str, Any], *, admission: bool = False
) -> DomainPriorHybrid:
    return DomainPriorHybrid(
        n_layer,
        n_expert,
        capacity,
        profile.get("global_freq"),
        profile.get("domain_freq"),
        half_life=profile.get("half_life", hybrid.HALF_LIFE),
        prior_weight=profile.get("prior_weight", hybrid.PRIOR_WEIGHT),
        fill_weight=profile.get("fill_weight", hybrid.FILL_WEIGHT),
        top_k=profile.get("top_k"),
        admission=admission,
        admit_margin=profile.get("admit_margin", hybrid.ADMIT_MARGIN),
    )


def _threshold_prefetch(
    n_layer: int, n_expert: int, capacity: int, p: Mapping[str, Any]
) -> CrossLayerPrefetch | DomainPriorHybrid:
    # Without transitions (the cache-manager's pool learns none) nothing would be prefetched: the
    # policy is the hybrid, and its name says so (a pool reporting the prefetch's name misled).
    if p.get("transitions") is None and not p.get("domain_transitions"):
        return _hybrid(n_layer, n_expert, capacity, p)
    return CrossLayerPrefetch(
        _hybrid(n_layer, n_expert, capacity, p),
        p.get("transitions"),
        p.get("n_predict"),
        min_lift=p.get("min_lift", prefetch.MIN_LIFT),
        domain_transitions=p.get("domain_transitions"),
        name="hybrid_threshold_prefetch",
    )


_FACTORIES: dict[str, Factory] = {
    "lru": lambda n_layer, n_expert, capacity, p: LRU(n_layer, n_expert, capacity),
    "lfu": lambda n_layer, n_expert, capacity, p: LFU(n_layer, n_expert, capacity),
    "lfru": lambda n_layer, n_expert, capacity, p: LFRU(
        n_layer, n_expert, capacity, p.get("half_life", online.HALF_LIFE)
    ),
    "hybrid": _hybrid,
    "hybrid_admit": lambda n_layer, n_expert, capacity, p: _hybrid(n_layer, n_expert, capacity, p, admission=True),
    "xlayer_prefetch": lambda n_layer, n_expert, capacity, p: CrossLayerPrefetch(
        LRU(n_layer, n_expert, capacity), _need(p, "transitions", "xlayer_prefetch"), p.get("n_predict")
    ),
    "hybrid_prefetch": lambda n_layer, n_expert, capacity, p: CrossLayerPrefetch(
        _hybrid(n_layer, n_expert, capacity, p), _need(p, "transitions", "hybrid_prefetch"), p.get("n_predict")
    ),
    "hybrid_threshold_prefetch": _threshold_prefetch,
}

POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def make_policy(name: str, n_layer: int, n_expert: int, capacity: int, **profile: Any) -> ExpertCachePolicy:
    """A fresh policy.

    `profile` holds what profiled policies need: `global_freq`, `domain_freq`, `transitions`, `top_k`
    and `domain_transitions` (from `RoutingProfile.as_kwargs()`), knobs (`half_life`, `prior_weight`,
    `fill_weight`, `admit_margin`, `n_predict`, `min_lift`). The offline study's policies (Belady,
    static sets) are bench/study_policies.py's.
    Keys a policy does not use are ignored, so one profile serves every policy.
    """
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise PolicyError(f"unknown cache policy {name!r}; known: {', '.join(POLICY_NAMES)}") from None
    return factory(n_layer, n_expert, capacity, profile)


def update_priors(policy: ExpertCachePolicy, profile: RoutingProfile) -> bool:
    """Hands a fresh profile (e.g. `profile_from_counts` of the flywheel's counts) to a policy that takes
    priors: the hybrid, alone or under prefetch. Returns False for a policy without priors."""
    target = policy.inner if isinstance(policy, CrossLayerPrefetch) else policy
    if isinstance(target, DomainPriorHybrid):
        target.set_priors(profile.global_freq, profile.domain_freq)
        return True
    return False
