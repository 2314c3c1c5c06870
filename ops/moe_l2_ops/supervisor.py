"""Run a set of services as child processes: start in order, wait for health, restart the dead, stop cleanly.

`moe-l2 up` and the integration tests both use this, so what the tests exercise is what users run.

The first start is strict: a service that dies or is not healthy in time stops everything, since
that is a configuration problem to show at once. Once the stack is up, `watch()` behaves like
systemd's `Restart=on-failure` (compose's `restart: unless-stopped`): a service that dies is
started again after a backoff (doubling from `RestartPolicy.delay_s` up to `max_delay_s`, back to
the first delay once it has run healthy for `reset_after_s`), health-checked like the first start,
while the others keep serving. `max_failures` failures within `window_s` are a crash loop: that
service's restarts stop with one line; a `required` service (the stack cannot serve without it)
then stops the whole stack, any other one leaves the stack serving without it (degraded).

One loop in the main thread drives every service through a small state machine, and health probes
run on a thread pool, so a service being restarted never delays noticing that another one died, and
Ctrl-C (KeyboardInterrupt in the main thread) stops everything at any moment, restarts included.

The supervisor writes its view to a small JSON state file (`state_path`) at every change, for
`moe-l2 stats` and `moe-l2 doctor`; `read_state()` reads it back.

Each service's output (stdout and stderr, every restart's) goes to `<log_dir>/<name>.log`, rotated
at a size (`LogRotation`, see `ServiceLog` for how and why).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import IO, Any, Literal

import httpx

HealthCheck = Callable[[], bool]
State = Literal["starting", "running", "backoff", "failed", "stopped"]
STATE_FILENAME = "services.json"
STATE_VERSION = 1


class SupervisorError(Exception):
    """A service failed to start or died for good; the message is meant for the user."""


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]
    health: HealthCheck
    url: str  # what users are told to point at
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 120.0
    # False: the stack keeps serving (degraded) when this service's restarts are given up
    required: bool = True
    # how long a stop waits after SIGTERM before SIGKILL; None: the stop's own timeout. The gateway's is
    # its drain (its streams in flight finish) plus a margin, so that a stop never cuts what it drains.
    stop_timeout_s: float | None = None

    def environment(self) -> dict[str, str]:
        """What the process starts with: the supervisor's environment (every MOE_L2_* setting the user
        gave), with this service's own variables over it."""
        return {**os.environ, **self.env}


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead service is started again, and when its restarts are given up."""

    delay_s: float = 0.5  # the first restart's delay; doubles at each failure
    max_delay_s: float = 30.0
    reset_after_s: float = 60.0  # healthy this long: the next failure starts again from delay_s
    max_failures: int = 5  # this many failures within window_s is a crash loop
    window_s: float = 300.0
    probe_interval_s: float = 0.2  # between two health probes of a starting service


# A service's log is rotated at this size, keeping this many old files (<name>.log.1 is the newest).
LOG_MAX_BYTES = 50 * 1024 * 1024
LOG_BACKUPS = 3
READ_CHUNK = 64 * 1024  # one read of a child's pipe, and the most one write to the log holds


@dataclass(frozen=True)
class LogRotation:
    """When a service's log file is rotated: at `max_bytes` (0: never), keeping `backups` old files."""

    max_bytes: int = LOG_MAX_BYTES
    backups: int = LOG_BACKUPS

    def __post_init__(self) -> None:
        if self.max_bytes < 0:
            raise ValueError(f"a log's size limit must be >= 0 (0: no rotation), not {self.max_bytes}")
        # RotatingFileHandler without a backup reopens the same file at each rollover: it would never shrink
        if self.max_bytes and self.backups < 1:
            raise ValueError(f"rotating logs need at least one old file, not {self.backups}")

    @property
    def write_limit(self) -> int:
        """The most one write holds: well under the size limit, so no single write overshoots it."""
        return max(1, min(READ_CHUNK, self.max_bytes // 4)) if self.max_bytes else READ_CHUNK


class ServiceLog:
    """One service's log file, rotated by size; each of its processes (the first and every restart)
    writes to a pipe that a reader thread copies into it through logging's RotatingFileHandler.

    Why a pipe rather than handing the child the file: a child that holds the file itself keeps
    writing to it after a rename, so the only rotation left is copytruncate (copy the file, then
    truncate it from outside), and what the child writes between the copy and the truncation is
    lost. Measured (2026-12, 2 shared cores, load 1.4) with a child printing 300 MB of numbered
    100-byte lines as fast as it can, rotating at 50 MiB: copytruncate checked every 0.2 s lost
    29,211 and 59,924 of the 3,000,000 lines in two runs (1-2%: those written during each 50 MiB
    copy) and let the file reach 64 MB between checks; the pipe lost none and no file passed 50 MiB.
    The pipe's cost is the reader thread: 2.0-2.1 s of CPU for the 300 MB (7 ms per MB), while the
    child itself finished sooner than writing to the file (2.2-2.6 s against 3.8-3.9 s). A chatty
    llama-server writes kilobytes a second, a few microseconds of CPU a second here; and a child
    never waits on the supervisor's loop, only on the reader, which drains the pipe as it fills.

    Lines are kept whole where they fit one write (`LogRotation.write_limit`): a longer line, or
    output without a newline for that long, is cut there (a newline is added). Every file stays
    under the size limit (counted in characters: a non-ASCII line may go a little over).

    What it changes: a `moe-l2 up` killed with SIGKILL takes the read ends with it, so its children
    lose their output from then on (a process that does not ignore SIGPIPE dies of it at its next
    line); they kept writing to the file before.
    """

    def __init__(self, path: Path, rotation: LogRotation) -> None:
        self.path = path
        self.rotation = rotation
        path.parent.mkdir(parents=True, exist_ok=True)
        # surrogateescape both ways: bytes that are not UTF-8 reach the file unchanged
        self._handler = RotatingFileHandler(
            path,
            maxBytes=rotation.max_bytes,
            backupCount=rotation.backups,
            encoding="utf-8",
            errors="surrogateescape",
        )
        self._readers: list[threading.Thread] = []
        self._closed = False

    def attach(self, pipe: IO[bytes]) -> None:
        """Copies what a new process writes to `pipe` into the log, until the process and whatever it
        started have closed it."""
        self._readers = [r for r in self._readers if r.is_alive()]
        reader = threading.Thread(target=self._pump, args=(pipe,), name=f"log-{self.path.stem}", daemon=True)
        reader.start()
        self._readers.append(reader)

    def write(self, text: str) -> None:
        """One piece of text (no trailing newline: the handler adds one)."""
        if not self._closed:
            self._handler.handle(logging.makeLogRecord({"msg": text}))

    def drain(self, timeout_s: float) -> None:
        """Waits (at most timeout_s in all) for the readers of processes that are gone to write what
        those left in their pipes: a dead process's last lines come before what follows them."""
        deadline = time.monotonic() + timeout_s
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))

    def tail(self, n: int) -> list[str]:
        try:
            return self.path.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return []

    def close(self, timeout_s: float = 2.0) -> None:
        """After the processes are stopped: their last lines are written, then the file is closed."""
        self.drain(timeout_s)
        self._closed = True  # a reader held up by a process that escaped its group writes nothing more
        self._handler.close()

    def _pump(self, pipe: IO[bytes]) -> None:
        limit = self.rotation.write_limit
        pending = b""
        with pipe:
            while chunk := pipe.read(READ_CHUNK):
                pending = self._write_lines(pending + chunk, limit)
        if pending:
            self.write(pending.decode("utf-8", "surrogateescape"))

    def _write_lines(self, data: bytes, limit: int) -> bytes:
        """Writes the whole lines of `data` in pieces of at most `limit` bytes; returns the rest."""
        while (cut := data.rfind(b"\n", 0, limit + 1)) >= 0 or len(data) >= limit:
            if cut < 0:  # no newline for `limit` bytes: cut the line there
                piece, data = data[:limit], data[limit:]
            else:
                piece, data = data[:cut], data[cut + 1 :]
            self.write(piece.decode("utf-8", "surrogateescape"))
        return data


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


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


@dataclass
class RunningService:
    spec: ServiceSpec
    proc: subprocess.Popen[bytes]
    log: ServiceLog
    state: State = "starting"
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)  # of the current process
    healthy_at: float | None = None
    deadline: float = 0.0  # a starting process must be healthy by then
    died_at: float | None = None  # when the failure that the current restart repairs was seen
    last_exit: int | None = None
    last_failure: str | None = None
    last_recovery_s: float | None = None  # from that failure to healthy again
    next_start_at: float = 0.0
    delay_s: float = 0.0
    failures: deque[float] = field(default_factory=deque)
    probe: Future[bool] | None = None
    probed_at: float = 0.0

    @property
    def log_path(self) -> Path:
        """The current log file (older output in <name>.log.1, .2, ...)."""
        return self.log.path

    def tail(self, n: int = 15) -> list[str]:
        if self.proc.poll() is not None:
            self.log.drain(timeout_s=2.0)  # its last lines, the ones that say why it died
        return self.log.tail(n)

    def snapshot(self) -> dict[str, Any]:
        now_mono, now = time.monotonic(), time.time()

        def wall(mono: float | None) -> float | None:
            return None if mono is None else round(now - (now_mono - mono), 3)

        alive = self.state in ("starting", "running")
        return {
            "state": self.state,
            "pid": self.proc.pid if alive else None,
            "restarts": self.restarts,
            "required": self.spec.required,
            "url": self.spec.url,
            "log": str(self.log_path),
            "started_at": wall(self.started_at) if alive else None,
            "healthy_since": wall(self.healthy_at) if self.state == "running" else None,
            "last_exit": self.last_exit,
            "last_failure": self.last_failure,
            "last_failure_at": wall(self.died_at),
            "last_recovery_s": None if self.last_recovery_s is None else round(self.last_recovery_s, 3),
            "next_start_at": wall(self.next_start_at) if self.state == "backoff" else None,
            "failures_in_window": len(self.failures),
        }


class Supervisor:
    """Starts services in order, restarts those that die (see the module's docstring), stops them all."""

    def __init__(
        self,
        log_dir: Path,
        echo: Callable[[str], None] | None = None,
        *,
        policy: RestartPolicy | None = None,
        state_path: Path | None = None,
        log_rotation: LogRotation | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.log_rotation = log_rotation or LogRotation()
        self.running: list[RunningService] = []
        self.echo = echo if echo is not None else (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.policy = policy or RestartPolicy()
        self.state_path = state_path
        self._started_at = time.time()
        self._probes: ThreadPoolExecutor | None = None

    # -- the first start -----------------------------------------------------------------------------

    def start(self, spec: ServiceSpec) -> RunningService:
        """Starts one service and waits until it is healthy; raises SupervisorError if it is not."""
        log = ServiceLog(self.log_dir / f"{spec.name}.log", self.log_rotation)
        try:
            proc = self._spawn(spec, log)
        except SupervisorError:
            log.close()
            raise
        service = RunningService(spec, proc, log, delay_s=self.policy.delay_s)
        service.deadline = service.started_at + spec.start_timeout_s
        self.running.append(service)
        self._write_state()
        self._wait_healthy(service)
        service.state, service.healthy_at = "running", time.monotonic()
        self._write_state()
        return service

    def _spawn(self, spec: ServiceSpec, log: ServiceLog) -> subprocess.Popen[bytes]:
        env = spec.environment()
        try:
            # A new process group: Ctrl-C in the terminal reaches us, and we stop children in order.
            # bufsize=0: the reader gets what the child wrote at once, not once a buffer fills.
            proc = subprocess.Popen(
                spec.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True, bufsize=0
            )
        except OSError as exc:
            raise SupervisorError(f"{spec.name}: cannot start {spec.argv[0]}: {exc.strerror}") from exc
        assert proc.stdout is not None  # stdout=PIPE
        log.attach(proc.stdout)
        return proc

    def _wait_healthy(self, service: RunningService) -> None:
        while time.monotonic() < service.deadline:
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
        return (
            f"{service.spec.name} {describe_exit(service.proc.returncode)}; log: {service.log_path}\n{tail}"
        ).rstrip()

    # -- watching and restarting -----------------------------------------------------------------------

    def watch(self, poll_s: float = 0.2) -> None:
        """Restarts services that die until a signal arrives (KeyboardInterrupt) or a required
        service's restarts are given up (SupervisorError)."""
        while True:
            self.step()
            time.sleep(poll_s)

    def step(self) -> None:
        """One pass over every service: notice deaths, start due restarts, collect health probes."""
        now = time.monotonic()
        for service in self.running:
            if service.state in ("starting", "running"):
                returncode = service.proc.poll()
                if returncode is not None:
                    self._kill_group(service)  # whatever it left behind must not hold its port
                    service.last_exit = returncode
                    self._failed(service, describe_exit(returncode), now)
                    continue
            if service.state == "starting":
                self._check_starting(service, now)
            elif service.state == "backoff" and now >= service.next_start_at:
                self._restart(service, now)

    def _check_starting(self, service: RunningService, now: float) -> None:
        probe = service.probe
        if probe is not None and probe.done():
            service.probe = None
            if not probe.exception() and probe.result():
                service.state, service.healthy_at = "running", now
                if service.died_at is not None:
                    service.last_recovery_s = now - service.died_at
                    self.echo(
                        f"{service.spec.name} is back (restart {service.restarts}, "
                        f"healthy {service.last_recovery_s:.1f}s after it failed)"
                    )
                self._write_state()
                return
        if now >= service.deadline:
            if service.probe is not None:
                service.probe.cancel()
                service.probe = None
            # SIGKILL, not SIGTERM and a grace period: waiting here would hold up every other service
            service.proc.kill()
            service.proc.wait()
            self._kill_group(service)
            service.last_exit = service.proc.returncode
            self._failed(service, f"was not healthy {service.spec.start_timeout_s:g}s after its start", now)
            return
        if service.probe is None and now - service.probed_at >= self.policy.probe_interval_s:
            service.probed_at = now
            service.probe = self._probe_pool().submit(service.spec.health)

    def _failed(self, service: RunningService, why: str, now: float) -> None:
        """The service's process is gone (`why`): schedule its restart, or give it up."""
        policy = self.policy
        if (
            service.state == "running"
            and service.healthy_at is not None
            and now - service.healthy_at >= policy.reset_after_s
        ):
            service.delay_s = policy.delay_s  # it had recovered: this is a new incident, not the same loop
        service.healthy_at = None
        service.died_at = now
        service.last_failure = why
        service.failures.append(now)
        while service.failures and now - service.failures[0] > policy.window_s:
            service.failures.popleft()
        name = service.spec.name
        if len(service.failures) >= policy.max_failures:
            service.state = "failed"
            self._write_state()
            loop = f"{len(service.failures)} failures within {policy.window_s:.0f}s"
            if service.spec.required:
                tail = "\n".join(f"    {line}" for line in service.tail())
                raise SupervisorError(
                    f"{name} {why}: {loop}, a crash loop; the stack cannot serve without {name}, "
                    f"so it stops; log: {service.log_path}\n{tail}".rstrip()
                )
            self.echo(
                f"{name} {why}: {loop}, a crash loop; not restarting it, the stack keeps serving "
                f"without it (degraded); log: {service.log_path}"
            )
            return
        delay = service.delay_s
        service.delay_s = min(delay * 2, policy.max_delay_s)
        service.state, service.next_start_at = "backoff", now + delay
        self.echo(f"{name} {why}; restarting it in {delay:.1f}s (restart {service.restarts + 1})")
        self._write_state()

    def _restart(self, service: RunningService, now: float) -> None:
        service.restarts += 1
        # the dead process's last lines first (its group is killed, so its pipe is at its end)
        service.log.drain(timeout_s=1.0)
        marker = f"restart {service.restarts} of {service.spec.name} ({service.last_failure})"
        service.log.write(f"\n---- moe-l2: {marker} ----")
        try:
            service.proc = self._spawn(service.spec, service.log)
        except SupervisorError as exc:
            self._failed(service, f"cannot be started again ({exc})", now)
            return
        service.state, service.started_at = "starting", now
        service.deadline = now + service.spec.start_timeout_s
        service.probe, service.probed_at = None, 0.0
        self._write_state()

    def _probe_pool(self) -> ThreadPoolExecutor:
        if self._probes is None:
            # one probe per starting service at most: a hung health check never delays another's
            self._probes = ThreadPoolExecutor(max_workers=max(2, len(self.running)), thread_name_prefix="health")
        return self._probes

    # -- stopping ------------------------------------------------------------------------------------

    def _terminate(self, service: RunningService, timeout_s: float) -> None:
        """SIGTERM, then SIGKILL after timeout_s; then nothing of its process group is left."""
        proc = service.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                if timeout_s > 0:
                    self.echo(f"{service.spec.name} did not stop in {timeout_s:.0f}s; killing it")
                proc.kill()
                proc.wait()
        self._kill_group(service)

    @staticmethod
    def _kill_group(service: RunningService) -> None:
        try:
            os.killpg(service.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group is empty: nothing left behind

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stops services in reverse start order (the gateway first, so that it drains while its upstreams
        still serve): SIGTERM, then SIGKILL after the service's `stop_timeout_s` (else timeout_s).

        A second Ctrl-C (or SIGTERM) while it waits cuts every grace short: what is left is killed at
        once. Without that, the interrupt would end the stop half-way and leave the rest running."""
        if self._probes is not None:
            self._probes.shutdown(wait=False, cancel_futures=True)
            self._probes = None
        hurry = False
        for service in reversed(self.running):
            if service.state in ("starting", "running"):
                grace = service.spec.stop_timeout_s if service.spec.stop_timeout_s is not None else timeout_s
                try:
                    self._terminate(service, 0.0 if hurry else grace)
                except KeyboardInterrupt:
                    hurry = True
                    self.echo("interrupted again: killing what is left")
                    service.proc.kill()
                    service.proc.wait()
                    self._kill_group(service)
            service.state = "stopped"
            service.log.close()
        self._write_state()
        self.running.clear()

    # -- the state file --------------------------------------------------------------------------------

    def _write_state(self) -> None:
        if self.state_path is None:
            return
        doc = {
            "version": STATE_VERSION,
            "pid": os.getpid(),
            "started_at": self._started_at,
            "updated_at": time.time(),
            "services": {s.spec.name: s.snapshot() for s in self.running},
        }
        try:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_path.with_name(f".{self.state_path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(doc, indent=2) + "\n")
            tmp.replace(self.state_path)  # readers never see half a file
        except OSError as exc:
            self.echo(f"cannot write the supervisor state file {self.state_path}: {exc}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_state(path: Path) -> dict[str, Any] | None:
    """The supervisor's state file, with `live` added (its `moe-l2 up` still runs); None if absent or unreadable."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict):
        return None
    doc["live"] = isinstance(doc.get("pid"), int) and _pid_alive(doc["pid"])
    return doc
