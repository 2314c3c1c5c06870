"""The operations layer: the `moe-l2` CLI, `up` and its supervisor, `doctor`, `stats`.

The top layer: it may import every service (to build, configure and start them); nothing imports it.
"""
