"""A moe-l2 Python service (gateway, predictor, cache-manager) as a process the supervisor runs;
llama_service.py is llama-server's counterpart."""

from __future__ import annotations

import sys

from moe_l2_ops.supervisor import ServiceSpec, http_ok


def python_service(
    name: str, module: str, port: int, env: dict[str, str] | None = None, *, required: bool = True
) -> ServiceSpec:
    """A moe-l2 Python service run as `python -m module`, healthy when GET /healthz answers 200."""
    base = f"http://127.0.0.1:{port}"
    return ServiceSpec(
        name=name,
        argv=[sys.executable, "-m", module],
        env=env or {},
        health=http_ok(f"{base}/healthz"),
        url=base,
        required=required,
    )
