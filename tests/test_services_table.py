"""The services' ports are defined once, in moe_l2_contracts.services, and every reader agrees."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from moe_l2_contracts.services import CACHE_MANAGER, LLAMA, PREDICTOR, PROXY, SERVICES
from moe_l2_ops.stack import StackSettings
from moe_l2_ops.stats import OpsSettings

REPO = Path(__file__).resolve().parent.parent
TABLE = REPO / "shared" / "moe_l2_contracts" / "services.py"


def test_no_port_number_outside_the_table() -> None:
    ports = {s.port for s in SERVICES.values()}
    found = []
    for path in [*REPO.glob("shared/**/*.py"), *REPO.glob("ops/**/*.py"), *REPO.glob("services/**/*.py")]:
        if path == TABLE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and type(node.value) is int and node.value in ports:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value}")
    assert found == []


def test_every_reader_takes_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    for service in SERVICES.values():
        monkeypatch.delenv(service.port_env, raising=False)
    for name in ("MOE_L2_PROXY_URL", "MOE_L2_LLAMA_URL", "MOE_L2_PREDICTOR_URLS", "MOE_L2_CACHE_URL"):
        monkeypatch.delenv(name, raising=False)
    ops = OpsSettings()
    assert ops.services() == {s.name: f"http://127.0.0.1:{s.port}" for s in SERVICES.values()}
    stack = StackSettings()
    assert (stack.proxy_port, stack.llama_port, stack.cache_port) == (PROXY.port, LLAMA.port, CACHE_MANAGER.port)

    # a port moved by its variable moves every URL that points at it
    monkeypatch.setenv(PREDICTOR.port_env, "21437")
    assert OpsSettings().services()["predictor"] == "http://127.0.0.1:21437"
