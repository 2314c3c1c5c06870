"""Faults under load, with figures (issue 46): a bounded soak of the real stack while its services are killed.

`moe-l2 up --llama-replicas 2` runs the whole stack (Redis with its AOF, two patched llama-servers on
the demo MoE model, a cache-manager each, the predictor, the gateway) on free loopback ports, its
state in a temporary folder. For a fixed time, 16 to 64 concurrent clients send mixed traffic through
the gateway: OpenAI chat streaming and blocking, Ollama chat and generate (streaming and blocking),
each request with a domain (an X-MoE-Domain header, or a prompt the predictor classifies), some of
the streams closed by their client after a few chunks. Meanwhile each fault in turn hits one service
and the supervisor is left to repair it:

  predictor, cache-manager (replica 1), redis, llama (replica 1 of 2), proxy   SIGKILL
  llama-drain (replica 1 of 2), proxy-drain                                     SIGTERM (their drains)

and at the end the stack itself gets SIGTERM with traffic still running (`stack-stop`): the gateway
must drain before anything is killed.

The nonce. Every request carries a random nonce that its own answer must carry back, so an answer
handed to the wrong client is counted. Nothing in the answer's envelope is end to end: llama-server's
OpenAI answers name its model alias whatever `model` the request gave ("demo.gguf"), and the
gateway's Ollama translation writes the client's `model` itself, so a mixed-up Ollama answer would
still show the right one. The generated text is end to end: every request constrains it with a JSON
schema (`response_format` for OpenAI, Ollama's `format`, which the gateway turns into the same), a
string matching `^<nonce>( [a-z]+)*$`, so llama-server's grammar sampler makes the answer start with
`"<nonce>` and go on for a few dozen words. No mechanism was added for it.

What is counted, per fault (requests by the time they ended, so a request cut by a kill is the kill's):
sent; answered in full (complete, with its own nonce); refused cleanly (503/429 with Retry-After, or an
error event in the stream: OpenAI's SSE `data: {"error"...}`, Ollama's `{"error": ...}` line);
unreachable (the gateway's port refused the connection: nothing was accepted; the client tries again);
cut by their own client (on purpose); cut by the kill (a connection of a gateway killed with SIGKILL,
which no process can answer for: in flight inside it, or sent on a keep-alive connection it held before
its replacement existed, as a client library's retry expects); failed badly (any other 5xx or status, a
stream cut without an error event, no answer within HANG_S, a wrong nonce or no nonce). Recovery:
seconds from the fault until the service is healthy again (a new process, as the supervisor's state file
says) and a request sent after the fault was answered in full, whichever is later. Flywheel: the
cache-managers pull only when told (MOE_L2_CACHE_PULL_INTERVAL_S=0) so that every pull's answer is
known; right before a fault the pulls are settled (llama's counts flushed into Redis, none buffered) and
Redis' totals read (routed tokens and activations, undecayed with MOE_L2_CACHE_DECAY=1): those are
acknowledged. After the repair the pulls are settled again and whatever is missing from those totals is
lost. At the end Redis' growth over the run must equal what the successful pulls took (a pull buffered
while Redis was down included).

Targets: failed badly 0 for every fault; recovery <= 30 s (the gateway: <= 10 s); counts lost 0.

    python bench/faults.py [--minutes 4] [--clients 32] [--faults predictor,cache-manager,...] [--out PATH]

Results: bench/results/faults-<time>.json and a table. tests/test_fault_soak.py runs a short version.
Loopback only; every process it starts is stopped at its end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import redis

from moe_l2_ops.supervisor import free_port, port_in_use, read_state

Outcome = Literal["full", "refused", "unreachable", "client_cut", "cut_by_kill", "bad"]
OUTCOMES: tuple[Outcome, ...] = ("full", "refused", "unreachable", "client_cut", "cut_by_kill", "bad")
FAULTS = ("predictor", "cache-manager", "redis", "llama", "llama-drain", "proxy", "proxy-drain")
# per fault: the stack's service it hits (with two replicas), and the signal
TARGETS: dict[str, tuple[str, signal.Signals]] = {
    "predictor": ("predictor", signal.SIGKILL),
    "cache-manager": ("cache-manager-1", signal.SIGKILL),
    "redis": ("redis", signal.SIGKILL),
    "llama": ("llama-1", signal.SIGKILL),
    # llama-server's drain (--shutdown-timeout): new requests 503, which the gateway retries on the other
    # replica; the streams in flight finish, then it exits and the supervisor starts it again
    "llama-drain": ("llama-1", signal.SIGTERM),
    "proxy": ("proxy", signal.SIGKILL),
    "proxy-drain": ("proxy", signal.SIGTERM),
}
RECOVERY_TARGET_S = {"proxy": 10.0, "proxy-drain": 10.0}
RECOVERY_TARGET_DEFAULT_S = 30.0
HANG_S = 60.0  # no answer (or no end of its stream) within this: a hang, failed badly
RECOVERY_GIVE_UP_S = 120.0  # a fault not repaired by then is reported as such and the soak goes on
DOMAINS = ("codegen", "math", "translate", "debug", "general_qa", "creative_write")
PROMPTS = {
    "codegen": "write a python function that sorts a list of tuples",
    "math": "solve the integral of x squared from 0 to 3",
    "translate": "translate good morning my friend into French",
    "debug": "why does my program crash with a segmentation fault",
    "general_qa": "what is the capital of Australia",
    "creative_write": "write a short poem about the autumn sea",
}
KINDS = ("openai-stream", "openai", "ollama-chat-stream", "ollama-chat", "ollama-generate-stream", "ollama-generate")
NONCE_CHARS = string.ascii_lowercase + string.digits
RESULTS = Path(__file__).resolve().parent / "results"


# -------------------------------------------------------------------------------------------- requests


@dataclass
class Record:
    kind: str
    started: float
    ended: float = 0.0
    outcome: Outcome = "bad"
    status: int | None = None
    detail: str = ""
    transport_cut: bool = False  # the connection broke (the candidates for `cut_by_kill`)


def new_nonce(rng: random.Random) -> str:
    # a letter first: the grammar's string starts with it, and it cannot be mistaken for a number
    return "n" + "".join(rng.choice(NONCE_CHARS) for _ in range(9))


def nonce_schema(nonce: str) -> dict[str, Any]:
    """A JSON string that starts with the nonce, then words: the grammar makes llama generate it."""
    return {"type": "string", "pattern": f"^{nonce}( [a-z]+)*$"}


def request_for(kind: str, nonce: str, domain: str, by_header: bool, max_tokens: int) -> tuple[str, dict, dict]:
    """(path, body, headers) of one request of `kind`."""
    headers = {"X-MoE-Domain": domain} if by_header else {}
    prompt = PROMPTS[domain]
    stream = kind.endswith("-stream")
    if kind.startswith("openai"):
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "nonce", "schema": nonce_schema(nonce)}},
        }
        return "/v1/chat/completions", body, headers
    common = {"stream": stream, "format": nonce_schema(nonce), "options": {"num_predict": max_tokens}}
    if kind.startswith("ollama-chat"):
        return "/api/chat", {"model": "demo", "messages": [{"role": "user", "content": prompt}], **common}, headers
    return "/api/generate", {"model": "demo", "prompt": prompt, **common}, headers


def nonce_problem(text: str, nonce: str, complete: bool) -> str | None:
    """Why `text` is not an answer to the request with `nonce` (None: it is). A partial text (a stream cut on
    purpose) must agree with the nonce as far as it goes."""
    expected = '"' + nonce
    got = text.lstrip()
    if not complete:
        shared = min(len(got), len(expected))
        return None if got[:shared] == expected[:shared] else f"wrong nonce: {got[:40]!r} for {nonce}"
    if expected.startswith(got):
        return f"ended before its whole nonce: {got!r} for {nonce}"  # too few tokens: a bug of this bench
    if not got.startswith(expected):
        return f"wrong nonce: {got[:40]!r} for {nonce}"
    rest = got[len(expected) :]
    if rest and rest[0] not in ' "':
        return f"wrong nonce: {got[:40]!r} for {nonce}"
    return None


class Stream:
    """What one streamed answer said, event by event, in either API's format."""

    def __init__(self, openai: bool) -> None:
        self.openai = openai
        self.text = ""
        self.chunks = 0
        self.done = False
        self.error: str | None = None

    def feed(self, line: str) -> None:
        if self.openai:
            if not line.startswith("data: "):
                return
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                self.done = True
                return
        else:
            payload = line
        if not payload.strip():
            return
        try:
            event = json.loads(payload)
        except ValueError:
            self.error = self.error or f"not JSON: {payload[:80]!r}"
            return
        if "error" in event:
            self.error = str(event["error"])[:200]
            return
        self.chunks += 1
        if self.openai:
            for choice in event.get("choices") or []:
                self.text += (choice.get("delta") or {}).get("content") or ""
        else:
            self.text += (event.get("message") or {}).get("content") or event.get("response") or ""
            if event.get("done"):
                self.done = True


def blocking_text(kind: str, body: dict[str, Any]) -> str:
    if kind.startswith("openai"):
        return str(body["choices"][0]["message"]["content"] or "")
    if not body.get("done"):
        raise ValueError("an Ollama answer without done=true")
    return str((body.get("message") or {}).get("content") or body.get("response") or "")


async def send_one(client: httpx.AsyncClient, base: str, kind: str, rng: random.Random) -> Record:
    """One request, classified; never raises."""
    domain = rng.choice(DOMAINS)
    nonce = new_nonce(rng)
    stream = kind.endswith("-stream")
    cut_after = rng.randint(1, 4) if stream and rng.random() < 0.1 else None  # the client leaves mid-stream
    path, body, headers = request_for(kind, nonce, domain, rng.random() < 0.5, rng.randint(48, 80))
    record = Record(kind, time.monotonic())
    try:
        await asyncio.wait_for(exchange(client, base + path, body, headers, kind, nonce, cut_after, record), HANG_S)
    except TimeoutError:
        record.outcome, record.detail = "bad", f"no answer within {HANG_S:g}s (a hang)"
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        record.outcome, record.detail = "unreachable", f"no connection: {type(exc).__name__}"
    except httpx.TransportError as exc:
        record.outcome, record.detail, record.transport_cut = "bad", f"connection broke: {type(exc).__name__}", True
    record.ended = time.monotonic()
    return record


async def exchange(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    kind: str,
    nonce: str,
    cut_after: int | None,
    record: Record,
) -> None:
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        record.status = resp.status_code
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")[:200]
            clean = resp.status_code in (429, 503) and resp.headers.get("retry-after")
            record.outcome = "refused" if clean else "bad"
            unclean = " without Retry-After" if resp.status_code in (429, 503) and not clean else ""
            record.detail = f"{resp.status_code}{unclean}: {text}"
            return
        if not kind.endswith("-stream"):
            raw = await resp.aread()
            try:
                text = blocking_text(kind, json.loads(raw))
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                record.outcome, record.detail = "bad", f"unreadable answer ({exc}): {raw[:120]!r}"
                return
            problem = nonce_problem(text, nonce, complete=True)
            record.outcome, record.detail = ("bad", problem) if problem else ("full", "")
            return
        events = Stream(openai=kind.startswith("openai"))
        async for line in resp.aiter_lines():
            events.feed(line)
            if events.error is not None:
                break
            if cut_after is not None and events.chunks >= cut_after:
                problem = nonce_problem(events.text, nonce, complete=False)
                record.outcome, record.detail = ("bad", problem) if problem else ("client_cut", "")
                return
        if events.error is not None:
            # a clean ending, unless what came before it was someone else's answer
            problem = nonce_problem(events.text, nonce, complete=False)
            record.outcome, record.detail = ("bad", problem) if problem else ("refused", f"error event: {events.error}")
            return
        if not events.done:
            record.outcome, record.detail = (
                "bad",
                f"stream ended without its end or an error event ({events.chunks} chunks)",
            )
            record.transport_cut = True
            return
        problem = nonce_problem(events.text, nonce, complete=True)
        record.outcome, record.detail = ("bad", problem) if problem else ("full", "")


class Traffic:
    """`clients` concurrent clients sending back to back until stopped; every request's record kept."""

    def __init__(self, base: str, clients: int, seed: int) -> None:
        self.base = base
        self.clients = clients
        self.seed = seed
        self.records: list[Record] = []
        self.stopping = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for i in range(self.clients):
            self.tasks.append(asyncio.create_task(self._client(i)))

    async def _client(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(timeout=httpx.Timeout(HANG_S, connect=2.0), limits=limits) as client:
            while not self.stopping.is_set():
                record = await send_one(client, self.base, rng.choice(KINDS), rng)
                self.records.append(record)
                if record.outcome in ("unreachable", "refused"):
                    await asyncio.sleep(0.2)  # as a client honouring Retry-After would, briefly

    async def stop(self) -> None:
        self.stopping.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def full_after(self, t: float) -> float | None:
        """When the first request sent after `t` was answered in full."""
        ends = [r.ended for r in list(self.records) if r.started > t and r.outcome == "full"]
        return min(ends) if ends else None


# -------------------------------------------------------------------------------------------- flywheel


@dataclass
class Counts:
    tokens: int = 0
    activations: float = 0.0

    def shortfall(self, other: Counts) -> Counts:
        """What `other` lacks of self (0 where it has as much or more)."""
        return Counts(max(0, self.tokens - other.tokens), max(0.0, round(self.activations - other.activations, 6)))


def redis_counts(port: int) -> Counts:
    """Redis' undecayed totals of every model: routed tokens per domain, activations per routing cell."""
    client = redis.Redis(port=port, socket_timeout=5, socket_connect_timeout=2)
    try:
        counts = Counts()
        for key in client.scan_iter("moe:*:tokens"):
            counts.tokens += sum(int(v) for v in client.hgetall(key).values())
        for key in client.scan_iter("moe:*:routing:*"):
            counts.activations += sum(float(v) for v in client.hgetall(key).values())
        return counts
    finally:
        client.close()


class Puller:
    """The flywheel's pulls for one cache-manager, made here so that what each one took is known."""

    def __init__(self, url: str, admin_token: str) -> None:
        self.url = f"{url}/v1/pull"
        self.headers = {"X-MoE-Admin-Token": admin_token}
        self.taken = Counts()
        self.lock = asyncio.Lock()

    async def pull(self, client: httpx.AsyncClient) -> dict[str, Any] | None:
        async with self.lock:
            return await self.pull_held(client)

    async def pull_held(self, client: httpx.AsyncClient) -> dict[str, Any] | None:
        """One pull, the lock held by the caller."""
        try:
            resp = await client.post(self.url, headers=self.headers, timeout=30)
        except httpx.TransportError:
            return None  # the cache-manager is down: nothing was taken from llama
        if resp.status_code != 200:
            return None
        body: dict[str, Any] = resp.json()
        if body.get("ok"):
            self.taken.tokens += int(body["tokens"])
            self.taken.activations += float(body["activations"])
        return body

    async def settle(self, client: httpx.AsyncClient, timeout_s: float = 60.0, *, held: bool = False) -> bool:
        """Pulls until one reached Redis with nothing left buffered; False if none did in time. `held`: the
        caller holds the lock (no other pull may come between this one and what the caller reads next)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            body = await (self.pull_held(client) if held else self.pull(client))
            if body and body.get("ok") and body.get("flushed") and body.get("buffered_cells") == 0:
                return True
            await asyncio.sleep(0.5)
        return False


# -------------------------------------------------------------------------------------------- the stack


@dataclass
class Stack:
    """`moe-l2 up` running as a child process, with what it was given."""

    proc: subprocess.Popen[bytes]
    state_dir: Path
    ports: dict[str, int]
    admin_token: str
    log: Path

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.ports['proxy']}"

    def services(self) -> dict[str, Any]:
        state = read_state(self.state_dir / "services.json")
        return state["services"] if state else {}

    def all_running(self) -> bool:
        services = self.services()
        return bool(services) and all(s["state"] == "running" for s in services.values())


def replica_ports(replicas: int) -> dict[str, int]:
    """Free ports for every service; the llama and cache-manager bases with their replicas' (+100·i) free too."""
    taken: set[int] = set()
    ports: dict[str, int] = {}
    for name in ("redis", "llama", "cache-manager", "predictor", "proxy"):
        while True:
            port = free_port()
            needed = [port + 100 * i for i in range(replicas if name in ("llama", "cache-manager") else 1)]
            if all(p <= 65535 and p not in taken and not port_in_use("127.0.0.1", p) for p in needed):
                taken.update(needed)
                ports[name] = port
                break
    return ports


def start_stack(state_dir: Path, replicas: int, llama_server: Path | None, extra_env: dict[str, str]) -> Stack:
    ports = replica_ports(replicas)
    admin_token = "faults-" + "".join(random.choice(NONCE_CHARS) for _ in range(16))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_L2_") and k != "MODEL"}
    env.update(
        {
            "MOE_L2_ADMIN_TOKEN": admin_token,
            "MOE_L2_REDIS_PORT": str(ports["redis"]),
            "MOE_L2_LLAMA_PORT": str(ports["llama"]),
            "MOE_L2_CACHE_PORT": str(ports["cache-manager"]),
            "MOE_L2_PREDICTOR_PORT": str(ports["predictor"]),
            "MOE_L2_PROXY_PORT": str(ports["proxy"]),
            "MOE_L2_STATE_DIR": str(state_dir),
            "MOE_L2_LLAMA_PARALLEL": "4",
            "MOE_L2_LLAMA_THREADS": "1",
            "MOE_L2_CACHE_POOL_BYTES": str(64 << 20),
            "MOE_L2_CACHE_PULL_INTERVAL_S": "0",  # this soak pulls, and knows what each pull took
            "MOE_L2_CACHE_DECAY": "1",  # Redis' totals are plain sums
            # several kills of one service within minutes are this soak's doing, not a crash loop
            "MOE_L2_RESTART_MAX_FAILURES": "20",
        }
    )
    if llama_server is not None:
        env["MOE_L2_LLAMA_SERVER"] = str(llama_server)
    env.update(extra_env)
    state_dir.mkdir(parents=True, exist_ok=True)
    log = state_dir / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moe_l2_ops.cli", "up", "--llama-replicas", str(replicas)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    stack = Stack(proc, state_dir, ports, admin_token, log)
    deadline = time.monotonic() + 900  # a cold llama build is minutes; a cached one, seconds
    while b"Ctrl-C stops everything" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_stack(stack)
            raise RuntimeError(f"`moe-l2 up` did not come up; its output:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    return stack


def stop_stack(stack: Stack, timeout_s: float = 90.0) -> int:
    """SIGTERM to `moe-l2 up` (it stops its children, the gateway first, with its drain); SIGKILL if stuck."""
    if stack.proc.poll() is None:
        stack.proc.send_signal(signal.SIGTERM)
        try:
            stack.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # `up` stuck: its children are in their own sessions, so kill them by the pids it recorded
            for service in stack.services().values():
                if isinstance(service.get("pid"), int):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(service["pid"], signal.SIGKILL)
            stack.proc.kill()
            stack.proc.wait()
    return stack.proc.returncode


# -------------------------------------------------------------------------------------------- faults


@dataclass
class FaultResult:
    fault: str
    service: str
    signal: str
    at_s: float  # from the soak's start
    sent: int = 0
    full: int = 0
    refused: int = 0
    unreachable: int = 0
    client_cut: int = 0
    cut_by_kill: int = 0
    bad: int = 0
    back_s: float | None = None  # the service healthy again, a new process
    requests_ok_s: float | None = None  # a request sent after the fault answered in full
    recovery_s: float | None = None
    recovery_target_s: float = RECOVERY_TARGET_DEFAULT_S
    acknowledged: dict[str, float] = field(default_factory=dict)
    present_after: dict[str, float] = field(default_factory=dict)
    counts_lost: dict[str, float] = field(default_factory=dict)
    bad_examples: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what missed a target, in words


@dataclass
class SoakConfig:
    duration_s: float = 240.0
    clients: int = 32
    faults: tuple[str, ...] = FAULTS
    rounds: int = 1  # each fault this many times (the faults spread over duration_s)
    replicas: int = 2
    seed: int = 46
    llama_server: Path | None = None
    state_dir: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)  # for the stack (a test's planted settings)
    warmup_s: float = 10.0
    stop_stack_under_load: bool = True


@dataclass
class SoakReport:
    config: dict[str, Any]
    faults: list[FaultResult]
    flywheel: dict[str, Any]
    duration_s: float
    stack_exit: int | None
    up_log_tail: str = ""

    def problems(self) -> list[str]:
        found = [f"{f.fault}: {p}" for f in self.faults for p in f.problems]
        if self.flywheel.get("lost_tokens") or self.flywheel.get("lost_activations"):
            found.append(f"flywheel over the run: {self.flywheel}")
        if self.stack_exit not in (0, None):
            found.append(f"`moe-l2 up` exited with {self.stack_exit}")
        return found

    def table(self) -> str:
        head = (
            f"{'fault':<14}{'signal':<9}{'sent':>6}{'full':>6}{'refused':>8}{'unreach':>8}{'c-cut':>6}"
            f"{'k-cut':>6}{'bad':>5}{'back s':>8}{'req s':>7}{'recov s':>8}{'target':>7}{'lost':>6}"
        )
        lines = [head, "-" * len(head)]

        def num(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"

        for f in self.faults:
            lost = int(f.counts_lost.get("tokens", 0)) if f.counts_lost else "-"
            lines.append(
                f"{f.fault:<14}{f.signal:<9}{f.sent:>6}{f.full:>6}{f.refused:>8}{f.unreachable:>8}{f.client_cut:>6}"
                f"{f.cut_by_kill:>6}{f.bad:>5}{num(f.back_s):>8}{num(f.requests_ok_s):>7}{num(f.recovery_s):>8}"
                f"{f.recovery_target_s:>7.0f}{lost!s:>6}"
            )
        fw = self.flywheel
        lines.append(
            f"flywheel: {fw.get('pulled_tokens')} tokens pulled and acknowledged over the run, Redis grew by "
            f"{fw.get('redis_growth_tokens')}; lost {fw.get('lost_tokens')} tokens, {fw.get('lost_activations')} "
            "activations"
        )
        lines.append("problems: " + ("; ".join(self.problems()) or "none"))
        return "\n".join(lines)


class Soak:
    def __init__(self, config: SoakConfig, stack: Stack) -> None:
        self.config = config
        self.stack = stack
        self.traffic = Traffic(stack.gateway, config.clients, config.seed)
        n = config.replicas
        names = ["cache-manager"] if n == 1 else [f"cache-manager-{i + 1}" for i in range(n)]
        self.pullers = {
            name: Puller(f"http://127.0.0.1:{stack.ports['cache-manager'] + 100 * i}", stack.admin_token)
            for i, name in enumerate(names)
        }
        self.http = httpx.AsyncClient()
        self.t0 = time.monotonic()
        self.results: list[FaultResult] = []
        self.windows: list[tuple[float, FaultResult]] = []  # (fault's time, its result), in order
        self.dead_at: dict[int, float] = {}  # a SIGKILLed process gone (by its result's id)
        self.replaced_at: dict[int, float] = {}  # its replacement's start (by its result's id)

    def target(self, fault: str) -> tuple[str, signal.Signals]:
        service, sig = TARGETS[fault]
        if self.config.replicas == 1:  # one replica's services have no number
            service = service.removesuffix("-1")
        return service, sig

    async def settle_all(self) -> bool:
        results = await asyncio.gather(*(p.settle(self.http) for p in self.pullers.values()))
        return all(results)

    async def background_pulls(self) -> None:
        """The flywheel's rhythm: every cache-manager pulled every second, whatever is down."""
        while True:
            await asyncio.gather(*(p.pull(self.http) for p in self.pullers.values()))
            await asyncio.sleep(1.0)

    async def snapshot(self) -> tuple[Counts, Counts]:
        """(Redis' totals, what the pulls took), read together: every puller's lock is held from its last
        settling pull to the read, so no pull lands in one and not the other."""
        async with contextlib.AsyncExitStack() as locks:
            for puller in self.pullers.values():
                await locks.enter_async_context(puller.lock)
            await asyncio.gather(*(p.settle(self.http, held=True) for p in self.pullers.values()))
            counts = await asyncio.to_thread(redis_counts, self.stack.ports["redis"])
            return counts, self.taken()

    def taken(self) -> Counts:
        return Counts(
            sum(p.taken.tokens for p in self.pullers.values()),
            sum(p.taken.activations for p in self.pullers.values()),
        )

    async def run(self) -> SoakReport:
        config = self.config
        self.traffic.start()
        pulls = asyncio.create_task(self.background_pulls())
        try:
            await asyncio.sleep(config.warmup_s)
            start_counts, start_taken = await self.snapshot()
            plan = [f for _ in range(config.rounds) for f in config.faults]
            period = max(0.0, (config.duration_s - config.warmup_s) / max(1, len(plan)))
            for i, fault in enumerate(plan):
                due = self.t0 + config.warmup_s + period * i
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                await self.inflict(fault)
            await asyncio.sleep(max(0.0, self.t0 + config.duration_s - time.monotonic()))
            pulls.cancel()  # no pull from here on: the last snapshot is the run's end
            end_counts, taken = await self.snapshot()
            stack_exit = await self.stop_under_load() if config.stop_stack_under_load else None
        finally:
            pulls.cancel()
            await self.traffic.stop()
            await self.http.aclose()
        self.attribute()
        pulled = Counts(taken.tokens - start_taken.tokens, taken.activations - start_taken.activations)
        growth = Counts(end_counts.tokens - start_counts.tokens, end_counts.activations - start_counts.activations)
        lost = pulled.shortfall(growth)
        flywheel = {
            "pulled_tokens": pulled.tokens,
            "pulled_activations": round(pulled.activations, 3),
            "redis_growth_tokens": growth.tokens,
            "redis_growth_activations": round(growth.activations, 3),
            "lost_tokens": lost.tokens,
            "lost_activations": lost.activations,
        }
        return SoakReport(
            config={k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
            faults=self.results,
            flywheel=flywheel,
            duration_s=round(time.monotonic() - self.t0, 1),
            stack_exit=stack_exit,
        )

    async def inflict(self, fault: str) -> None:
        service, sig = self.target(fault)
        result = FaultResult(fault, service, sig.name, round(time.monotonic() - self.t0, 1))
        result.recovery_target_s = RECOVERY_TARGET_S.get(fault, RECOVERY_TARGET_DEFAULT_S)
        self.results.append(result)
        if not await self.settle_all():
            result.problems.append("the flywheel's pulls did not settle before the fault")
        before = await asyncio.to_thread(redis_counts, self.stack.ports["redis"])
        entry = self.stack.services().get(service) or {}
        pid = entry.get("pid")
        if not isinstance(pid, int) or entry.get("state") != "running":
            result.problems.append(f"{service} was not running before the fault: {entry}")
            self.windows.append((time.monotonic(), result))
            return
        at = time.monotonic()
        self.windows.append((at, result))
        os.kill(pid, sig)
        if sig == signal.SIGKILL:
            # until the process is gone, its listening socket still accepts: those connections die with it
            self.dead_at[id(result)] = await asyncio.to_thread(wait_gone, pid)
        # back: the supervisor's state says running, with another process
        while True:
            now = time.monotonic()
            current = self.stack.services().get(service) or {}
            if current.get("state") == "running" and current.get("pid") not in (None, pid):
                result.back_s = round(now - at, 2)
                if (started := process_started_at(current["pid"])) is not None:
                    self.replaced_at[id(result)] = started
                break
            if self.stack.proc.poll() is not None:
                result.problems.append(f"`moe-l2 up` exited ({self.stack.proc.returncode}) after the fault")
                return
            if now - at > RECOVERY_GIVE_UP_S:
                result.problems.append(f"{service} not back within {RECOVERY_GIVE_UP_S:g}s")
                return
            await asyncio.sleep(0.1)
        while (ok_at := self.traffic.full_after(at)) is None:
            if time.monotonic() - at > RECOVERY_GIVE_UP_S:
                result.problems.append(f"no request answered in full within {RECOVERY_GIVE_UP_S:g}s")
                return
            await asyncio.sleep(0.1)
        result.requests_ok_s = round(ok_at - at, 2)
        result.recovery_s = max(result.back_s, result.requests_ok_s)
        if result.recovery_s > result.recovery_target_s:
            result.problems.append(f"recovery {result.recovery_s:.1f}s > target {result.recovery_target_s:g}s")
        if not await self.settle_all():
            result.problems.append("the flywheel's pulls did not settle after the repair")
        after = await asyncio.to_thread(redis_counts, self.stack.ports["redis"])
        lost = before.shortfall(after)
        result.acknowledged = asdict(before)
        result.present_after = asdict(after)
        result.counts_lost = asdict(lost)
        if lost.tokens or lost.activations:
            result.problems.append(f"acknowledged flywheel counts lost: {asdict(lost)} of {asdict(before)}")

    async def stop_under_load(self) -> int:
        """SIGTERM to `moe-l2 up` with the clients still sending: the streams in flight must end well."""
        result = FaultResult("stack-stop", "moe-l2 up", "SIGTERM", round(time.monotonic() - self.t0, 1))
        self.results.append(result)
        at = time.monotonic()
        self.windows.append((at, result))
        code = await asyncio.to_thread(stop_stack, self.stack)
        # requests sent once the gateway was gone are unreachable, as they should be; stop sending
        await self.traffic.stop()
        if code != 0:
            result.problems.append(f"`moe-l2 up` exited with {code} on SIGTERM")
        return code

    def connections_owned_until(self, result: FaultResult) -> float:
        """Until when every connection to the port was the killed process's: its replacement's start
        (nothing else listened before it), or when it was seen gone where the start is unknown."""
        return self.replaced_at.get(id(result)) or self.dead_at.get(id(result), self.fault_time(result))

    def attribute(self) -> None:
        """Each request to the phase its end fell in (warm-up before the first fault); then the counts."""
        warmup = FaultResult("(no fault)", "-", "-", 0.0)
        phases = [(self.t0, warmup), *self.windows]
        for record in self.traffic.records:
            owner = warmup
            for at, result in phases:
                if record.ended >= at:
                    owner = result
            if (
                record.outcome == "bad"
                and record.transport_cut
                and owner.fault == "proxy"
                # sent before another process could have its connection, cut after the signal: the
                # killed gateway's (accepted before it was gone, or a keep-alive connection it held that
                # the pool handed out as the kill closed it; the client may see the cut before the poll
                # of /proc sees the process gone: ended < dead_at then)
                and record.started < self.connections_owned_until(owner)
                and record.ended >= self.fault_time(owner)
            ):
                record.outcome = "cut_by_kill"
            owner.sent += 1
            setattr(owner, record.outcome, getattr(owner, record.outcome) + 1)
            if record.outcome == "bad" and len(owner.bad_examples) < 5:
                at = self.fault_time(owner) if owner is not warmup else self.t0
                owner.bad_examples.append(
                    f"{record.kind} sent {record.started - at:+.2f}s, ended {record.ended - at:+.2f}s: {record.detail}"
                )
        for result in [warmup, *self.results]:
            if result.bad:
                result.problems.append(f"{result.bad} failed badly, e.g. {result.bad_examples}")
        self.results.insert(0, warmup)

    def fault_time(self, result: FaultResult) -> float:
        return next(at for at, r in self.windows if r is result)


def wait_gone(pid: int, timeout_s: float = 10.0) -> float:
    """When process `pid` was seen gone (or a zombie: its sockets are closed then)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            break
        if state == "Z":
            break
        time.sleep(0.01)
    return time.monotonic()


def process_started_at(pid: int) -> float | None:
    """When process `pid` started, on time.monotonic()'s clock (None: gone). /proc gives it in clock ticks
    since boot, rounded down, so the value is never later than the start."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
    since_boot = ticks / os.sysconf("SC_CLK_TCK")
    return since_boot - time.clock_gettime(time.CLOCK_BOOTTIME) + time.monotonic()


@contextlib.contextmanager
def state_folder(given: Path | None) -> Iterator[Path]:
    if given is not None:
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="moe-l2-faults-") as tmp:
        yield Path(tmp)


def run_soak(config: SoakConfig) -> SoakReport:
    """Starts the stack, runs the soak, stops everything; the report whatever happened."""
    with state_folder(config.state_dir) as state_dir:
        stack = start_stack(state_dir / "state", config.replicas, config.llama_server, config.extra_env)
        try:
            report = asyncio.run(Soak(config, stack).run())
        finally:
            exit_code = stop_stack(stack)
        if report.stack_exit is None:
            report.stack_exit = exit_code
        report.up_log_tail = stack.log.read_text(errors="replace")[-4000:]
        leftover = [name for name, port in stack.ports.items() if port_in_use("127.0.0.1", port)]
        if leftover:
            report.faults[-1].problems.append(f"ports still in use after the stop: {leftover}")
    return report


def write_report(report: SoakReport, out: Path | None) -> Path:
    if out is None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / f"faults-{time.strftime('%Y%m%d-%H%M%S')}.json"
    doc = {
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **asdict(report),
        "problems": report.problems(),
    }
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=4.0, help="the soak's length (1 to 30)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (16 to 64)")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"in this order; of {', '.join(FAULTS)}")
    parser.add_argument("--rounds", type=int, default=1, help="each fault this many times")
    parser.add_argument("--llama-server", type=Path, default=None, help="default: what `moe-l2 up` finds or builds")
    parser.add_argument("--seed", type=int, default=46)
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/faults-<time>.json")
    args = parser.parse_args(argv)
    if not 1 <= args.minutes <= 30:
        parser.error("--minutes: 1 to 30 (the soak is bounded)")
    if not 16 <= args.clients <= 64:
        parser.error("--clients: 16 to 64")
    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip())
    if unknown := [f for f in faults if f not in FAULTS]:
        parser.error(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    if not 1 <= args.rounds <= 10:
        parser.error("--rounds: 1 to 10")
    config = SoakConfig(
        duration_s=args.minutes * 60,
        clients=args.clients,
        faults=faults,
        rounds=args.rounds,
        seed=args.seed,
        llama_server=args.llama_server,
    )
    report = run_soak(config)
    path = write_report(report, args.out)
    print(report.table())
    print(f"\nwritten: {path}")
    return 1 if report.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
