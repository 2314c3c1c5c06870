"""Issue 46: faults under load, the short version of bench/faults.py (about a minute and a half).

The real stack (`moe-l2 up --llama-replicas 2`: Redis with its AOF, two patched llama-servers on the
demo model, their cache-managers, the predictor, the gateway) under 16 concurrent clients of mixed
traffic (OpenAI and Ollama, streaming and blocking, some leaving mid-stream), while each fault hits
once: SIGKILL to the predictor, a cache-manager, Redis, one llama replica of two and the gateway, and
SIGTERM to the gateway (its drain); at the end SIGTERM to `moe-l2 up` itself with traffic still running.

What must hold: no request fails badly (another 5xx, a stream cut without an error event, a hang, an
answer carrying another request's nonce), no flywheel count Redis acknowledged is lost, and every
fault is repaired (generous bounds: the figures against the issue's targets are the bench's report).
A request in flight inside a gateway killed with SIGKILL is counted apart: no process can answer it.

It catches, each shown by planting it (docs/faults.md): the gateway not retrying a request on the other
llama replica when the first failed before its first byte (503s without Retry-After, 502s), the
gateway's drain removed (streams cut by its SIGTERM), Redis without its AOF (counts lost with Redis).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.faults import FAULTS, SoakConfig, run_soak

pytestmark = pytest.mark.slow

# Recovery far above the targets (30 s, 10 s for the gateway): on a shared 2-core machine the point
# here is that the supervisor repairs each fault at all; the bench reports the figures.
RECOVERY_BOUND_S = 90.0


def test_faults_under_load_fail_nothing_badly_and_lose_no_counts(llama_binary: Path, tmp_path: Path) -> None:
    config = SoakConfig(
        duration_s=60.0, clients=16, faults=FAULTS, warmup_s=8.0, llama_server=llama_binary, state_dir=tmp_path
    )
    report = run_soak(config)
    print(report.table())
    summary = json.dumps([f.__dict__ for f in report.faults], default=str)[:6000]
    faults = {f.fault: f for f in report.faults}
    assert set(FAULTS) | {"stack-stop"} <= set(faults), summary

    bad = {f.fault: (f.bad, f.bad_examples) for f in report.faults if f.bad}
    assert not bad, f"requests failed badly: {bad}"
    lost = {f.fault: f.counts_lost for f in report.faults if any(f.counts_lost.values())}
    assert not lost, f"flywheel counts Redis acknowledged were lost: {lost}"
    assert report.flywheel["lost_tokens"] == 0 and report.flywheel["lost_activations"] == 0, report.flywheel
    assert report.flywheel["pulled_tokens"] > 0, report.flywheel

    for name in FAULTS:
        fault = faults[name]
        assert fault.recovery_s is not None and fault.recovery_s <= RECOVERY_BOUND_S, (name, fault.problems)
        assert fault.full > 0, f"nothing answered in full around {name}: {fault}"
    # traffic really was mixed and really hit the faults: clean refusals and client cuts happened
    assert sum(f.client_cut for f in report.faults) > 0
    assert report.stack_exit == 0, report.up_log_tail
