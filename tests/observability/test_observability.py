"""Observability against the running local stack: every dashboard query evaluated by a real
Prometheus, the dashboard's structure, `moe-l2 stats` and `moe-l2 doctor`."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from moe_l2_cache.gpu import METRIC_NAMES as GPU_METRICS
from moe_l2_cache.gpu import GpuCollector, GpuStats
from moe_l2_ops.stats import parse_metrics
from tests.compose.monitoring import gateway_metric_names
from tests.observability.conftest import SCRAPE_INTERVAL_S, LocalStack, Prometheus, restart

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "deploy" / "kubernetes" / "base" / "dashboards" / "moe-l2.json").read_text())
DATASOURCES = yaml.safe_load(
    (ROOT / "services" / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
)
# What Grafana substitutes before sending a query; the windows cover the whole test's traffic.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1m"}
GPU_TAG = "[GPU only]"

# Requests sent through the gateway: both APIs, streamed or not, the domain from the header or the predictor.
CHATS: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "write a python function with a class"}]}, {}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "fix this bug: traceback exception"}], "stream": True},
        {},
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}, {"X-MoE-Domain": "codegen"}),
    ("/api/chat", {"messages": [{"role": "user", "content": "debug the error in this stacktrace"}]}, {}),
    (
        "/api/chat",
        {"messages": [{"role": "user", "content": "tell me about it"}], "stream": False},
        {"X-MoE-Domain": "debug"},
    ),
    ("/api/generate", {"prompt": "implement a rust module with an iterator", "stream": False}, {}),
]


# --------------------------------------------------------------------------- the dashboard


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows hold their panels
    return out


def query_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in all_panels(dashboard) if p.get("type") != "row"]


def gpu_only(panel: dict[str, Any]) -> bool:
    return panel.get("moe_l2_gpu_only") is True


def needs_expert_cache(panel: dict[str, Any]) -> bool:
    """The expert cache's panels: a CPU stack's llama-server has no cache (tests/test_expert_cache.py
    checks the series on the software GPU)."""
    return panel.get("moe_l2_needs_expert_cache") is True


def expand(expr: str, replica: str | None = None) -> str:
    """What Grafana sends: its interval variables, and in a repeated replica row that row's replica."""
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    if replica is not None:
        expr = expr.replace("$replica", replica)
    return expr


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
}


def metric_names(expr: str) -> set[str]:
    """Metric names an expression reads (function names, labels, keywords and durations left out)."""
    text = _STRINGS.sub('""', expand(expr))
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range durations
    text = _GROUPING.sub("", text)
    return {name for name, call in _IDENT.findall(text) if not call and name.lower() not in _KEYWORDS}


def structural_problems(dashboard: dict[str, Any], datasource_uids: set[str], exported: set[str]) -> list[str]:
    problems = []
    panels = all_panels(dashboard)
    ids = [p.get("id") for p in panels]
    if len(ids) != len(set(ids)) or None in ids:
        problems.append(f"panel ids are not unique: {ids}")
    for panel in query_panels(dashboard):
        where = f"panel {panel.get('id')} {panel.get('title')!r}"
        if not panel.get("targets"):
            problems.append(f"{where}: no query")
        if gpu_only(panel) != str(panel.get("description", "")).startswith(GPU_TAG):
            problems.append(f"{where}: moe_l2_gpu_only and the {GPU_TAG} description tag disagree")
        for obj in [panel, *panel.get("targets", [])]:
            ds = obj.get("datasource")
            if not (isinstance(ds, dict) and ds.get("type") == "prometheus" and ds.get("uid") in datasource_uids):
                problems.append(f"{where}: datasource {ds} is not the provisioned Prometheus")
        for target in panel.get("targets", []):
            names = metric_names(target.get("expr", ""))
            if not names:
                problems.append(f"{where} {target.get('refId')}: no metric in {target.get('expr')!r}")
            allowed = set(GPU_METRICS) if gpu_only(panel) else exported
            if needs_expert_cache(panel):
                # the CPU stack's llama has no cache: its names are checked live by tests/test_expert_cache.py
                allowed = exported | {n for n in names if n.startswith("llamacpp:moe_cache_")}
            for name in sorted(names - allowed):
                problems.append(f"{where} {target.get('refId')}: {name} is exported by no service")
    return problems


def test_metric_names_parses_promql() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, tier) (rate(moe_l2_x_bucket{route=~"a|b", le!="1"}[$__rate_interval])))'
        " / clamp_min(sum(llamacpp:moe_hot_hits_total) + sum without (domain) (moe_l2_y) offset 5m, 1e-9) > bool 0"
    )
    assert metric_names(expr) == {"moe_l2_x_bucket", "llamacpp:moe_hot_hits_total", "moe_l2_y"}
    assert metric_names("up == 1") == {"up"}


def test_gpu_collector_exports_the_gpu_panel_names() -> None:
    reads: list[int] = []

    def fake() -> list[GpuStats]:
        reads.append(1)
        return [GpuStats(0, "H200", 10 << 30, 141 << 30, 0.5), GpuStats(1, "H200", 0, 141 << 30, None)]

    registry = CollectorRegistry()
    registry.register(GpuCollector(fake))
    samples = parse_metrics(generate_latest(registry).decode())
    assert set(GPU_METRICS) <= set(samples)
    assert {labels["gpu"] for labels, _ in samples["moe_l2_gpu_memory_total_bytes"]} == {"0", "1"}
    assert samples["moe_l2_gpu_utilization_ratio"] == [({"gpu": "0"}, 0.5)]
    gpu_names = {
        n for p in query_panels(DASHBOARD) if gpu_only(p) for t in p["targets"] for n in metric_names(t["expr"])
    }
    assert gpu_names and gpu_names <= set(GPU_METRICS)

    none_reads: list[int] = []

    def absent() -> None:
        none_reads.append(1)
        return None

    quiet = CollectorRegistry()
    quiet.register(GpuCollector(absent))
    for _ in range(3):
        assert b"moe_l2_gpu" not in generate_latest(quiet)
    assert len(none_reads) == 1, "NVML is not retried on every scrape once it failed"


def test_dashboard_covers_the_issue() -> None:
    panels = query_panels(DASHBOARD)
    titles = " | ".join(p["title"].lower() for p in panels)
    for words in ("request rate", "errors", "latency", "first token", "tokens/s", "domain mix", "domain source",
                  "predictor latency", "hit rate", "per domain", "switches", "pool bytes", "flywheel", "redis",
                  "gpu memory", "gpu utilisation", "targets up", "expert cache hit rate",
                  "bytes per token", "routing decisions", "replica failures", "load per replica",
                  "domain mix routed to $replica", "in flight on $replica", "in rotation: $replica",
                  "hot-set hit rate on $replica", "decode tokens/s on $replica"):  # fmt: skip
        assert words in titles, f"no panel about {words}"
    assert DASHBOARD["uid"] == "moe-l2"
    assert any(gpu_only(p) for p in panels) and not all(gpu_only(p) for p in panels)


# --------------------------------------------------------------------------- traffic and Prometheus


def _all_up(prom: Prometheus) -> bool:
    result = prom.query("up")["result"]
    up = {r["metric"]["job"]: r["value"][1] for r in result}
    return set(up) == set(prom.jobs) and all(v == "1" for v in up.values())


def _wait(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def drive_traffic(stack: LocalStack) -> int:
    """Every chat of CHATS twice (hot sets switch in between), plus two requests that fail. Returns the count."""
    sent = 0
    with httpx.Client(base_url=stack.url("proxy"), timeout=120) as client:
        for _ in range(2):
            for path, body, headers in CHATS:
                options = {"max_tokens": 8} if path.startswith("/v1") else {"options": {"num_predict": 8}}
                resp = client.post(path, json={"model": "demo", **body, **options}, headers=headers)
                assert resp.status_code == 200, f"{path}: {resp.status_code} {resp.text[:300]}"
                sent += 1
        for path in ("/v1/chat/completions", "/api/chat"):
            resp = client.post(path, content=b"{not json", headers={"content-type": "application/json"})
            assert resp.status_code >= 400
            sent += 1
    return sent


@pytest.fixture(scope="module")
def scraped(stack: LocalStack, prometheus: Prometheus) -> int:
    """Traffic went through the gateway and Prometheus scraped it: the number of requests sent."""
    _wait(lambda: _all_up(prometheus), 60, f"every job up in Prometheus ({prometheus.jobs})")
    sent = drive_traffic(stack)

    def counted() -> bool:
        result = prometheus.query('sum(moe_l2_requests_total{route=~"/v1/.*|/api/.*"})')["result"]
        return bool(result) and float(result[0]["value"][1]) >= sent

    _wait(counted, 30, "Prometheus to scrape the gateway's counters")
    # then a few more successful scrapes of llama and the cache-manager (which pulls llama's counts every
    # second), so that their series hold the traffic too: each one's last good scrape 3 intervals on
    since = time.time() + 3 * SCRAPE_INTERVAL_S

    def scraped_since(job: str) -> bool:
        result = prometheus.query(f'timestamp(up{{job="{job}"}} == 1)')["result"]
        return bool(result) and float(result[0]["value"][1]) >= since

    jobs = ("llama", "cache-manager")
    _wait(lambda: all(scraped_since(job) for job in jobs), 30, f"3 more good scrapes of {' and '.join(jobs)}")
    return sent


PANEL_TARGETS = [
    pytest.param(panel, target, id=f"{panel['id']}-{target['refId']}-{panel['title']}")
    for panel in query_panels(DASHBOARD)
    for target in panel["targets"]
]


def llama_replica(stack: LocalStack) -> str:
    """The one llama replica's host:port as the gateway dials it (MOE_L2_LLAMA_URL, 127.0.0.1) and
    as the local Prometheus scrapes it: the value of the dashboard's `replica` variable here."""
    return f"127.0.0.1:{stack.ports['llama']}"


@pytest.mark.parametrize(("panel", "target"), PANEL_TARGETS)
def test_every_panel_query_returns_data(
    panel: dict[str, Any], target: dict[str, Any], stack: LocalStack, prometheus: Prometheus, scraped: int
) -> None:
    expr = expand(target["expr"], llama_replica(stack))
    data = prometheus.query(expr)  # asserts Prometheus parsed and evaluated it
    if gpu_only(panel) or needs_expert_cache(panel):
        return  # well-formed is all a machine without a GPU (or a stack without the cache) can show
    assert data["result"], f"{expr} returned no series"


def test_replica_label_is_llama_s_instance(stack: LocalStack, prometheus: Prometheus, scraped: int) -> None:
    """The replica rows join the gateway's series (label `replica`) with llama's (Prometheus'
    `instance`): the replica variable's values must be the llama targets' instances."""
    replicas = {
        r["metric"].get("replica") for r in prometheus.query("group by (replica) (moe_l2_replica_in_flight)")["result"]
    }
    instances = {r["metric"]["instance"] for r in prometheus.query('up{job="llama"}')["result"]}
    assert replicas == instances == {llama_replica(stack)}


def test_dashboard_structure(stack: LocalStack, prometheus: Prometheus, scraped: int) -> None:
    # Prometheus' own series for every target; every name the gateway registers (a labelled counter
    # shows in /metrics only once counted: replica failures need a failure)
    exported = {"up"} | gateway_metric_names()
    for name in ("proxy", "llama", "predictor", "cache-manager"):
        resp = httpx.get(f"{stack.url(name)}/metrics", timeout=10)
        assert resp.status_code == 200, name
        exported |= set(parse_metrics(resp.text))
    uids = {d["uid"] for d in DATASOURCES["datasources"] if d.get("type") == "prometheus"}
    assert structural_problems(DASHBOARD, uids, exported) == []

    # each check can fail
    broken = copy.deepcopy(DASHBOARD)
    panels = query_panels(broken)
    panels[1]["id"] = panels[0]["id"]
    panels[2]["targets"][0]["datasource"] = {"type": "prometheus", "uid": "elsewhere"}
    panels[3]["targets"][0]["expr"] = "rate(moe_l2_no_such_metric_total[5m])"
    gpu = next(p for p in panels if gpu_only(p))
    gpu["description"] = "untagged"
    problems = "\n".join(structural_problems(broken, uids, exported))
    assert "not unique" in problems and "elsewhere" in problems and "moe_l2_no_such_metric_total" in problems
    assert "disagree" in problems


# --------------------------------------------------------------------------- moe-l2 stats / doctor


def moe_l2(stack: LocalStack, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_L2_")} | stack.env
    return subprocess.run(
        [sys.executable, "-m", "moe_l2_ops.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_stats_json(stack: LocalStack, scraped: int) -> None:
    result = moe_l2(stack, "stats", "--json", "--sample", "0.5")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert all(stats["services"].values()), stats["problems"]
    assert stats["requests"]["total"] >= scraped
    assert stats["requests"]["errors"] >= 2
    assert {"header", "predictor"} <= set(stats["domains"]["by_source"])
    assert {"codegen", "debug"} <= set(stats["domains"]["share"])
    assert sum(stats["domains"]["share"].values()) == pytest.approx(1.0, abs=0.01)
    assert stats["tokens"]["completion"] > 0 and stats["tokens"]["tokens_per_s"] is not None
    assert stats["pool"]["budget_bytes"] == 256 << 20
    assert 0 < stats["pool"]["pinned_bytes"] <= stats["pool"]["budget_bytes"]
    assert stats["hot_set"]["active_domain"] in stats["domains"]["share"]
    assert stats["hot_set"]["cache_switches"] >= 1
    routed = stats["experts"]["routed_tokens"]
    assert {"codegen", "debug"} <= set(routed) and all(v > 0 for v in routed.values())
    rate = stats["experts"]["hit_rate"]
    assert rate is None or 0.0 <= rate <= 1.0


def test_stats_screen_and_watch(stack: LocalStack, scraped: int) -> None:
    result = moe_l2(stack, "stats", "--sample", "0")
    assert result.returncode == 0, result.stderr
    heads = [line.split()[0] for line in result.stdout.splitlines() if line.strip()]
    for head in ("services", "requests", "domains", "experts", "hot", "pool", "tokens"):
        assert head in heads, result.stdout
    watch = moe_l2(stack, "stats", "--watch", "--json", "--interval", "0.2", "--count", "3")
    assert watch.returncode == 0, watch.stderr
    screens = [json.loads(line) for line in watch.stdout.splitlines()]
    assert len(screens) == 3 and all(s["tokens"]["tokens_per_s"] is not None for s in screens[1:])


def test_stats_without_services_fails(stack: LocalStack) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_L2_")}
    env |= {f"MOE_L2_{n}_URL": "http://127.0.0.1:9" for n in ("PROXY", "LLAMA", "CACHE")}
    env["MOE_L2_PREDICTOR_URLS"] = "http://127.0.0.1:9"
    result = subprocess.run(
        [sys.executable, "-m", "moe_l2_ops.cli", "stats", "--sample", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "no moe-l2 service answered" in result.stderr


def _doctor(stack: LocalStack) -> tuple[int, dict[str, dict[str, str]]]:
    result = moe_l2(stack, "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    return result.returncode, checks


def test_doctor_healthy_stack(stack: LocalStack) -> None:
    rc, checks = _doctor(stack)
    for name in (
        "python",
        "packages",
        "llama-server",
        "model",
        "redis",
        "proxy",
        "llama",
        "predictor",
        "cache-manager",
    ):
        assert checks[name]["status"] == "pass", checks[name]
    assert "MoE layers" in checks["model"]["detail"]
    assert {"gpu", "memlock", "/dev/shm", "disk"} <= set(checks)
    assert rc == (1 if any(c["status"] == "fail" for c in checks.values()) else 0)
    text = moe_l2(stack, "doctor")
    assert re.search(r"^PASS\s+redis\s", text.stdout, re.M), text.stdout


def test_doctor_fails_when_redis_is_stopped(stack: LocalStack) -> None:
    redis = stack.service("redis")
    redis.proc.terminate()
    redis.proc.wait(timeout=15)
    try:
        rc, checks = _doctor(stack)
        assert rc == 1
        assert checks["redis"]["status"] == "fail" and "unreachable" in checks["redis"]["detail"]
        assert checks["proxy"]["status"] == "pass"
        text = moe_l2(stack, "doctor")
        assert text.returncode == 1 and re.search(r"^FAIL\s+redis\s", text.stdout, re.M), text.stdout
    finally:
        restart(stack, "redis")
    rc, checks = _doctor(stack)
    assert checks["redis"]["status"] == "pass"
