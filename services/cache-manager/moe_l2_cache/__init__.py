"""moe-l2 cache-manager (expert index, pool, flywheel). Not built yet: `python -m` reports that and exits."""
