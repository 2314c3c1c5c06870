"""Run a set of services as child processes: start in order, wait for health, stop cleanly.

`moe-l2 up` and the integration tests both use this, so what the tests exercise is what users run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

HealthCheck = Callable[[], bool]


class SupervisorError(Exception):
    """A service failed to start or died; the message is meant for the user."""


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]
    health: HealthCheck
    url: str  # what users are told to point at
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 120.0


def http_ok(url: str, timeout_s: float = 2.0) -> HealthCheck:
    def check() -> bool:
        try:
            return httpx.get(url, timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    return check


def tcp_open(host: str, port: int) -> HealthCheck:
    def check() -> bool:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            return False

    return check


def port_in_use(host: str, port: int) -> bool:
    return tcp_open(host, port)()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class RunningService:
    spec: ServiceSpec
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]

    def tail(self, n: int = 15) -> list[str]:
        self.log_file.flush()
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return lines[-n:]


class Supervisor:
    """Starts services in order; any failure stops everything that was started."""

    def __init__(self, log_dir: Path, echo: Callable[[str], None] | None = None) -> None:
        self.log_dir = log_dir
        self.running: list[RunningService] = []
        self.echo = echo or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def start(self, spec: ServiceSpec) -> RunningService:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.name}.log"
        log_file = log_path.open("ab")
        env = {**os.environ, **spec.env}
        try:
            # A new process group: Ctrl-C in the terminal reaches us, and we stop children in order.
            proc = subprocess.Popen(
                spec.argv, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        except OSError as exc:
            log_file.close()
            raise SupervisorError(f"{spec.name}: cannot start {spec.argv[0]}: {exc.strerror}") from exc
        service = RunningService(spec, proc, log_path, log_file)
        self.running.append(service)
        self._wait_healthy(service)
        return service

    def _wait_healthy(self, service: RunningService) -> None:
        deadline = time.monotonic() + service.spec.start_timeout_s
        while time.monotonic() < deadline:
            if service.proc.poll() is not None:
                raise SupervisorError(self._died_message(service))
            if service.spec.health():
                return
            time.sleep(0.2)
        raise SupervisorError(
            f"{service.spec.name} was not healthy after {service.spec.start_timeout_s:.0f}s; log: {service.log_path}"
        )

    def _died_message(self, service: RunningService) -> str:
        tail = "\n".join(f"    {line}" for line in service.tail())
        return f"{service.spec.name} exited with status {service.proc.returncode}; log: {service.log_path}\n{tail}"

    def watch(self, poll_s: float = 0.5) -> None:
        """Blocks until a service dies (raises) or a signal arrives."""
        while True:
            for service in self.running:
                if service.proc.poll() is not None:
                    raise SupervisorError(self._died_message(service))
            time.sleep(poll_s)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stops services in reverse start order: SIGTERM, then SIGKILL after timeout_s."""
        for service in reversed(self.running):
            proc = service.proc
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    self.echo(f"{service.spec.name} did not stop in {timeout_s:.0f}s; killing it")
                    proc.kill()
                    proc.wait()
            service.log_file.close()
        self.running.clear()
