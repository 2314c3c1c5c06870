"""The compose files loaded once per module, and the Compose schema and monitoring files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.compose.loading import (
    COMPOSE,
    COMPOSE_CPU,
    DASHBOARDS,
    GRAFANA,
    PROMETHEUS,
    interpolate,
    load_compose_text,
    merge,
)


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return load_compose_text(COMPOSE.read_text())


@pytest.fixture(scope="module")
def raw_cpu() -> dict[str, Any]:
    return load_compose_text(COMPOSE_CPU.read_text())


@pytest.fixture(scope="module")
def doc(raw: dict[str, Any]) -> dict[str, Any]:
    return interpolate(raw)


@pytest.fixture(scope="module")
def doc_cpu(raw: dict[str, Any], raw_cpu: dict[str, Any]) -> dict[str, Any]:
    return interpolate(merge(raw, raw_cpu))


def _schema_path() -> Path:
    env = os.environ.get("MOE_L2_COMPOSE_SCHEMA")
    return Path(env) if env else Path(__file__).resolve().parent / "compose-spec.json"  # tests/compose/README.md


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    path = _schema_path()
    if not path.is_file():
        pytest.skip(f"Compose JSON schema not found at {path} (set MOE_L2_COMPOSE_SCHEMA)")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def prometheus_config() -> dict[str, Any]:
    return yaml.safe_load(PROMETHEUS.read_text())


@pytest.fixture(scope="module")
def grafana_files() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    return (
        yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()),
        yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "moe-l2.yml").read_text()),
        json.loads((DASHBOARDS / "moe-l2.json").read_text()),
    )
