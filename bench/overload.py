"""Overload has a shape: about a thousand connections at once against a real gateway process
(`python -m moe_l2_proxy`) in front of a real llama-server (the CPU build, the demo MoE model), and
what the gateway does with them: it keeps answering its probes, refuses what it cannot take with
429/503 and `Retry-After` instead of queueing it without end, and its memory stays bounded.

The connections, opened together (all on loopback):
  idle           open, never send a byte: answered 408 after MOE_L2_PROXY_HEADER_TIMEOUT_S, closed
  slow writers   send a head announcing a body, then trickle it a byte a second: 408 after
                 MOE_L2_PROXY_BODY_TIMEOUT_S of silence... they are never silent that long, so they
                 stay; they hold a connection each, nothing else
  slow readers   a streamed generation they never read: the gateway stops reading llama when the
                 client's socket is full (flow control) instead of buffering the answer
  oversized      a body over MOE_L2_PROXY_MAX_BODY_BYTES: 413 before the body is read
  burst          ordinary generation requests, many more than MOE_L2_PROXY_LLAMA_MAX_CONNECTIONS +
                 MOE_L2_PROXY_MAX_WAITING: the excess is answered 503 `overloaded` at once
and the connections beyond MOE_L2_PROXY_MAX_CONNECTIONS are answered 503 `too_many_connections`.
Meanwhile a probe asks GET /healthz on a fresh connection every 0.1 s (latency p50/p99, statuses),
and the gateway's RSS is sampled from /proc (its peak: VmHWM).

    python bench/overload.py [--connections 1000] [--duration 30] [--out bench/results/overload.json]

The gateway's limits are set small here (see GATEWAY_ENV) so that each refusal shows within the run on
a small machine; the defaults are in docs/proxy.md. JSON under bench/results/, a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moe_l2_gguf.demo_model import make_demo_model
from moe_l2_llama.build import build
from moe_l2_llama.command_line import llama_server_command, llama_server_env
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.supervisor import RunningService, ServiceSpec, Supervisor, free_port, http_ok

# Small limits, so that every kind of refusal happens within a short run on two cores.
GATEWAY_ENV = {
    "MOE_L2_PROXY_MAX_CONNECTIONS": "900",
    "MOE_L2_PROXY_LLAMA_MAX_CONNECTIONS": "16",
    "MOE_L2_PROXY_MAX_WAITING": "32",
    "MOE_L2_PROXY_WAIT_TIMEOUT_S": "5",
    "MOE_L2_PROXY_HEADER_TIMEOUT_S": "5",
    "MOE_L2_PROXY_BODY_TIMEOUT_S": "5",
    "MOE_L2_PROXY_MAX_BODY_BYTES": str(1 << 20),
}
CHAT = b'{"messages":[{"role":"user","content":"hello there"}],"max_tokens":%d,"stream":%s}'


@dataclass
class Mix:
    idle: int
    slow_writers: int
    slow_readers: int
    oversized: int
    burst: int

    @classmethod
    def of(cls, connections: int) -> Mix:
        # a fifth each of the kinds above, the burst taking the rest
        part = connections // 5
        return cls(part, part, part, part, connections - 4 * part)

    @property
    def total(self) -> int:
        return self.idle + self.slow_writers + self.slow_readers + self.oversized + self.burst


@dataclass
class Outcome:
    kind: str
    status: int = 0  # 0: no HTTP answer (closed without one, or still open at the end)
    code: str = ""  # the error's `code`, when it is one of the gateway's
    retry_after: bool = False
    closed: bool = False


@dataclass
class Report:
    mix: Mix
    duration_s: float
    outcomes: list[Outcome] = field(default_factory=list)
    probe_latencies_s: list[float] = field(default_factory=list)
    probe_statuses: list[int] = field(default_factory=list)
    rss_peak_bytes: int = 0
    rss_start_bytes: int = 0
    gateway_alive: bool = True

    def summary(self) -> dict:
        statuses = Counter(f"{o.kind}:{o.status}{'/' + o.code if o.code else ''}" for o in self.outcomes)
        refused = [o for o in self.outcomes if o.status in (429, 503)]
        lat = sorted(self.probe_latencies_s)
        return {
            "mix": asdict(self.mix),
            "duration_s": self.duration_s,
            "outcomes": dict(sorted(statuses.items())),
            "refused": len(refused),
            "refused_with_retry_after": sum(o.retry_after for o in refused),
            "refused_by_code": dict(Counter(o.code for o in refused)),
            "health_probes": len(self.probe_statuses),
            "health_statuses": dict(Counter(self.probe_statuses)),
            "health_p50_ms": round(1000 * percentile(lat, 0.5), 2) if lat else None,
            "health_p99_ms": round(1000 * percentile(lat, 0.99), 2) if lat else None,
            "health_max_ms": round(1000 * lat[-1], 2) if lat else None,
            "rss_start_mb": round(self.rss_start_bytes / 2**20, 1),
            "rss_peak_mb": round(self.rss_peak_bytes / 2**20, 1),
            "gateway_alive": self.gateway_alive,
        }


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(98, max(0, round(q * 100) - 1))]


def rss_bytes(pid: int, field_name: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def head(method: str, path: str, length: int | None = None, extra: str = "") -> bytes:
    lines = (
        [f"{method} {path} HTTP/1.1", "Host: gateway", extra]
        if extra
        else [f"{method} {path} HTTP/1.1", "Host: gateway"]
    )
    if length is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {length}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def read_answer(reader: asyncio.StreamReader, outcome: Outcome, timeout_s: float) -> None:
    """The status, error code and Retry-After of the answer on `reader`, read to its end or close."""
    try:
        async with asyncio.timeout(timeout_s):
            status_line = await reader.readline()
            if not status_line:
                outcome.closed = True
                return
            outcome.status = int(status_line.split()[1])
            length = None
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                name = name.strip().lower()
                if name == "retry-after":
                    outcome.retry_after = True
                elif name == "content-length":
                    length = int(value)
            if length is not None and outcome.status >= 400:
                body = await reader.readexactly(length)
                with contextlib.suppress(ValueError, AttributeError, TypeError):
                    error = json.loads(body).get("error")
                    outcome.code = (error.get("code") if isinstance(error, dict) else "") or ""
    except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError, IndexError):
        pass


async def hold(kind: str, host: str, port: int, stop: asyncio.Event, outcomes: list[Outcome]) -> None:
    outcome = Outcome(kind)
    outcomes.append(outcome)
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        outcome.closed = True
        return
    try:
        if kind == "idle":
            await read_until(reader, outcome, stop)
        elif kind == "slow_writer":
            writer.write(head("POST", "/v1/chat/completions", length=100_000))
            answer = asyncio.ensure_future(read_answer(reader, outcome, 3600))
            while not stop.is_set() and not answer.done():
                writer.write(b" ")
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(answer), 1.0)
            answer.cancel()
        elif kind == "slow_reader":
            body = CHAT % (256, b"true")
            writer.write(head("POST", "/v1/chat/completions", length=len(body)) + body)
            await writer.drain()
            await stop.wait()  # never reads: the answer piles up in the socket buffers
        elif kind == "oversized":
            writer.write(head("POST", "/v1/chat/completions", length=64 << 20) + b"{" + b" " * 65535)
            await writer.drain()
            await read_answer(reader, outcome, 60)
        elif kind == "burst":
            body = CHAT % (8, b"false")
            writer.write(head("POST", "/v1/chat/completions", length=len(body)) + body)
            await writer.drain()
            await read_answer(reader, outcome, 120)
    except OSError:
        outcome.closed = True
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def read_until(reader: asyncio.StreamReader, outcome: Outcome, stop: asyncio.Event) -> None:
    answer = asyncio.ensure_future(read_answer(reader, outcome, 3600))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({answer, stopped}, return_when=asyncio.FIRST_COMPLETED)
    answer.cancel()
    stopped.cancel()


async def probe(host: str, port: int, stop: asyncio.Event, report: Report) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        outcome = Outcome("probe")
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(head("GET", "/healthz", extra="Connection: close"))
            await read_answer(reader, outcome, 10)
            writer.close()
        except OSError:
            pass
        report.probe_latencies_s.append(time.perf_counter() - t0)
        report.probe_statuses.append(outcome.status)
        await asyncio.sleep(0.1)


async def sample_rss(pid: int, stop: asyncio.Event, report: Report) -> None:
    while not stop.is_set():
        with contextlib.suppress(OSError):
            report.rss_peak_bytes = max(report.rss_peak_bytes, rss_bytes(pid))
        await asyncio.sleep(0.1)


async def overload(url: str, pid: int, mix: Mix, duration_s: float) -> Report:
    """Open every connection of `mix` against the gateway at `url` (process `pid`), keep them for
    `duration_s` while probing /healthz and sampling RSS, then close them all."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    report = Report(mix, duration_s)
    report.rss_start_bytes = rss_bytes(pid)
    stop = asyncio.Event()
    watchers = [
        asyncio.ensure_future(probe(host, int(port), stop, report)),
        asyncio.ensure_future(sample_rss(pid, stop, report)),
    ]
    await asyncio.sleep(0.5)  # a few probes before
    kinds = (
        ["slow_reader"] * mix.slow_readers
        + ["burst"] * mix.burst
        + ["idle"] * mix.idle
        + ["slow_writer"] * mix.slow_writers
        + ["oversized"] * mix.oversized
    )
    clients = []
    for kind in kinds:
        clients.append(asyncio.ensure_future(hold(kind, host, int(port), stop, report.outcomes)))
        await asyncio.sleep(0)  # let each connect in the order given
    await asyncio.sleep(duration_s)
    stop.set()
    await asyncio.wait(clients, timeout=30)
    for task in clients + watchers:
        task.cancel()
    report.rss_peak_bytes = max(report.rss_peak_bytes, rss_bytes(pid, "VmHWM"))
    return report


def start_llama(supervisor: Supervisor, binary: Path, model: Path) -> RunningService:
    settings = LlamaSettings(port=free_port(), parallel=8, ctx_size=8 * 1024, telemetry=True, threads=1)
    url = f"http://127.0.0.1:{settings.port}"
    return supervisor.start(
        ServiceSpec(
            name="overload-llama",
            argv=llama_server_command(binary, model, settings),
            env=llama_server_env(settings),
            health=http_ok(f"{url}/health"),
            url=url,
        )
    )


def start_gateway(supervisor: Supervisor, llama_url: str, env: dict[str, str]) -> RunningService:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    return supervisor.start(
        ServiceSpec(
            name="overload-gateway",
            argv=[sys.executable, "-m", "moe_l2_proxy"],
            env={
                "MOE_L2_PROXY_PORT": str(port),
                "MOE_L2_LLAMA_URL": llama_url,
                "MOE_L2_PREDICTOR_URLS": "",
                "MOE_L2_CACHE_URL": "",
                "MOE_L2_LOG_LEVEL": "warning",
                **env,
            },
            health=http_ok(f"{url}/healthz"),
            url=url,
        )
    )


def print_table(summary: dict) -> None:
    print(f"{'outcome (kind:status/code)':<48} {'count':>6}")
    for name, count in summary["outcomes"].items():
        print(f"{name:<48} {count:>6}")
    print()
    rows = [
        ("connections", sum(summary["mix"].values())),
        ("refused (429/503)", summary["refused"]),
        ("  of which with Retry-After", summary["refused_with_retry_after"]),
        ("/healthz probes", summary["health_probes"]),
        ("/healthz statuses", summary["health_statuses"]),
        (
            "/healthz p50 / p99 / max ms",
            f"{summary['health_p50_ms']} / {summary['health_p99_ms']} / {summary['health_max_ms']}",
        ),
        ("gateway RSS start / peak MB", f"{summary['rss_start_mb']} / {summary['rss_peak_mb']}"),
        ("gateway alive after", summary["gateway_alive"]),
    ]
    for name, value in rows:
        print(f"{name:<32} {value}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds the connections are held")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "overload.json")
    args = parser.parse_args(argv)
    binary = build()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        model = tmp / "demo.gguf"
        make_demo_model(model, seed=0)
        supervisor = Supervisor(tmp / "logs")
        stack.callback(supervisor.stop)
        llama = start_llama(supervisor, binary, model)
        gateway = start_gateway(supervisor, llama.spec.url, GATEWAY_ENV)
        report = asyncio.run(overload(gateway.spec.url, gateway.proc.pid, Mix.of(args.connections), args.duration))
        report.gateway_alive = gateway.proc.poll() is None
        summary = report.summary()
    result = {
        "bench": "overload",
        "machine": {"cpus": __import__("os").cpu_count(), "platform": platform.platform()},
        "gateway_env": GATEWAY_ENV,
        **summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(summary)
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
