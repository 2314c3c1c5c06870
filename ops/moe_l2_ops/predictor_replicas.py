"""The predictor's place in `moe-l2 up`: MOE_L2_PREDICTOR_REPLICAS processes (default 1).

Replica i listens on MOE_L2_PREDICTOR_PORT + 100·i (11437, 11537, 11637, ...), clear of the other
services' ports; `predictor_urls()` is the matching MOE_L2_PREDICTOR_URLS for the gateway. A
replica is healthy once its cheap tiers answer (the semantic tier loads after that, in the
background); the very first start fits their models first (the others wait on the cache's file
lock), hence the longer start timeout, kept generous for a slow disk or a large taxonomy. The
stack keeps serving without the predictor (the gateway falls back to its keyword tier), so a
replica in a crash loop is given up without stopping the others.
"""

from __future__ import annotations

import os

from moe_l2_contracts.services import PREDICTOR
from moe_l2_ops.python_service import python_service
from moe_l2_ops.supervisor import ServiceSpec

DEFAULT_PORT = PREDICTOR.port
PORT_STEP = 100
START_TIMEOUT_S = 600.0


def replica_count() -> int:
    raw = os.environ.get("MOE_L2_PREDICTOR_REPLICAS", "1")
    try:
        count = int(raw)
    except ValueError as exc:
        raise ValueError(f"MOE_L2_PREDICTOR_REPLICAS={raw!r} is not a number") from exc
    if not 1 <= count <= 32:
        raise ValueError(f"MOE_L2_PREDICTOR_REPLICAS={count} must be between 1 and 32")
    return count


def replica_ports() -> list[int]:
    base = int(os.environ.get(PREDICTOR.port_env, DEFAULT_PORT))
    return [base + PORT_STEP * i for i in range(replica_count())]


def predictor_urls() -> str:
    """MOE_L2_PREDICTOR_URLS for the gateway: every replica `moe-l2 up` starts."""
    return ",".join(f"http://127.0.0.1:{port}" for port in replica_ports())


def predictor_services() -> list[ServiceSpec]:
    ports = replica_ports()
    specs = []
    for i, port in enumerate(ports):
        name = "predictor" if len(ports) == 1 else f"predictor-{i + 1}"
        spec = python_service(name, "moe_l2_predictor", port, {PREDICTOR.port_env: str(port)}, required=False)
        spec.start_timeout_s = START_TIMEOUT_S
        specs.append(spec)
    return specs
