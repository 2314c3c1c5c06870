"""The local stack (`moe-l2 up`'s services: Redis, llama-server on the demo model, cache-manager,
predictor, gateway) on free ports, started once per module through the same Supervisor, and a real
Prometheus scraping it with the project's scrape config adapted to localhost targets."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from moe_l2_ops.stack import StackSettings, python_service, resolve_model, stack_admin_token, stack_services
from moe_l2_ops.supervisor import RunningService, ServiceSpec, Supervisor, free_port

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_YML = ROOT / "services" / "prometheus" / "prometheus.yml"
SCRAPE_INTERVAL_S = 1


@dataclass
class LocalStack:
    supervisor: Supervisor
    env: dict[str, str]  # the MOE_L2_* variables the services and `moe-l2 stats/doctor` read
    ports: dict[str, int]  # job name -> port

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def service(self, name: str) -> RunningService:
        return next(s for s in self.supervisor.running if s.spec.name == name)


def _ports() -> dict[str, int]:
    ports: dict[str, int] = {}
    while len(set(ports.values())) < 5:
        ports = {name: free_port() for name in ("proxy", "llama", "predictor", "cache-manager", "redis")}
    return ports


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, llama_binary: Path) -> Iterator[LocalStack]:
    ports = _ports()
    state = tmp_path_factory.mktemp("obs-state")
    env = {
        "MOE_L2_PROXY_PORT": str(ports["proxy"]),
        "MOE_L2_LLAMA_PORT": str(ports["llama"]),
        "MOE_L2_PREDICTOR_PORT": str(ports["predictor"]),
        "MOE_L2_CACHE_PORT": str(ports["cache-manager"]),
        "MOE_L2_REDIS_PORT": str(ports["redis"]),
        "MOE_L2_STATE_DIR": str(state),
        "MOE_L2_LLAMA_SERVER": str(llama_binary),
        # small and quick: the flywheel pulls every second so its counters move during the test
        "MOE_L2_CACHE_POOL_BYTES": str(256 << 20),
        "MOE_L2_CACHE_PULL_INTERVAL_S": "1",
        "MOE_L2_CACHE_DWELL_S": "0",
        # the tests read what the predictor decided: its 50 ms default budget, missed on a loaded
        # machine, would turn answers into keyword fallbacks (test_stats_json saw only "fallback")
        "MOE_L2_PROXY_PREDICT_BUDGET_MS": "5000",
    }
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("MOE_L2_")]:
            mp.delenv(key)  # nothing from the caller's environment leaks into the stack
        for key, value in env.items():
            mp.setenv(key, value)
        settings = StackSettings()
        supervisor = Supervisor(state / "logs", echo=lambda msg: None)
        try:
            # as `moe-l2 up` does: one admin token for every service, else llama refuses the flywheel's pulls
            admin_token = stack_admin_token(settings)
            specs = stack_services(settings, resolve_model(settings, None), llama_binary, admin_token)
            if not any(s.name == "proxy" for s in specs):
                # the gateway joins `moe-l2 up` in stack_services(); until then it is started here the same way
                specs.append(python_service("proxy", "moe_l2_proxy", ports["proxy"]))
            for spec in specs:
                supervisor.start(spec)
            yield LocalStack(supervisor, env, ports)
        finally:
            supervisor.stop()


def restart(stack: LocalStack, name: str) -> None:
    """Start a stopped service again with its original spec."""
    old = stack.service(name)
    stack.supervisor.running.remove(old)
    spec: ServiceSpec = old.spec
    stack.supervisor.start(spec)


def prometheus_binary() -> str:
    """Debian's prometheus, which `.ci/run` installs with the suite's other packages. Missing, the test
    skips with the command that installs it; in CI that skip fails the run (tests/ci_policy.py: no
    entry of tests/skip_allowlist.toml allows it), so a CI machine cannot pass without the scrape."""
    found = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").is_file() else None)
    if not found:
        pytest.skip("prometheus is not installed: apt-get install prometheus (.ci/run installs it in CI)")
    return found


def local_scrape_config(project: dict[str, Any], stack: LocalStack, prometheus_port: int) -> dict[str, Any]:
    """The project's prometheus.yml with every job pointed at the local processes (same job names).

    DNS service discovery becomes a static target (no compose DNS here); a job without a local
    process (grafana) is left out.
    """
    local = {**stack.ports, "prometheus": prometheus_port}
    jobs = []
    for job in project["scrape_configs"]:
        name = job["job_name"]
        if name not in local:
            continue
        adapted = {k: v for k, v in job.items() if k not in ("static_configs", "dns_sd_configs")}
        adapted["static_configs"] = [{"targets": [f"127.0.0.1:{local[name]}"]}]
        jobs.append(adapted)
    interval = f"{SCRAPE_INTERVAL_S}s"
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "scrape_configs": jobs,
    }


@dataclass
class Prometheus:
    url: str
    jobs: list[str]

    def query(self, expr: str) -> dict[str, Any]:
        resp = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = resp.json()
        assert resp.status_code == 200 and body.get("status") == "success", f"{expr}: {resp.status_code} {body}"
        return body["data"]


@pytest.fixture(scope="module")
def prometheus(stack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    binary = prometheus_binary()
    port = free_port()
    folder = tmp_path_factory.mktemp("prometheus")
    config = local_scrape_config(yaml.safe_load(PROMETHEUS_YML.read_text()), stack, port)
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (folder / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}", [j["job_name"] for j in config["scrape_configs"]])
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (folder / "prometheus.log").read_text()[-2000:]
            try:
                if httpx.get(f"{prom.url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus was not ready after 60s"
            time.sleep(0.3)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
