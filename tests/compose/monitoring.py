"""Prometheus' scrape configuration and Grafana's provisioning against the compose file."""

from __future__ import annotations

from typing import Any

from tests.compose.checks import PORTS, SCRAPED
from tests.compose.loading import COMPOSE, GRAFANA, PROMETHEUS
from tests.compose.shapes import as_argv, as_dict, mounts

# The services compose scales (`docker compose up --scale NAME=N`): Prometheus discovers each replica
# through Docker's DNS (type A on the service name), so every replica is its own target, and its
# `instance` is the replica's address:port, as the gateway dials it.
DNS_DISCOVERED = {"predictor", "llama"}


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
    dashboards = by_source.get((GRAFANA / "dashboards").resolve())
    assert dashboards, "the dashboards folder is not mounted"
    paths = {p["options"]["path"] for p in providers["providers"] if p.get("type", "file") == "file"}
    assert dashboards.target in paths, f"no provider reads {dashboards.target}"

    env = as_dict(grafana.get("environment"))
    assert env.get("GF_AUTH_ANONYMOUS_ENABLED") == "false"
    assert env.get("GF_SECURITY_ADMIN_PASSWORD"), "set Grafana's admin password from the environment"

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
