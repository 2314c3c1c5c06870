"""Issue #11 item 4: one service dying must not stop the stack, nor lose a routing count Redis took.

`moe-l2 up` runs the real stack (Redis, the patched llama-server on the demo model, cache-manager,
predictor, gateway) on free ports with its state in a temporary folder. While a client sends chats
through the gateway without pause, each service in turn is killed with SIGKILL. What must hold:

- chats keep succeeding: with the predictor down the gateway falls back to its keyword tier, with
  the cache-manager down it serves without hints; while llama is down the gateway answers 503 (a
  chat llama was answering when it died gets 502), then 200 again; while the gateway itself is down
  the client retries its connection errors, as any client of a restarting server does;
- each service is back, healthy, within RECOVERY_LIMIT_S; the predictor is healthy on its cheap
  tiers (keyword + TF-IDF) while its semantic tier loads in the background, which must then
  become ready (its time from the kill is printed, not asserted);
- no routing count is lost that can be kept. The flywheel's pulls are driven by this test
  (MOE_L2_CACHE_PULL_INTERVAL_S=0) so that every pull's answer is known: Redis' totals (tokens and
  activations, undecayed with MOE_L2_CACHE_DECAY=1) never go below what they were before a kill, are
  unchanged by Redis' own kill -9 (AOF, appendfsync always), and at the end equal exactly the sum of
  what every successful pull took from llama, counts buffered while Redis was down included. What
  llama counted since its last pull dies with llama: no design can keep those without llama
  persisting them (docs/architecture.md, "Restarts").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from moe_l2_ops.supervisor import free_port, port_in_use
from tests.conftest import ADMIN_HEADERS, ADMIN_TOKEN

pytestmark = pytest.mark.llama

RECOVERY_LIMIT_S = 15.0
KILL_ORDER = ("redis", "llama", "cache-manager", "predictor", "proxy")
PROMPTS = (
    "solve the integral of x squared",
    "write a python function that sorts a list",
    "translate good morning into French",
    "why does my program crash with a segmentation fault",
)
# both spellings: the gateway's contract (X-MoE-Admin-Token) and a bearer token
PULL_HEADERS = {**ADMIN_HEADERS, "Authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass
class Chat:
    started: float
    ended: float
    status: int | None  # None: no answer at all within the client's retry budget
    source: str | None = None
    transport_errors: list[tuple[float, str]] = field(default_factory=list)


class Traffic(threading.Thread):
    """One client sending chats through the gateway back to back; connection errors are retried."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.chats: list[Chat] = []
        self.halt = threading.Event()

    def run(self) -> None:
        i = 0
        with httpx.Client(timeout=httpx.Timeout(60, connect=2)) as client:
            while not self.halt.is_set():
                self.chats.append(self.chat(client, PROMPTS[i % len(PROMPTS)]))
                i += 1
                time.sleep(0.1)  # continuous, yet leaving the 2-core CI machine room for restarts

    def chat(self, client: httpx.Client, prompt: str) -> Chat:
        started = time.monotonic()
        errors: list[tuple[float, str]] = []
        while True:
            try:
                resp = client.post(
                    f"{self.url}/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 4},
                )
                source = resp.headers.get("X-MoE-Domain-Source")
                return Chat(started, time.monotonic(), resp.status_code, source, errors)
            except httpx.TransportError as exc:
                errors.append((time.monotonic(), type(exc).__name__))
                if time.monotonic() - started > 3 * RECOVERY_LIMIT_S:
                    return Chat(started, time.monotonic(), None, None, errors)
                time.sleep(0.2)

    def answered_after(self, t: float) -> int:
        return sum(1 for c in list(self.chats) if c.started > t and c.status == 200)


@dataclass
class Counts:
    tokens: int = 0
    activations: float = 0.0

    def __ge__(self, other: Counts) -> bool:
        return self.tokens >= other.tokens and self.activations >= other.activations - 1e-6


def redis_counts(client: redis.Redis) -> Counts:
    """Every model's undecayed totals: routed tokens per domain and activations per routing cell."""
    counts = Counts()
    for key in client.scan_iter("moe:*:tokens"):
        counts.tokens += sum(int(v) for v in client.hgetall(key).values())
    for key in client.scan_iter("moe:*:routing:*"):
        counts.activations += sum(float(v) for v in client.hgetall(key).values())
    return counts


class Pulls:
    """The flywheel's pulls, made by the test: what each successful one took from llama."""

    def __init__(self, cache_url: str) -> None:
        self.url = f"{cache_url}/v1/pull"
        self.taken = Counts()
        self.ok = 0

    def pull(self) -> dict | None:
        try:
            resp = httpx.post(self.url, headers=PULL_HEADERS, timeout=30)
        except httpx.TransportError:
            return None  # the cache-manager is down: nothing was taken from llama
        assert resp.status_code == 200, resp.text
        body = resp.json()
        if body["ok"]:
            self.ok += 1
            self.taken.tokens += body["tokens"]
            self.taken.activations += body["activations"]
        return body

    def settle(self, timeout_s: float = 30) -> None:
        """Pull until a pull reached Redis with nothing left in the cache-manager's buffer."""
        deadline = time.monotonic() + timeout_s
        while True:
            body = self.pull()
            if body and body["ok"] and body["flushed"] and body["buffered_cells"] == 0:
                return
            assert time.monotonic() < deadline, f"no pull reached Redis in {timeout_s}s: {body}"
            time.sleep(0.5)


def service_pids(up_pid: int) -> dict[str, int]:
    """The processes `moe-l2 up` started, by service, found through /proc (whatever `up` says of them)."""
    markers = {
        "redis": "redis-server",
        "llama": "llama-server",
        "cache-manager": "moe_l2_cache",
        "predictor": "moe_l2_predictor",
        "proxy": "moe_l2_proxy",
    }
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) != up_pid or fields[0] == "Z":
            continue
        text = b" ".join(argv[:3]).decode(errors="replace")
        for name, marker in markers.items():
            if marker in text:
                found[name] = int(entry.name)
    return found


def healthy(name: str, ports: dict[str, int]) -> bool:
    if name == "redis":
        try:
            return bool(redis.Redis(port=ports["redis"], socket_timeout=1, socket_connect_timeout=1).ping())
        except redis.RedisError:
            return False
    path = "/health" if name == "llama" else "/healthz"
    try:
        return httpx.get(f"http://127.0.0.1:{ports[name]}{path}", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def predictor_semantic_ready(port: int, killed: float, timeout_s: float = 300) -> float:
    """Seconds from the predictor's kill to its semantic tier loaded again (polled, with a deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()["tier_status"]
        if status["semantic"] == "ready":
            return time.monotonic() - killed
        assert status["semantic"] == "loading", f"the restarted predictor's semantic tier: {status}"
        assert time.monotonic() < deadline, f"the semantic tier still loading {timeout_s}s after the restart"
        time.sleep(0.2)


def wait_for_line(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> str:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if marker in line:
            return "".join(lines)
    raise AssertionError(f"{marker!r} not printed; output so far: {''.join(lines)}")


def drain(proc: subprocess.Popen[str], into: list[str]) -> threading.Thread:
    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            into.append(line)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_every_service_killed_in_turn_under_traffic(llama_binary: Path, tmp_path: Path) -> None:
    ports: dict[str, int] = {}
    while len(set(ports.values())) < 5:
        ports = {name: free_port() for name in KILL_ORDER}
    state_dir = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_L2_") and k != "MODEL"}
    env.update(
        {
            "MOE_L2_ADMIN_TOKEN": ADMIN_TOKEN,
            "MOE_L2_REDIS_PORT": str(ports["redis"]),
            "MOE_L2_LLAMA_PORT": str(ports["llama"]),
            "MOE_L2_CACHE_PORT": str(ports["cache-manager"]),
            "MOE_L2_PREDICTOR_PORT": str(ports["predictor"]),
            "MOE_L2_PROXY_PORT": str(ports["proxy"]),
            "MOE_L2_STATE_DIR": str(state_dir),
            "MOE_L2_LLAMA_SERVER": str(llama_binary),
            "MOE_L2_LLAMA_PARALLEL": "2",
            "MOE_L2_LLAMA_THREADS": "1",
            "MOE_L2_CACHE_POOL_BYTES": str(64 << 20),
            "MOE_L2_CACHE_PULL_INTERVAL_S": "0",  # the test pulls, and knows what each pull took
            "MOE_L2_CACHE_DECAY": "1",  # totals in Redis are plain sums
        }
    )
    up = subprocess.Popen(
        [sys.executable, "-m", "moe_l2_ops.cli", "up"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    output: list[str] = []
    traffic = Traffic(f"http://127.0.0.1:{ports['proxy']}")
    store = redis.Redis(port=ports["redis"], socket_timeout=5, socket_connect_timeout=2)
    pulls = Pulls(f"http://127.0.0.1:{ports['cache-manager']}")
    recovery: dict[str, float] = {}
    windows: dict[str, tuple[float, float]] = {}
    semantic_ready_s = float("nan")  # from the predictor's kill to its semantic tier loaded again
    try:
        output.append(wait_for_line(up, "Ctrl-C stops everything", timeout_s=600))
        drain(up, output)
        traffic.start()
        deadline = time.monotonic() + 60
        while traffic.answered_after(0) < 3:
            assert time.monotonic() < deadline, f"no chat answered: {traffic.chats[-3:]}"
            time.sleep(0.2)
        pulls.settle()
        start = redis_counts(store)
        taken_at_start = Counts(pulls.taken.tokens, pulls.taken.activations)

        for name in KILL_ORDER:
            pulls.settle()
            before = redis_counts(store)
            taken_before = Counts(pulls.taken.tokens, pulls.taken.activations)
            pid = service_pids(up.pid)[name]
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            next_pull = killed + 1.0
            while True:
                now = time.monotonic()
                assert up.poll() is None, f"`moe-l2 up` exited ({up.returncode}) after {name} was killed:\n" + "".join(
                    output
                )
                assert now - killed < RECOVERY_LIMIT_S, (
                    f"{name} not back within {RECOVERY_LIMIT_S}s of its kill -9:\n" + "".join(output[-20:])
                )
                new_pid = service_pids(up.pid).get(name)
                if new_pid not in (None, pid) and healthy(name, ports):
                    back = time.monotonic()
                    break
                if now >= next_pull:  # the flywheel keeps pulling while a service is down
                    pulls.pull()
                    next_pull = now + 1.0
                time.sleep(0.1)
            recovery[name] = back - killed
            windows[name] = (killed, back)
            if name == "predictor":
                # healthy as soon as its cheap tiers answer: the semantic tier loads after that
                status = httpx.get(f"http://127.0.0.1:{ports[name]}/healthz", timeout=5).json()["tier_status"]
                assert status["keyword"] == status["tfidf"] == "ready", status
                assert status["semantic"] in ("loading", "ready"), status
                semantic_ready_s = predictor_semantic_ready(ports[name], killed)
            if name == "redis":
                # Exactly what it had acknowledged before the kill, plus, if a pull reached it since it
                # came back, everything pulled since the kill (buffered by the cache-manager meanwhile).
                since = Counts(
                    before.tokens + pulls.taken.tokens - taken_before.tokens,
                    before.activations + pulls.taken.activations - taken_before.activations,
                )
                now_counts = redis_counts(store)
                assert now_counts in (before, since), f"Redis lost counts: {before} before, {now_counts} after"
            deadline = time.monotonic() + 60
            while traffic.answered_after(back) < 2:
                assert time.monotonic() < deadline, f"no chat answered after {name} came back: {traffic.chats[-3:]}"
                time.sleep(0.2)
            pulls.settle()
            after = redis_counts(store)
            assert after >= before, f"routing counts went down across the restart of {name}: {before} -> {after}"

        traffic.halt.set()
        traffic.join(timeout=120)
        pulls.settle()
        end = redis_counts(store)
        taken = Counts(pulls.taken.tokens - taken_at_start.tokens, pulls.taken.activations - taken_at_start.activations)
        assert end.tokens - start.tokens == taken.tokens
        assert end.activations - start.activations == pytest.approx(taken.activations)
        assert taken.tokens > 0

        # what the user sees: the supervisor's state file, `moe-l2 stats` and `moe-l2 doctor`
        state = json.loads((state_dir / "services.json").read_text())
        for name in KILL_ORDER:
            entry = state["services"][name]
            assert (entry["state"], entry["restarts"], entry["last_exit"]) == ("running", 1, -signal.SIGKILL), entry
            assert entry["pid"] == service_pids(up.pid)[name]
        ops_env = {**env, "MOE_L2_OPS_TIMEOUT_S": "10"}
        stats = subprocess.run(
            [sys.executable, "-m", "moe_l2_ops.cli", "stats", "--json", "--sample", "0"],
            env=ops_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert stats.returncode == 0, stats.stderr
        supervised = json.loads(stats.stdout)["supervisor"]
        assert {name: supervised[name]["restarts"] for name in KILL_ORDER} == dict.fromkeys(KILL_ORDER, 1)
        doctor = subprocess.run(
            [sys.executable, "-m", "moe_l2_ops.cli", "doctor", "--json"],
            env=ops_env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        checks = {c["name"]: c for c in json.loads(doctor.stdout)}
        assert checks["supervisor"]["status"] == "warn", checks["supervisor"]
        for name in KILL_ORDER:
            assert f"{name} running, 1 restarts (last: was killed by SIGKILL" in checks["supervisor"]["detail"]

        # doctor's admin-token checks against these real services: it reports an admin call that
        # answers without the token as open, and a token the services do not share as wrong
        assert checks["admin token"] == {"name": "admin token", "status": "pass", "detail": "from MOE_L2_ADMIN_TOKEN"}
        probes = {
            "cache-manager": (f"http://127.0.0.1:{ports['cache-manager']}/v1/pull", {}),
            "llama": (f"http://127.0.0.1:{ports['llama']}/moe/hot-set", {"layers": None}),
        }
        calls = checks["admin calls"]
        open_calls = [
            n for n, (url, body) in probes.items() if httpx.post(url, json=body, timeout=10).status_code != 401
        ]
        for name in probes:
            assert (f"{name} answered" in calls["detail"] and "admin calls are open" in calls["detail"]) == (
                name in open_calls
            ), calls
        assert calls["status"] == ("fail" if open_calls else "pass"), calls
        wrong = subprocess.run(
            [sys.executable, "-m", "moe_l2_ops.cli", "doctor", "--json"],
            env={**ops_env, "MOE_L2_ADMIN_TOKEN": "not-the-token"},
            capture_output=True,
            text=True,
            timeout=180,
        )
        calls = {c["name"]: c for c in json.loads(wrong.stdout)}["admin calls"]
        assert calls["status"] == "fail" and wrong.returncode == 1
        for name in set(probes) - set(open_calls):
            assert f"{name} answered 401 to POST" in calls["detail"] and "with the token" in calls["detail"], calls

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    finally:
        traffic.halt.set()
        if up.poll() is None:
            up.terminate()  # `up` stops its children on SIGTERM; SIGKILL would orphan them
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
        store.close()
    print("recovery after kill -9 (s): " + ", ".join(f"{n} {t:.1f}" for n, t in recovery.items()))
    print(f"predictor's semantic tier ready {semantic_ready_s:.1f}s after its kill -9")
    assert not any(port_in_use("127.0.0.1", port) for port in ports.values())

    # the chats, phase by phase
    chats = traffic.chats
    assert len(chats) >= 20
    llama_kill, llama_back = windows["llama"]
    proxy_kill, proxy_back = windows["proxy"]
    for chat in chats:
        overlaps_llama = chat.started <= llama_back and chat.ended >= llama_kill
        if chat.status != 200:
            assert overlaps_llama and chat.status in (502, 503), f"a chat failed outside llama's restart: {chat}"
            if chat.started > llama_kill + 0.5:
                assert chat.status == 503, chat
        for at, error in chat.transport_errors:
            assert proxy_kill <= at <= proxy_back + 1.0, f"the gateway was unreachable at {at} ({error})"
    assert any(c.status == 503 for c in chats), "no 503 while llama was down"
    assert any(c.transport_errors and c.status == 200 for c in chats), "no chat was retried while the gateway was down"
    predictor_kill, predictor_back = windows["predictor"]
    during = [c for c in chats if c.started > predictor_kill + 0.2 and c.ended < predictor_back]
    assert all(c.status == 200 for c in during)
    assert any(c.source == "fallback" for c in during), "no keyword fallback while the predictor was down"
    cache_kill, cache_back = windows["cache-manager"]
    assert all(c.status == 200 for c in chats if c.started <= cache_back and c.ended >= cache_kill)
    assert all(t <= RECOVERY_LIMIT_S for t in recovery.values())
