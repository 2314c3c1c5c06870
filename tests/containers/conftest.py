"""The compose stack of the container test, built and brought up once for the module.

`make test` runs it: a private dockerd (engine.py), the stand-in base images (standins.py), every
image of the CPU variant built by compose, and `docker compose up --wait` of every service but
grafana (no Debian package to stand in for its image: its provisioning is checked by
tests/observability). Where dockerd, debootstrap or compose is missing, a developer's run skips it;
CI (CI set) fails instead, as for the Vulkan tests. Timings of each step are printed at the end of
the run and written to build/container-test-timings.json.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .engine import Engine, EngineError, compose_binary, missing_tools, private_engine, run
from .standins import build_standins

REPO = Path(__file__).resolve().parents[2]
PROJECT = "moe-l2-test"
OVERRIDE = Path(__file__).resolve().parent / "compose.test.yaml"
COMPOSE_FILES = (REPO / "compose.yaml", REPO / "compose.cpu.yaml", OVERRIDE)
# Built in this order, each timed on its own: the small images first, llama's compile last.
IMAGES = ("proxy", "cache-manager", "predictor", "llama")
# Every service `up` starts: all but grafana (see the module docstring).
UP_SERVICES = ("admin-token", "redis", "prometheus", "llama", "cache-manager", "predictor", "proxy")
PREDICTORS = 3
LLAMAS = 2  # each with its own cache-manager (`--scale llama=2 --scale cache-manager=2`)
TORCH_WHEELS_PORT = 11499
TIMINGS_FILE = REPO / "build" / "container-test-timings.json"
TIMINGS: dict[str, float] = {}


@dataclass
class Stack:
    """The running compose project: compose and docker commands bound to it, and its public URL."""

    engine: Engine
    env: dict[str, str]
    port: int
    admin_token: str
    api_key: str  # MOE_L2_PROXY_API_KEYS: the gateway asks every client for it

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def compose(self, *args: str, timeout: float = 600.0, check: bool = True) -> subprocess.CompletedProcess:
        files = [arg for path in COMPOSE_FILES for arg in ("-f", str(path))]
        cmd = [str(compose_binary()), "-p", PROJECT, "--project-directory", str(REPO), *files, *args]
        return run(cmd, env=self.env, timeout=timeout, check=check, cwd=REPO)

    def containers(self, service: str | None = None, *, every: bool = False) -> list[dict]:
        """`compose ps` as dicts (Service, Name, State, Health, Publishers, ExitCode ...)."""
        args = ["ps", "--format", "json", *(["-a"] if every else []), *([service] if service else [])]
        out = self.compose(*args, timeout=60).stdout.strip()
        if not out:
            return []
        # compose prints one JSON object per line
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def exec(self, service: str, *cmd: str, index: int = 1, timeout: float = 120.0) -> str:
        return self.compose("exec", "-T", "--index", str(index), service, *cmd, timeout=timeout).stdout

    def python_in(self, service: str, code: str, *args: str, index: int = 1) -> str:
        return self.exec(service, "python", "-c", code, *args, index=index)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        if Path(str(item.fspath)).resolve().parent == here:
            item.add_marker(pytest.mark.containers)
            item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if TIMINGS:
        terminalreporter.write_line(f"container test timings (s): {json.dumps(TIMINGS)}")


def _record(name: str, started: float) -> None:
    TIMINGS[name] = round(time.monotonic() - started, 1)
    TIMINGS_FILE.parent.mkdir(exist_ok=True)
    TIMINGS_FILE.write_text(json.dumps(TIMINGS, indent=2) + "\n")


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    if missing := missing_tools():
        message = f"the container test needs {', '.join(missing)} (apt-get install docker.io debootstrap)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    started = time.monotonic()
    with private_engine() as eng:
        _record("engine_start_s", started)
        yield eng


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memlock_limit() -> str:
    """This machine's hard RLIMIT_MEMLOCK in bytes, or -1 (unlimited) for compose's ulimits."""
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    return "-1" if hard == resource.RLIM_INFINITY else str(hard)


@pytest.fixture(scope="session")
def torch_find_links() -> Iterator[str]:
    """The machine's local torch wheels (pip's find-links here: the +cpu build) over HTTP on
    127.0.0.1, which builds on the host network reach; empty where there are none."""
    folder = next((Path(p) for p in os.environ.get("PIP_FIND_LINKS", "").split() if Path(p).is_dir()), None)
    if folder is None or not any(folder.glob("torch-*.whl")):
        yield ""
        return
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    # A fixed port where free: the URL is a build argument, and a new one would void the layer cache.
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", TORCH_WHEELS_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def stack(engine: Engine, torch_find_links: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    models = tmp_path_factory.mktemp("models")
    models.chmod(0o755)
    # The services run as uid 10001: the model must be readable by others.
    cli = Path(sys.executable).parent / "moe-l2"
    run([str(cli), "make-demo-model", str(models / "model.gguf")], timeout=300)
    for path in models.iterdir():
        path.chmod(0o644)
    env = engine.env()
    port = _free_port()
    token = os.urandom(16).hex()
    api_key = "key-" + os.urandom(8).hex()
    env.update(
        MOE_L2_MODELS_DIR=str(models),
        MOE_L2_PORT=str(port),
        MOE_L2_ADMIN_TOKEN=token,
        # compose passes the keys to the gateway: every client below sends one
        MOE_L2_PROXY_API_KEYS=f"{api_key},second-key",
        MOE_L2_TEST_TORCH_FIND_LINKS=torch_find_links,
        MOE_L2_TEST_MEMLOCK=_memlock_limit(),
        # small: the demo model needs little, and the llama container must not reserve GiBs
        MOE_L2_LLAMA_CTX_PER_REQUEST="1024",  # x 4 slots: -c 4096
        # two llama replicas: each cache-manager holds the hot set of what the proxy routes to it
        MOE_L2_CACHE_HOT_SET_SCOPE="traffic",
    )
    env.pop("COMPOSE_FILE", None)
    env.pop("COMPOSE_PROJECT_NAME", None)
    stack = Stack(engine=engine, env=env, port=port, admin_token=token, api_key=api_key)

    started = time.monotonic()
    build_standins(engine, TIMINGS)
    for image in IMAGES:
        step = time.monotonic()
        stack.compose("build", image, timeout=3000)
        _record(f"build_{image}_s", step)
    _record("build_total_s", started)

    stack.compose("down", "-v", "--remove-orphans", timeout=300, check=False)
    step = time.monotonic()
    try:
        scale = [f"predictor={PREDICTORS}", f"llama={LLAMAS}", f"cache-manager={LLAMAS}"]
        stack.compose(
            "up", "--wait", "--no-build", *(a for s in scale for a in ("--scale", s)), *UP_SERVICES, timeout=1200
        )
    except EngineError as e:
        logs = stack.compose("logs", "--no-color", "--tail", "40", timeout=120, check=False)
        stack.compose("down", "-v", "--remove-orphans", timeout=300, check=False)
        raise EngineError(f"{e}\nthe services' logs:\n{logs.stdout[-8000:]}") from None
    _record("up_s", step)
    checks = time.monotonic()
    try:
        yield stack
    finally:
        _record("checks_s", checks)
        stack.compose("down", "-v", "--remove-orphans", timeout=300, check=False)
