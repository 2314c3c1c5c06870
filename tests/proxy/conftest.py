"""Fixtures of the gateway tests: real gateway processes (`python -m moe_l2_proxy`) in front of real
patched llama-servers on the demo model, real predictor processes, and llamas the tests may stop."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from moe_l2_gguf.demo_model import DemoModelSpec, make_demo_model
from moe_l2_ops.supervisor import ServiceSpec, Supervisor, free_port, http_ok
from tests.conftest import LlamaServer
from tests.proxy.support import (
    BlackHole,
    GatewayProc,
    ManagedProcess,
    llama_spec,
    predictor_spec,
)


@pytest.fixture(scope="session")
def start_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., GatewayProc]]:
    """Factory: a gateway process with the given MOE_L2_* settings; all are stopped at session end.

    By default it has no predictor and no cache-manager (empty URLs): tests opt in.
    """
    supervisor = Supervisor(tmp_path_factory.mktemp("gateway-logs"))
    clients: list[httpx.Client] = []
    counter = iter(range(1000))

    def start(llama_url: str, **env: str) -> GatewayProc:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        settings = {
            "MOE_L2_PROXY_PORT": str(port),
            "MOE_L2_LLAMA_URL": llama_url,
            "MOE_L2_PREDICTOR_URLS": "",
            "MOE_L2_CACHE_URL": "",
            **env,
        }
        running = supervisor.start(
            ServiceSpec(
                name=f"gateway-{next(counter)}",
                argv=[sys.executable, "-m", "moe_l2_proxy"],
                env=settings,
                health=http_ok(f"{url}/healthz"),
                url=url,
                start_timeout_s=60,
            )
        )
        client = httpx.Client(base_url=url, timeout=120)
        clients.append(client)
        return GatewayProc(url=url, client=client, log_path=running.log_path, proc=running.proc)

    yield start
    for client in clients:
        client.close()
    supervisor.stop()


@pytest.fixture(scope="session")
def gateway_llamas(llama_binary, demo_model, tmp_path_factory) -> Iterator[Callable[..., LlamaServer]]:
    """Factory of llama-servers for these tests, all stopped at session end.

    One CPU thread each (the root fixture uses two): on a shared 2-core machine ggml's worker
    threads spin-wait on each other, and with other processes competing a decode step of 32
    slots went from ~20 ms to ~500 ms; a single thread has no one to wait for.
    """
    supervisor = Supervisor(tmp_path_factory.mktemp("gateway-llama-logs"))
    clients: list[httpx.Client] = []

    def start(name: str, parallel: int, ctx_size: int, model: Path | None = None) -> LlamaServer:
        spec = llama_spec(llama_binary, model or demo_model, name, parallel=parallel, ctx_size=ctx_size)(free_port())
        running = supervisor.start(spec)
        client = httpx.Client(base_url=spec.url, timeout=120)
        clients.append(client)
        return LlamaServer(url=spec.url, client=client, log_path=running.log_path)

    yield start
    for client in clients:
        client.close()
    supervisor.stop()


@pytest.fixture(scope="session")
def llama32(gateway_llamas) -> LlamaServer:
    """32 slots of 1024 tokens: the concurrency test and the client tests."""
    return gateway_llamas("gw-llama-32", parallel=32, ctx_size=32 * 1024)


@pytest.fixture(scope="session")
def batching_llama32(gateway_llamas, tmp_path_factory) -> LlamaServer:
    """32 slots on a wider demo model, whose decode step is mostly matrix work, as a real model's is.

    On the default demo model a token costs llama about the same whatever the batch (sampling and
    HTTP per slot outweigh its tiny matmuls), so 32 streams at once take ~0.7-0.9 x 32 single ones
    even with nothing in the way; here batching pays, which is what lets a test see serialization."""
    model = tmp_path_factory.mktemp("batching-model") / "wide.gguf"
    make_demo_model(model, seed=0, spec=DemoModelSpec(n_embd=384, n_ff=128, n_head=6))
    return gateway_llamas("gw-llama-32-wide", parallel=32, ctx_size=32 * 1024, model=model)


@pytest.fixture(scope="session")
def long_llama(gateway_llamas) -> LlamaServer:
    """Two slots of 8192 tokens: a generation long enough to notice whether it was cancelled."""
    return gateway_llamas("gw-llama-long", parallel=2, ctx_size=2 * 8192)


@pytest.fixture(scope="session")
def gateway(start_gateway, llama32) -> GatewayProc:
    """The default gateway: llama32, keyword fallback only, no hints."""
    return start_gateway(llama32.url)


@pytest.fixture
def managed(tmp_path: Path) -> Iterator[Callable[[str, Callable[[int], ServiceSpec]], ManagedProcess]]:
    """Factory of ManagedProcess; everything started is stopped (and thawed) after the test."""
    started: list[ManagedProcess] = []

    def make(name: str, make_spec: Callable[[int], ServiceSpec]) -> ManagedProcess:
        service = ManagedProcess(name, free_port(), make_spec, Supervisor(tmp_path / f"{name}-logs"))
        started.append(service)
        return service

    yield make
    for service in started:
        service.stop()


@pytest.fixture
def start_predictor(managed) -> Callable[[str], ManagedProcess]:
    """A real `python -m moe_l2_predictor`; a failure to start fails the test."""

    def start(name: str = "predictor") -> ManagedProcess:
        service = managed(name, predictor_spec(name))
        service.start()
        return service

    return start


@pytest.fixture
def killable_llama(managed, llama_binary, demo_model) -> ManagedProcess:
    service = managed("killable-llama", llama_spec(llama_binary, demo_model, "killable-llama"))
    service.start()
    return service


@pytest.fixture
def black_hole() -> Iterator[BlackHole]:
    hole = BlackHole()
    yield hole
    hole.close()
