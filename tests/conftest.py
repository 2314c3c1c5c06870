"""Fixtures: the real patched llama-server on a generated demo MoE model."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from moe_l2_contracts.admin import ADMIN_TOKEN_ENV, ADMIN_TOKEN_HEADER
from moe_l2_gguf.demo_model import load_planted, make_demo_model
from moe_l2_llama.settings import LlamaSettings, llama_server_binary
from moe_l2_ops.llama_service import llama_service_spec
from moe_l2_ops.supervisor import Supervisor, free_port

# Every service a test starts inherits this environment, so they all share one admin token, as
# under `moe-l2 up`; tests of the token itself override it per process.
ADMIN_TOKEN = os.environ.setdefault(ADMIN_TOKEN_ENV, "moe-l2-test-admin-token")
ADMIN_HEADERS = {ADMIN_TOKEN_HEADER: ADMIN_TOKEN}


@dataclass
class LlamaServer:
    url: str
    client: httpx.Client
    log_path: Path

    def routing(self, reset: bool = False) -> dict:
        resp = self.client.get("/moe/routing", params={"reset": "1"} if reset else None, headers=ADMIN_HEADERS)
        resp.raise_for_status()
        return resp.json()

    def metrics(self) -> str:
        resp = self.client.get("/metrics")
        resp.raise_for_status()
        return resp.text


@pytest.fixture(scope="session")
def llama_binary() -> Path:
    # Built once per machine and cached (~6 min on 2 cores the first time), or MOE_L2_LLAMA_SERVER.
    return llama_server_binary(LlamaSettings())


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "demo.gguf"
    make_demo_model(path, seed=0)
    return path


@pytest.fixture(scope="session")
def planted(demo_model: Path) -> dict:
    return load_planted(demo_model)


@pytest.fixture(scope="session")
def start_llama(
    llama_binary: Path, demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., LlamaServer]]:
    """Factory: start a llama-server with the given settings; all are stopped at session end."""
    supervisor = Supervisor(tmp_path_factory.mktemp("llama-logs"))
    clients: list[httpx.Client] = []

    def start(name: str, *, telemetry: bool = True, parallel: int = 4, ctx_size: int = 4096) -> LlamaServer:
        settings = LlamaSettings(port=free_port(), parallel=parallel, ctx_size=ctx_size, telemetry=telemetry, threads=2)
        base = f"http://{settings.host}:{settings.port}"
        running = supervisor.start(llama_service_spec(name, llama_binary, demo_model, settings))
        client = httpx.Client(base_url=base, timeout=120)
        clients.append(client)
        return LlamaServer(url=base, client=client, log_path=running.log_path)

    yield start
    for client in clients:
        client.close()
    supervisor.stop()


@pytest.fixture(scope="session")
def llama(start_llama: Callable[..., LlamaServer]) -> LlamaServer:
    """Telemetry on, four slots."""
    return start_llama("llama-telemetry", telemetry=True, parallel=4)


@pytest.fixture(scope="session")
def llama_off(start_llama: Callable[..., LlamaServer]) -> LlamaServer:
    """Telemetry off (no eval callback installed)."""
    return start_llama("llama-plain", telemetry=False, parallel=4)


# The software GPU (docs/test-bed.md): llama-server's Vulkan backend on Mesa's llvmpipe.


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vulkan: needs the Vulkan build of llama-server (glslc, libvulkan-dev, ...)")


@pytest.fixture(scope="session")
def llvmpipe_probe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.llvmpipe_probe import write_probe_model

    return write_probe_model(tmp_path_factory.mktemp("llvmpipe-probe-model") / "probe.gguf")


@pytest.fixture(scope="session")
def vulkan_binary(llvmpipe_probe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Vulkan llama-server, built once and cached (`moe-l2 build-llama --vulkan`), or
    MOE_L2_VULKAN_LLAMA_SERVER. Without the packages a developer's run skips; CI (CI set) fails, so
    a CI machine cannot skip the device path for want of a package. A machine whose llvmpipe cannot
    run stock llama.cpp (tests/llvmpipe_probe.py) skips, in CI too, with the probe's finding."""
    from moe_l2_llama import build as build_mod
    from tests.llvmpipe_probe import llvmpipe_fault

    if env := os.environ.get("MOE_L2_VULKAN_LLAMA_SERVER"):
        binary = Path(env)
    elif missing := build_mod.missing_vulkan_packages():
        reason = f"the Vulkan build needs {', '.join(missing)} (apt-get install {build_mod.VULKAN_APT_PACKAGES})"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    else:
        binary = build_mod.build(build_mod.BuildConfig(backend="vulkan"))
    # pytest keeps a session fixture's skip, so the probe runs once however many tests ask
    if fault := llvmpipe_fault(binary, llvmpipe_probe_model, tmp_path_factory.mktemp("llvmpipe-probe")):
        pytest.skip(f"this machine's llvmpipe fails stock llama.cpp (docs/test-bed.md): {fault}")
    return binary
