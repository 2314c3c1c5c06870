"""Fuzzing against real processes: a predictor, and a gateway in front of the real llama-server on the
demo model (with that predictor behind it). Every answer is counted per service; the counts are
printed at the end of the run and written to `fuzz-counts.json` under pytest's base temp folder
(and to $MOE_L2_FUZZ_REPORT when set), so a CI log shows requests sent, 4xx and 5xx per service.

Bounded for CI: MOE_L2_FUZZ_EXAMPLES (examples per operation, default below) keeps each service's
run to about a minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import schemathesis

from moe_l2_ops.supervisor import ServiceSpec, Supervisor, free_port, http_ok
from tests.conftest import LlamaServer

REPORT_ENV = "MOE_L2_FUZZ_REPORT"


def examples(default: int) -> int:
    return int(os.environ.get("MOE_L2_FUZZ_EXAMPLES", default))


class FuzzCounts:
    """Requests sent and answers by status class, per service."""

    def __init__(self) -> None:
        self.services: dict[str, Counter[str]] = {}

    def record(self, service: str, status: int) -> None:
        counts = self.services.setdefault(service, Counter())
        counts["requests"] += 1
        counts[f"{status // 100}xx"] += 1
        counts[str(status)] += 1

    def table(self) -> dict[str, dict[str, int]]:
        out = {}
        for service, counts in sorted(self.services.items()):
            classes = {k: counts.get(k, 0) for k in ("requests", "2xx", "4xx", "5xx")}
            statuses = {k: v for k, v in sorted(counts.items()) if k.isdigit()}
            out[service] = {**classes, "by_status": statuses}
        return out


_COUNTS = FuzzCounts()


@pytest.fixture(scope="session")
def fuzz_counts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzCounts]:
    yield _COUNTS
    table = _COUNTS.table()
    paths = [tmp_path_factory.getbasetemp() / "fuzz-counts.json"]
    if os.environ.get(REPORT_ENV):
        paths.append(Path(os.environ[REPORT_ENV]))
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=2) + "\n")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    table = _COUNTS.table()
    if not table:
        return
    terminalreporter.section("fuzzing: requests sent and answers per service")
    for service, counts in table.items():
        terminalreporter.write_line(
            f"{service:28} requests {counts['requests']:5}  2xx {counts['2xx']:5}  4xx {counts['4xx']:5}  "
            f"5xx {counts['5xx']:3}  {counts['by_status']}"
        )


@pytest.fixture(scope="session")
def fuzz_supervisor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    supervisor = Supervisor(tmp_path_factory.mktemp("fuzz-logs"))
    yield supervisor
    supervisor.stop()


@pytest.fixture(scope="session")
def fuzz_predictor(fuzz_supervisor: Supervisor, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A real predictor (keyword and TF-IDF tiers: it starts in seconds), its URL."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    fuzz_supervisor.start(
        ServiceSpec(
            name="fuzz-predictor",
            argv=[sys.executable, "-m", "moe_l2_predictor"],
            env={
                "MOE_L2_PREDICTOR_PORT": str(port),
                "MOE_L2_PREDICTOR_HOST": "127.0.0.1",
                "MOE_L2_PREDICTOR_TIERS": "keyword,tfidf",
                "MOE_L2_PREDICTOR_CACHE_DIR": str(tmp_path_factory.mktemp("fuzz-predictor-cache")),
            },
            health=http_ok(f"{base}/healthz"),
            url=base,
            start_timeout_s=300,
        )
    )
    return base


@pytest.fixture(scope="session")
def fuzz_llama(start_llama: Callable[..., LlamaServer]) -> LlamaServer:
    return start_llama("fuzz-llama", telemetry=True, parallel=4, ctx_size=4096)


@pytest.fixture(scope="session")
def fuzz_gateway(fuzz_supervisor: Supervisor, fuzz_llama: LlamaServer, fuzz_predictor: str) -> str:
    """A real gateway in front of the real llama, with the predictor behind it, its URL."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    fuzz_supervisor.start(
        ServiceSpec(
            name="fuzz-gateway",
            argv=[sys.executable, "-m", "moe_l2_proxy"],
            env={
                "MOE_L2_PROXY_PORT": str(port),
                "MOE_L2_LLAMA_URL": fuzz_llama.url,
                "MOE_L2_PREDICTOR_URLS": fuzz_predictor,
                "MOE_L2_PROXY_PREDICT_BUDGET_MS": "500",
                "MOE_L2_CACHE_URL": "",
            },
            health=http_ok(f"{base}/healthz"),
            url=base,
            start_timeout_s=60,
        )
    )
    return base


@pytest.fixture(scope="session")
def predictor_schema(fuzz_predictor: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{fuzz_predictor}/openapi.json")


@pytest.fixture(scope="session")
def gateway_schema(fuzz_gateway: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{fuzz_gateway}/openapi.json")
