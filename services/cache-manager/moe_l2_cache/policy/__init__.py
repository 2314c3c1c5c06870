"""Expert-cache policies: which experts stay resident per MoE layer, chosen by held-out measurement.

The cache-manager's hot-set builder and expert pool use `make_policy(DEFAULT_POLICY, ...)`; the
study that chose the default is docs/cache-policy-study.md (bench/cache_policies.py measures it).

    policy = make_policy(DEFAULT_POLICY, n_layer, n_expert, capacity, **profile.as_kwargs())
    policy.on_domain("codegen")                 # a request starts
    hits = policy.access(layer, [3, 17, 41])    # one token's experts at one layer
    policy.resident(layer)                      # what to keep (pin / cache) at that layer
    update_priors(policy, profile_from_counts(counts, n_layer, n_expert))  # flywheel tables

The default prefetches across layers only with transition tables (`fit_profile` on per-token traces);
without them, as in the cache-manager's host pool, it is the `hybrid` demand policy.
"""

from __future__ import annotations

from moe_l2_cache.policy.base import ExpertCachePolicy, PolicyError, TablePolicy
from moe_l2_cache.policy.hybrid import DomainPriorHybrid
from moe_l2_cache.policy.online import LFRU, LFU, LRU
from moe_l2_cache.policy.prefetch import CrossLayerPrefetch, PrefetchStats
from moe_l2_cache.policy.profile import RoutingProfile, fit_profile, freq_from_counts, profile_from_counts
from moe_l2_cache.policy.registry import DEFAULT_POLICY, POLICY_NAMES, make_policy, update_priors

__all__ = [
    "DEFAULT_POLICY",
    "LFRU",
    "LFU",
    "LRU",
    "POLICY_NAMES",
    "CrossLayerPrefetch",
    "DomainPriorHybrid",
    "ExpertCachePolicy",
    "PolicyError",
    "PrefetchStats",
    "RoutingProfile",
    "TablePolicy",
    "fit_profile",
    "freq_from_counts",
    "make_policy",
    "profile_from_counts",
    "update_priors",
]
