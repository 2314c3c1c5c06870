"""moe-l2 cache-manager: the expert index, the expert pool (mlock/madvise/fadvise/mincore), the routing
flywheel in Redis and the hot sets pushed to llama. `python -m moe_l2_cache` serves it on :11438."""
