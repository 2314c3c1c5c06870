"""A rolling restart of two gateway replicas under load loses no request (issue 46), measured.

Two gateway processes (`python -m moe_l2_proxy`) on loopback, both in front of one real llama-server
(the CPU build, the demo MoE model), behind a real load balancer: Debian's nginx, run in the foreground
with its own config, pid and logs in a temporary folder (NGINX_CONF below; not the system's service).
A bounded client load (CLIENTS concurrent clients, loopback only, at most MAX_REQUESTS requests and
DEADLINE_S seconds) sends mixed traffic through nginx: OpenAI chat streaming and blocking, Ollama chat
streaming and blocking. Meanwhile each gateway in turn gets SIGTERM, drains (docs/proxy.md
"Shutdown") and exits, is started again on the same port and becomes healthy; then the other.

Counted: requests sent; answered in full (200 and a complete answer: an OpenAI stream ending with
`data: [DONE]`, an Ollama stream ending with `"done": true`, a blocking answer with its finish reason,
none with an error in it); failed (anything else: another status, a stream cut or ending with an error
event, a connection error, no answer within REQUEST_TIMEOUT_S). Per restart: seconds from SIGTERM to
the old process' exit (its drain), from the new process' start to its first healthy /healthz, and in
all; the requests in flight in it at SIGTERM (its log). From nginx's access log: how many requests it
retried on the other gateway, and what the first gateway had answered them (503: the drain's refusal;
502: a connection refused or reset).

Target: failed 0.

    python bench/rolling_restart.py [--clients 12] [--settle 8] [--out bench/results/rolling-restart.json]

tests/proxy/test_rolling_restart.py runs a short version. Every process it starts is stopped at its end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from moe_l2_gguf.demo_model import make_demo_model
from moe_l2_llama.command_line import llama_server_command, llama_server_env
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.supervisor import RunningService, ServiceSpec, Supervisor, free_port, http_ok

Kind = Literal["openai_stream", "openai_block", "ollama_stream", "ollama_block"]
KINDS: tuple[Kind, ...] = ("openai_stream", "openai_block", "ollama_stream", "ollama_block")
REQUEST_TIMEOUT_S = 120.0  # far above any answer here: a request still unanswered then has hung
EXAMPLES = 10  # failures kept verbatim in the report

# The load balancer. Why each line:
# - `proxy_next_upstream error timeout http_503 non_idempotent`: generations are POSTs, which nginx
#   never sends twice unless told (non_idempotent), since a POST that did its work must not be done
#   again. Sending one again is right exactly where no work was done: `error` is a connection refused
#   or reset before any answer (a gateway that stopped listening; nothing was accepted), `timeout` one
#   that could not be connected to within proxy_connect_timeout, and `http_503` the gateway's refusals
#   before any work (its drain's `shutting_down`, `overloaded`, `too_many_connections`, or a request
#   the drain's grace ended before llama answered, whose llama request is cancelled). nginx retries
#   only while it has sent nothing to the client, so a stream already flowing is never sent again.
#   Read timeouts are long (proxy_read_timeout) so that a slow generation is not taken for a dead
#   gateway and run twice.
# - `max_fails=0`: no passive "down" marking. With the default (1 failure -> down for 10 s), the
#   restarted gateway would still be marked down when the other one starts draining, and with both
#   marked down nginx answers 502 "no live upstreams" itself. Every request tries a gateway and, if it
#   refuses, the other: one wasted round trip on loopback during a drain, nothing lost.
# - `proxy_buffering off`: a stream's events reach the client as the gateway sends them.
# - upstream `keepalive` with HTTP/1.1 and an empty Connection header: nginx reuses its connections to
#   the gateways, as a real deployment does. A drained gateway closes its idle ones; a request nginx
#   had just written on one is retried (`error`, and nginx gives a cached connection an extra try).
NGINX_CONF = """\
{user}daemon off;
master_process on;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    log_format upstreams '$request_method $request_uri $status "$upstream_addr" "$upstream_status"';
    access_log {dir}/access.log upstreams;
    upstream gateways {{
        server 127.0.0.1:{port_a} max_fails=0;
        server 127.0.0.1:{port_b} max_fails=0;
        keepalive 32;
    }}
    server {{
        listen 127.0.0.1:{port};
        client_max_body_size 8m;
        location / {{
            proxy_pass http://gateways;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_next_upstream error timeout http_503 non_idempotent;
            proxy_connect_timeout 5s;
            proxy_read_timeout 300s;
            proxy_send_timeout 300s;
        }}
    }}
}}
"""


@dataclass
class RollingConfig:
    llama_server: Path
    clients: int = 12
    max_requests: int = 20000  # the count bound, a safety net: the load must outlast both restarts
    deadline_s: float = 600.0  # the time bound: clients stop sending then, restarts or not
    warmup_s: float = 5.0  # traffic before the first SIGTERM
    settle_s: float = 8.0  # traffic after each restart, before the next one (and before the end)
    max_tokens: int = 16
    drain_s: float = 30.0  # MOE_L2_PROXY_DRAIN_S
    state_dir: Path | None = None  # logs and nginx' folder; a temporary one when None


@dataclass
class Restart:
    gateway: str
    old_pid: int
    new_pid: int = 0
    exit_code: int | None = None
    in_flight_at_sigterm: int | None = None  # from the old process' log ("draining: N request(s)")
    drain_s: float = 0.0  # SIGTERM -> the old process exited
    start_s: float = 0.0  # the new process started -> /healthz answered 200
    total_s: float = 0.0  # SIGTERM -> healthy again
    answered_by_new: int = 0  # 200s the new process gave before the next restart (its /metrics)


@dataclass
class Report:
    clients: int
    duration_s: float = 0.0
    sent: int = 0
    full: int = 0
    failed: int = 0
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # the first EXAMPLES
    restarts: list[Restart] = field(default_factory=list)
    nginx_requests: int = 0
    nginx_retried: int = 0  # requests nginx sent to the second gateway after the first one refused
    nginx_upstream_statuses: dict[str, int] = field(default_factory=dict)  # "503, 200": retried after a 503

    def table(self) -> str:
        lines = [
            f"{'clients':<28} {self.clients}",
            f"{'duration s':<28} {self.duration_s:.1f}",
            f"{'sent':<28} {self.sent}",
            f"{'answered in full':<28} {self.full}",
            f"{'failed':<28} {self.failed}",
            f"{'retried by nginx':<28} {self.nginx_retried} of {self.nginx_requests}",
            "",
            f"{'gateway':<8} {'old pid':>8} {'new pid':>8} {'exit':>5} {'in flight':>9} "
            f"{'drain s':>8} {'start s':>8} {'restart s':>9} {'200s after':>10}",
        ]
        for r in self.restarts:
            lines.append(
                f"{r.gateway:<8} {r.old_pid:>8} {r.new_pid:>8} {r.exit_code!s:>5} {r.in_flight_at_sigterm!s:>9} "
                f"{r.drain_s:>8.2f} {r.start_s:>8.2f} {r.total_s:>9.2f} {r.answered_by_new:>10}"
            )
        lines.append("")
        lines.append(f"{'kind':<16} {'sent':>6} {'full':>6} {'failed':>6}")
        for kind, counts in self.by_kind.items():
            lines.append(f"{kind:<16} {counts['sent']:>6} {counts['full']:>6} {counts['failed']:>6}")
        if self.nginx_upstream_statuses:
            lines.append("")
            statuses = ", ".join(f"[{k}] {v}" for k, v in self.nginx_upstream_statuses.items())
            lines.append(f"nginx upstream statuses: {statuses}")
        for failure in self.failures:
            lines.append(f"FAILED: {failure}")
        return "\n".join(lines)


def nginx_binary() -> str | None:
    """nginx on PATH, else Debian's /usr/sbin/nginx (not on a normal user's PATH)."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")
    return found


# -- the processes -----------------------------------------------------------------------------------


def llama_spec(binary: Path, model: Path, parallel: int) -> ServiceSpec:
    # one CPU thread: on a shared 2-core machine ggml's spinning worker threads slow each other down
    # (tests/proxy/conftest.py, gateway_llamas)
    settings = LlamaSettings(port=free_port(), parallel=parallel, ctx_size=parallel * 1024, telemetry=True, threads=1)
    url = f"http://127.0.0.1:{settings.port}"
    return ServiceSpec(
        name="rolling-llama",
        argv=llama_server_command(binary, model, settings),
        env=llama_server_env(settings),
        health=http_ok(f"{url}/health"),
        url=url,
    )


def gateway_spec(name: str, port: int, llama_url: str, drain_s: float) -> ServiceSpec:
    url = f"http://127.0.0.1:{port}"
    return ServiceSpec(
        name=name,
        argv=[sys.executable, "-m", "moe_l2_proxy"],
        env={
            "MOE_L2_PROXY_PORT": str(port),
            "MOE_L2_LLAMA_URL": llama_url,
            "MOE_L2_PREDICTOR_URLS": "",
            "MOE_L2_CACHE_URL": "",
            "MOE_L2_PROXY_DRAIN_S": str(drain_s),
            "MOE_L2_LOG_LEVEL": "info",  # the drain's "draining: N request(s)" line is read back
        },
        health=http_ok(f"{url}/healthz"),
        url=url,
        start_timeout_s=60,
        stop_timeout_s=drain_s + 10,
    )


class Nginx:
    """nginx in the foreground (`daemon off`), its config, pid, logs and temp folders in `folder`."""

    def __init__(self, binary: str, folder: Path, port_a: int, port_b: int) -> None:
        self.folder = folder
        self.port = free_port()
        folder.mkdir(parents=True, exist_ok=True)
        # as root, nginx' workers would otherwise run as `nobody`, who cannot write in a private temp folder
        user = f"user {pwd.getpwuid(os.geteuid()).pw_name};\n" if os.geteuid() == 0 else ""
        self.conf = folder / "nginx.conf"
        self.conf.write_text(NGINX_CONF.format(user=user, dir=folder, port=self.port, port_a=port_a, port_b=port_b))
        self.log = (folder / "nginx.out").open("wb")
        # -e: the error log from the very start (before the config is read it would be /var/log/nginx's)
        self.proc = subprocess.Popen(
            [binary, "-p", str(folder), "-c", str(self.conf), "-e", str(folder / "error.log")],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 15
        while not self._listening():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"nginx did not start: {self.error_tail()}")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listening(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
            return True
        return False

    def error_tail(self) -> str:
        paths = (self.folder / "error.log", self.folder / "nginx.out")
        texts = [p.read_text(errors="replace") for p in paths if p.exists()]
        return "\n".join(texts)[-2000:]

    def access_lines(self) -> list[str]:
        path = self.folder / "access.log"
        return path.read_text(errors="replace").splitlines() if path.exists() else []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # nginx' graceful stop
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # its worker, if the master died without it
        self.log.close()


# -- the load --------------------------------------------------------------------------------------


@dataclass
class Tally:
    sent: Counter[str] = field(default_factory=Counter)
    full: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def fail(self, kind: Kind, why: str) -> None:
        self.failed[kind] += 1
        if len(self.failures) < EXAMPLES:
            self.failures.append(f"{kind}: {why}")


def request_of(kind: Kind, n: int, max_tokens: int) -> tuple[str, dict]:
    text = f"request {n}: tell me about the sea"
    messages = [{"role": "user", "content": text}]
    if kind.startswith("openai"):
        return "/v1/chat/completions", {
            "model": "demo",
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": kind == "openai_stream",
        }
    return "/api/chat", {
        "model": "demo",
        "messages": messages,
        "options": {"num_predict": max_tokens},
        "stream": kind == "ollama_stream",
    }


async def complete(client: httpx.AsyncClient, kind: Kind, path: str, body: dict) -> str | None:
    """None if the answer came in full; else what was wrong with it."""
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread())[:200]
            return f"status {resp.status_code}: {text!r}"
        lines = [line async for line in resp.aiter_lines() if line]
    if not lines:
        return "an empty answer"
    if kind == "openai_stream":
        if lines[-1] != "data: [DONE]":
            return f"a stream without [DONE]: {lines[-2:]}"
        events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        if any("error" in event for event in events):
            return f"an error event: {lines[-2]}"
        if not any(choice.get("finish_reason") for event in events for choice in event.get("choices", [])):
            return "a stream without a finish_reason"
    elif kind == "ollama_stream":
        chunks = [json.loads(line) for line in lines]
        if any("error" in chunk for chunk in chunks):
            return f"an error line: {lines[-1]}"
        if chunks[-1].get("done") is not True:
            return f"a stream without done: {lines[-1]}"
    else:
        answer = json.loads("".join(lines))
        if "error" in answer:
            return f"an error: {answer['error']}"
        if kind == "openai_block" and not answer["choices"][0].get("finish_reason"):
            return f"no finish_reason: {answer}"
        if kind == "ollama_block" and answer.get("done") is not True:
            return f"not done: {answer}"
    return None


async def client_loop(
    base_url: str, index: int, config: RollingConfig, tally: Tally, stop: asyncio.Event, deadline: float
) -> None:
    # each client is its own keep-alive connection to nginx, as an application's HTTP client would be
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:
        n = index
        while not stop.is_set() and time.monotonic() < deadline and tally.sent.total() < config.max_requests:
            kind = KINDS[n % len(KINDS)]
            path, body = request_of(kind, n, config.max_tokens)
            n += config.clients
            tally.sent[kind] += 1
            try:
                problem = await complete(client, kind, path, body)
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if problem is None:
                tally.full[kind] += 1
            else:
                tally.fail(kind, problem)


# -- the restarts ------------------------------------------------------------------------------------


def in_flight_at_sigterm(log_path: Path) -> int | None:
    found = re.search(r"draining: (\d+) request\(s\) in flight", log_path.read_text(errors="replace"))
    return int(found.group(1)) if found else None


def restart(supervisor: Supervisor, old: RunningService, drain_s: float) -> tuple[RunningService, Restart]:
    """SIGTERM, wait for the drain to end and the process to exit, start it again on the same port."""
    record = Restart(gateway=old.spec.name.split("#")[0], old_pid=old.proc.pid)
    began = time.monotonic()
    old.proc.send_signal(signal.SIGTERM)
    # its drain plus the linger and uvicorn's own short shutdown: beyond that it is stuck
    record.exit_code = old.proc.wait(timeout=drain_s + 15)
    exited = time.monotonic()
    record.drain_s = exited - began
    record.in_flight_at_sigterm = in_flight_at_sigterm(old.log_path)
    generation = int(old.spec.name.split("#")[1]) + 1 if "#" in old.spec.name else 1
    spec = ServiceSpec(**{**asdict_shallow(old.spec), "name": f"{record.gateway}#{generation}"})
    new = supervisor.start(spec)  # returns once /healthz answers 200
    healthy = time.monotonic()
    record.new_pid = new.proc.pid
    record.start_s = healthy - exited
    record.total_s = healthy - began
    return new, record


def asdict_shallow(spec: ServiceSpec) -> dict:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


def answered(url: str) -> int:
    """The generations a gateway answered 200 so far (moe_l2_requests_total), probes and /metrics aside."""
    text = httpx.get(f"{url}/metrics", timeout=10).raise_for_status().text
    total = 0.0
    for line in text.splitlines():
        found = re.match(r"moe_l2_requests_total\{(.*)\} (\S+)$", line)
        if found and 'status="200"' in found.group(1) and re.search(r'route="/(v1|api)/', found.group(1)):
            total += float(found.group(2))
    return int(total)


def parse_access_log(lines: list[str], report: Report) -> None:
    statuses: Counter[str] = Counter()
    for line in lines:
        found = re.search(r'"([^"]*)" "([^"]*)"$', line)
        if not found or not line.startswith("POST "):
            continue
        report.nginx_requests += 1
        upstream_status = found.group(2)
        statuses[upstream_status] += 1
        if "," in upstream_status or ":" in upstream_status:
            report.nginx_retried += 1
    report.nginx_upstream_statuses = dict(statuses.most_common())


def run_rolling_restart(config: RollingConfig) -> Report:
    nginx_path = nginx_binary()
    if nginx_path is None:
        raise RuntimeError("nginx is not installed (Debian: apt-get install nginx-light)")
    report = Report(clients=config.clients)
    with contextlib.ExitStack() as stack:
        state = config.state_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rolling-")))
        model = state / "demo.gguf"
        make_demo_model(model, seed=0)
        supervisor = Supervisor(state / "logs")
        stack.callback(supervisor.stop)  # every gateway and the llama-server, however this ends
        llama = supervisor.start(llama_spec(config.llama_server, model, parallel=config.clients))
        ports = {"gw-a": free_port(), "gw-b": free_port()}
        gateways = {
            name: supervisor.start(gateway_spec(f"{name}#0", port, llama.spec.url, config.drain_s))
            for name, port in ports.items()
        }
        nginx = Nginx(nginx_path, state / "nginx", ports["gw-a"], ports["gw-b"])
        stack.callback(nginx.stop)

        def orchestrate(stop: asyncio.Event, loop: asyncio.AbstractEventLoop) -> None:
            try:
                time.sleep(config.warmup_s)
                for name in ("gw-a", "gw-b"):
                    gateways[name], record = restart(supervisor, gateways[name], config.drain_s)
                    report.restarts.append(record)
                    time.sleep(config.settle_s)
                    record.answered_by_new = answered(gateways[name].spec.url)
            finally:
                loop.call_soon_threadsafe(stop.set)

        async def load() -> Tally:
            tally = Tally()
            stop = asyncio.Event()
            deadline = time.monotonic() + config.deadline_s
            clients = [
                asyncio.create_task(client_loop(nginx.url, i, config, tally, stop, deadline))
                for i in range(config.clients)
            ]
            try:
                await asyncio.to_thread(orchestrate, stop, asyncio.get_running_loop())
            finally:
                stop.set()
                await asyncio.gather(*clients)  # the requests in flight finish (each bounded by its timeout)
            return tally

        began = time.monotonic()
        tally = asyncio.run(load())
        report.duration_s = time.monotonic() - began
        parse_access_log(nginx.access_lines(), report)
    report.sent, report.full, report.failed = tally.sent.total(), tally.full.total(), tally.failed.total()
    report.failures = tally.failures
    report.by_kind = {
        kind: {"sent": tally.sent[kind], "full": tally.full[kind], "failed": tally.failed[kind]} for kind in KINDS
    }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--settle", type=float, default=8.0, help="seconds of traffic after each restart")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--llama-server", type=Path, default=None, help="default: the cached CPU build")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "rolling-restart.json")
    args = parser.parse_args(argv)
    if args.llama_server is None:
        from moe_l2_llama.build import build

        args.llama_server = build()
    config = RollingConfig(
        llama_server=args.llama_server, clients=args.clients, settle_s=args.settle, max_tokens=args.max_tokens
    )
    report = run_rolling_restart(config)
    result = {
        "bench": "rolling-restart",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "nginx_conf": NGINX_CONF,
        **asdict(report),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(report.table())
    print(f"\nwritten {args.out}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
