"""Prometheus scrapes every service of the compose file; Grafana's provisioning points at it."""

from __future__ import annotations

from typing import Any

from tests.compose.loading import DASHBOARDS
from tests.compose.monitoring import check_grafana, check_prometheus
from tests.compose.shapes import as_dict


def test_prometheus_scrapes_every_service(prometheus_config: dict[str, Any], doc: dict[str, Any]) -> None:
    check_prometheus(prometheus_config, doc)


def test_grafana_provisioning(grafana_files: tuple[dict[str, Any], ...], doc: dict[str, Any]) -> None:
    datasources, providers, dashboard = grafana_files
    check_grafana(datasources, providers, dashboard, doc)
    home = as_dict(doc["services"]["grafana"]["environment"]).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert home == "/etc/grafana/dashboards/moe-l2.json" and (DASHBOARDS / "moe-l2.json").is_file()
