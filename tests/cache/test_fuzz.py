"""schemathesis against the cache-manager's own OpenAPI document: the real process, a real Redis, and
llama either up (the real patched llama-server, with routing counts in Redis) or unreachable; both are
states the service must serve in. Every operation gets schema-valid and schema-violating requests,
admin calls carry the admin token so that they run rather than stop at the 401. Any 5xx fails.

The counts (requests sent, 2xx, 4xx, 5xx, per operation) are printed and written to
`fuzz-counts.json` in the test's tmp dir. Bounded by MAX_EXAMPLES per operation and mode: about
1,200 requests and 20 s per llama state on 2 cores, well under a minute for both."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from moe_l2_contracts.schemas.errors import ServiceError
from moe_l2_gguf.index import load_index
from moe_l2_ops.supervisor import free_port

from ..conftest import ADMIN_HEADERS, LlamaServer
from .conftest import CacheManager, RedisServer
from .traffic import serve_mix

MAX_EXAMPLES = 150
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)


def _is_service_error(resp: requests.Response) -> bool:
    try:
        ServiceError.model_validate(resp.json())
    except ValueError:  # not JSON, or not the envelope (pydantic's ValidationError is a ValueError)
        return False
    return True


def fuzz(base_url: str, out: Path) -> dict:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    per_op: dict[str, Counter[str]] = {}
    server_errors: list[str] = []
    other_bodies: list[str] = []  # errors outside the services' one envelope (schemas/errors.py)
    session = requests.Session()

    def runner(strategy: st.SearchStrategy[schemathesis.Case], counts: Counter[str]) -> Callable[[], None]:
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy)
        def run(case: schemathesis.Case) -> None:
            resp = case.call(session=session, headers=dict(ADMIN_HEADERS), timeout=60)
            counts["sent"] += 1
            counts[f"{resp.status_code // 100}xx"] += 1
            if resp.status_code >= 500 and len(server_errors) < 20:
                server_errors.append(f"{case.as_curl_command()} -> {resp.status_code} {resp.text[:300]}")
            if resp.status_code >= 400 and not _is_service_error(resp) and len(other_bodies) < 20:
                other_bodies.append(f"{case.as_curl_command()} -> {resp.status_code} {resp.text[:300]}")

        return run

    operations = [result.ok() for result in schema.get_all_operations()]
    # the calls that change state first, then the reads of that state (stats, hot sets, metrics)
    operations.sort(key=lambda op: not (op.method.upper() == "POST" or "{" in op.path))
    for operation in operations:
        counts = per_op.setdefault(operation.label, Counter())
        for mode in MODES:
            try:
                runner(operation.as_strategy(generation_mode=mode), counts)()
            except Unsatisfiable:
                # no parameters, no body: there is no schema-violating request of this operation
                assert mode is GenerationMode.NEGATIVE, operation.label
    session.close()

    total = sum((c for c in per_op.values()), Counter())
    report = {
        "requests": total["sent"],
        "2xx": total["2xx"],
        "4xx": total["4xx"],
        "5xx": total["5xx"],
        "operations": {label: dict(c) for label, c in sorted(per_op.items())},
        "server_errors": server_errors,
        "not_service_errors": other_bodies,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"\ncache-manager fuzzing ({out}): {report['requests']} requests, {report['2xx']} 2xx, "
        f"{report['4xx']} 4xx, {report['5xx']} 5xx"
    )
    return report


@pytest.mark.parametrize("llama_state", [pytest.param("up", marks=pytest.mark.llama), "unreachable"])
def test_fuzz_the_cache_manager(
    llama_state: str,
    request: pytest.FixtureRequest,
    demo_model: Path,
    planted: dict,
    redis_server: RedisServer,
    start_cache_manager: Callable[..., CacheManager],
    tmp_path: Path,
) -> None:
    if llama_state == "up":
        llama: LlamaServer = request.getfixturevalue("cache_llama")
        llama_url = llama.url
        llama.routing(reset=True)
        serve_mix(llama_url, planted, per_domain=1)  # counts to pull: hot sets exist while fuzzing
    else:
        llama_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    expert_bytes = load_index(demo_model).max_expert_bytes
    manager = start_cache_manager(
        MOE_L2_MODEL_PATH=str(demo_model),
        MOE_L2_LLAMA_URL=llama_url,
        MOE_L2_REDIS_URL=redis_server.url,
        MOE_L2_CACHE_PULL_INTERVAL_S="0",
        MOE_L2_CACHE_DWELL_S="0",
        MOE_L2_CACHE_HOTSET_BYTES=str(6 * 8 * expert_bytes),
        MOE_L2_CACHE_POOL_BYTES=str(8 * 8 * expert_bytes),
    )
    if llama_state == "up":
        pulled = manager.client.post("/v1/pull", headers=ADMIN_HEADERS).json()
        assert pulled["ok"] and pulled["flushed"], pulled

    report = fuzz(str(manager.client.base_url), tmp_path / "fuzz-counts.json")

    assert report["5xx"] == 0, "\n".join(report["server_errors"])
    assert report["not_service_errors"] == [], "\n".join(report["not_service_errors"])
    # every operation was called; those with inputs got many requests (one without any is one request)
    assert all(op["sent"] >= 1 for op in report["operations"].values())
    assert report["requests"] >= 4 * MAX_EXAMPLES
    assert report["2xx"] > 0 and report["4xx"] > 0
    # the admin calls ran (the token was taken), they did not all stop at the 401
    for label in ("POST /v1/pull", "POST /v1/pool/evict"):
        assert report["operations"][label].get("2xx", 0) > 0, report["operations"][label]
    assert manager.client.get("/healthz").status_code == 200
