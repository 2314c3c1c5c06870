"""Tests of the expert-cache policies (moe_l2_cache.policy) and of the policy study."""
