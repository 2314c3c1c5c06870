"""Prometheus' scrape configuration and Grafana's provisioning against the compose file."""

from __future__ import annotations

import re
from typing import Any

from tests.compose.checks import PORTS, SCRAPED
from tests.compose.loading import COMPOSE, DASHBOARDS, GRAFANA, PROMETHEUS
from tests.compose.shapes import as_argv, as_dict, mounts

# The services compose scales (`docker compose up --scale NAME=N`): Prometheus discovers each replica
# through Docker's DNS (type A on the service name), so every replica is its own target, and its
# `instance` is the replica's address:port, as the gateway dials it.
DNS_DISCOVERED = {"predictor", "llama", "cache-manager"}

# The label naming one llama replica in each source's series: the gateway's `replica` (host:port as
# it dials the replica) and Prometheus' `instance` of that llama-server's scrape (the same host:port).
REPLICA_LABELS = {"moe_l2_": "replica", "llamacpp:": "instance", "up": "instance"}
_SELECTOR = re.compile(r"(?<![\w:$])(moe_l2_\w+|llamacpp:[\w:]+|up\b)\s*(\{[^}]*\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!=|!~|=)\s*"([^"]*)"')
_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
_LABEL_VALUES = re.compile(r"^label_values\(\s*([\w:]+)\s*,\s*(\w+)\s*\)$")


def check_prometheus(config: dict[str, Any], doc: dict[str, Any]) -> None:
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets: set[str] = set()
    for job in jobs.values():
        for static in job.get("static_configs", []):
            targets |= set(static.get("targets", []))
    for name in sorted(DNS_DISCOVERED):
        dns = [
            d
            for d in jobs.get(name, {}).get("dns_sd_configs", [])
            if d.get("type") == "A" and d.get("names") == [name] and d.get("port") == PORTS[name]
        ]
        assert dns, f"the {name} replicas are discovered through DNS (type A, port {PORTS[name]})"
        assert not jobs[name].get("static_configs"), f"{name}: a static target beside DNS discovery"
    for name in SCRAPED - DNS_DISCOVERED:
        expected = {f"{name}:{PORTS[name]}"} | ({f"localhost:{PORTS[name]}"} if name == "prometheus" else set())
        assert targets & expected, f"prometheus does not scrape {name}"
    for target in targets:
        host, _, port = target.rpartition(":")
        assert host == "localhost" or host in doc["services"], f"unknown scrape target {target}"
        assert host == "localhost" or int(port) == PORTS[host], f"{target}: wrong port"
    prom = doc["services"]["prometheus"]
    config_file = next(a.split("=", 1)[1] for a in as_argv(prom["command"]) if a.startswith("--config.file="))
    mounted = {m.target: m for m in mounts(prom)}
    assert config_file in mounted, "prometheus.yml is not mounted where --config.file points"
    assert (COMPOSE.parent / mounted[config_file].source).resolve() == PROMETHEUS.resolve()


def check_grafana(
    datasources: dict[str, Any], providers: dict[str, Any], dashboard: dict[str, Any], doc: dict[str, Any]
) -> None:
    uids = {d["uid"] for d in datasources["datasources"]}
    assert "prometheus" in uids
    prom = next(d for d in datasources["datasources"] if d["uid"] == "prometheus")
    assert prom["type"] == "prometheus" and prom["url"] == f"http://prometheus:{PORTS['prometheus']}"

    grafana = doc["services"]["grafana"]
    by_source = {(COMPOSE.parent / m.source).resolve(): m for m in mounts(grafana) if m.kind == "bind"}
    provisioning = by_source.get((GRAFANA / "provisioning").resolve())
    assert provisioning and provisioning.target == "/etc/grafana/provisioning"
    dashboards = by_source.get(DASHBOARDS.resolve())
    assert dashboards, "the dashboards folder is not mounted"
    paths = {p["options"]["path"] for p in providers["providers"] if p.get("type", "file") == "file"}
    assert dashboards.target in paths, f"no provider reads {dashboards.target}"

    env = as_dict(grafana.get("environment"))
    assert env.get("GF_AUTH_ANONYMOUS_ENABLED") == "false"
    assert env.get("GF_SECURITY_ADMIN_PASSWORD__FILE"), "Grafana's admin password: the one-shot's file"

    assert dashboard["uid"] == "moe-l2" and dashboard["title"] == "moe-l2"
    panels = []
    for panel in dashboard.get("panels", []):
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # collapsed rows
    ids = [p["id"] for p in panels]
    assert ids and len(ids) == len(set(ids)), f"panel ids are not unique: {ids}"
    for panel in panels:
        for obj in [panel, *panel.get("targets", [])]:
            ds = obj.get("datasource")
            if isinstance(ds, dict) and ds.get("type") == "prometheus":
                assert ds.get("uid") in uids, f"panel {panel['id']}: unknown datasource {ds}"
        if panel.get("type") != "row":
            assert panel.get("targets"), f"panel {panel['id']} has no query"
    check_replica_rows(dashboard, gateway_metric_names())


def gateway_metric_names() -> set[str]:
    """The series names the gateway exports: its registry's families (a counter `x` as `x_total`, a
    histogram's `_bucket`/`_sum`/`_count`), labelled ones included before any sample."""
    from moe_l2_proxy.metrics import GatewayMetrics

    names: set[str] = set()
    for family in GatewayMetrics().registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}
    return names


def dashboard_panels(dashboard: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Every panel with the row it sits in (a collapsed row holds its panels, an open row the panels
    after it up to the next row)."""
    out: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    row = None
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            row = panel
            out.append((panel, None))
            out.extend((inner, panel) for inner in panel.get("panels", []))
        else:
            out.append((panel, row))
    return out


def check_replica_rows(dashboard: dict[str, Any], gateway_names: set[str]) -> None:
    """The per-replica rows: the `replica` variable lists what the gateway routes to, each repeated
    row's series are that one replica's (the gateway's by `replica`, llama's by `instance`), every
    variable a panel uses is defined, every gateway series queried is one the gateway exports."""
    variables = {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}
    replica = variables.get("replica")
    assert replica, "no `replica` template variable"
    query = replica.get("query")
    query = query.get("query", "") if isinstance(query, dict) else query
    found = _LABEL_VALUES.match(str(query).strip())
    assert found and found.group(2) == "replica", f"replica variable: {query!r} lists no gateway replica label"
    assert found.group(1) in gateway_names, f"replica variable: the gateway exports no {found.group(1)}"
    assert replica.get("datasource", {}).get("uid") == "prometheus"
    repeated = [p for p, _ in dashboard_panels(dashboard) if p.get("type") == "row" and p.get("repeat")]
    assert any(r["repeat"] == "replica" for r in repeated), "no row repeats per replica"
    for row in repeated:
        variable = variables.get(row["repeat"])
        assert variable, f"row {row['id']} repeats over an undefined variable {row['repeat']!r}"
        assert variable.get("multi") or variable.get("includeAll"), f"{row['repeat']}: one value, nothing to repeat"
    for panel, row in dashboard_panels(dashboard):
        where = f"panel {panel['id']} {panel.get('title')!r}"
        texts = [panel.get("title", ""), *(t.get("expr", "") for t in panel.get("targets", []))]
        for text in texts:
            for braced, plain in _VARIABLE.findall(text):
                name = braced or plain
                assert name.startswith("__") or name in variables, f"{where}: ${name} is no dashboard variable"
        for target in panel.get("targets", []):
            expr = target.get("expr", "")
            for name, matchers in _SELECTOR.findall(expr):
                if name.startswith(("moe_l2_replica_", "moe_l2_routing_")):
                    assert name in gateway_names, f"{where}: the gateway exports no {name}"
                if not (row and row.get("repeat") == "replica"):
                    continue
                label = next(v for k, v in REPLICA_LABELS.items() if name.startswith(k))
                filters = {(k, op, v) for k, op, v in _MATCHER.findall(matchers)}
                assert (label, "=", "$replica") in filters, (
                    f"{where} {target.get('refId')}: {name} is not the row's replica's ({label}=\"$replica\")"
                )
