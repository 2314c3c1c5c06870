"""Entry point of a service that is not built yet: say so plainly instead of pretending to serve."""

from __future__ import annotations

import sys


def not_built(service: str) -> int:
    print(
        f"error: the moe-l2 {service} service is not built yet; its package only reserves its place "
        "in the stack (see README, Status)",
        file=sys.stderr,
    )
    return 2
