"""What the gateway costs: the same streaming workload sent straight to llama-server and through the
gateway, interleaved in one run, at concurrency 1, 8 and 32.

One patched llama-server (32 slots) on the demo MoE model and one gateway process in front of it
(`python -m moe_l2_proxy`, no predictor, no cache-manager). Three targets take turns, batch by
batch, in a rotating order so machine noise hits all alike:
  direct    llama-server itself, requests tagged with X-MoE-Domain
  gateway   the gateway, requests tagged with X-MoE-Domain (pure proxy cost)
  keyword   the gateway, untagged requests: the domain comes from the in-process keyword tier
Per request: end-to-end latency (to the last byte), time to first token; per batch: tokens/s.

Two CPU layouts, the same processes re-pinned between them (with 2 or more CPUs):
  shared    every process may run on every CPU: on a small CPU-only host the gateway's CPU time
            is taken from llama-server, which is CPU-bound here
  isolated  llama-server on CPU 0, the gateway and this client on the others: a GPU host, where
            the engine does not compete with the gateway for CPU
And the gateway's own cost, from its CPU time (/proc, not a stopwatch, so machine noise barely
moves it): 1-token and N-token streams at concurrency 1 give CPU per request and per relayed token.

Before/after a gateway change, side by side in one run: `--baseline-ref REF` checks REF out into a
temporary git worktree and starts a second gateway process from it (PYTHONPATH puts REF's
moe_l2_proxy and the shared packages first), in front of the same llama-server. A fourth target takes its
turn in the rotation:
  baseline  the gateway as it was at REF, requests tagged like `gateway`
and the CPU cost is measured for both gateways, alternated. "vs baseline" is this gateway's
latency less the baseline's (the cost of the change), and the ratio of their throughputs.
`--current-ref REF` runs the `gateway` target from REF too, instead of the working tree; with
`--baseline-ref C~1 --current-ref C` the two sides differ by exactly commit C.

    python bench/gateway_overhead.py [--tokens 64] [--rounds 1:150,8:12,32:12] [--layouts shared,isolated]
                                     [--baseline-ref 765b453] [--current-ref HEAD]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from moe_l2_gguf.demo_model import make_demo_model
from moe_l2_llama.build import build
from moe_l2_llama.command_line import llama_server_command, llama_server_env
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.supervisor import RunningService, ServiceSpec, Supervisor, free_port, http_ok

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own modules
from harness.output import write_json

TARGETS = ("direct", "gateway", "baseline", "keyword")
LAYOUTS = ("shared", "isolated")
PROMPT = "write a python function that parses a csv file and sums a column"


@dataclass
class Sample:
    latency_s: float
    ttft_s: float
    tokens: int


def start_llama(supervisor: Supervisor, binary: Path, model: Path, threads: int) -> RunningService:
    settings = LlamaSettings(port=free_port(), parallel=32, ctx_size=32 * 1024, telemetry=True, threads=threads)
    url = f"http://127.0.0.1:{settings.port}"
    return supervisor.start(
        ServiceSpec(
            name="bench-llama",
            argv=llama_server_command(binary, model, settings),
            env=llama_server_env(settings),
            health=http_ok(f"{url}/health"),
            url=url,
        )
    )


def start_gateway(
    supervisor: Supervisor, llama_url: str, name: str = "bench-gateway", source: Path | None = None
) -> RunningService:
    """A gateway process; with `source` (a checkout of another ref), that checkout's code is imported."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        "MOE_L2_PROXY_PORT": str(port),
        "MOE_L2_LLAMA_URL": llama_url,
        "MOE_L2_PREDICTOR_URLS": "",
        "MOE_L2_CACHE_URL": "",
        "MOE_L2_LOG_LEVEL": "warning",
    }
    if source is not None:
        env["PYTHONPATH"] = source_path(source)
    return supervisor.start(
        ServiceSpec(
            name=name,
            argv=[sys.executable, "-m", "moe_l2_proxy"],
            env=env,
            health=http_ok(f"{url}/healthz"),
            url=url,
        )
    )


def source_path(checkout: Path) -> str:
    # ahead of the editable install of this tree, which Python consults after PYTHONPATH
    return os.pathsep.join(str(checkout / sub) for sub in ("services/proxy", "shared"))


@contextlib.contextmanager
def checkout(ref: str, target: str) -> Iterator[Path]:
    """`ref` checked out into a temporary git worktree, removed afterwards."""
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix=f"gateway-{target}-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "add", "--detach", "--quiet", str(tree), ref],
            check=True,
        )
        try:
            imported = subprocess.run(
                [sys.executable, "-c", "import moe_l2_proxy; print(moe_l2_proxy.__file__)"],
                env={**os.environ, "PYTHONPATH": source_path(tree)},
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
            if not imported.startswith(str(tree)):
                raise SystemExit(f"the {target} gateway would import {imported}, not {ref}'s code")
            commit = subprocess.run(
                ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True
            ).stdout.strip()
            print(f"{target}: {ref} ({commit}) from {tree}", flush=True)
            yield tree
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a whole process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` (0: this process) onto `cpus`; threads started later inherit it."""
    tasks = Path(f"/proc/{pid or os.getpid()}/task")
    for tid in tasks.iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid.name), cpus)


def apply_layout(layout: str, llama_pid: int, gateway_pid: int, baseline_pid: int | None = None) -> None:
    every = set(range(os.cpu_count() or 1))
    engine = {0} if layout == "isolated" else every
    rest = every - {0} if layout == "isolated" else every
    pin(llama_pid, engine)
    pin(gateway_pid, rest)
    if baseline_pid is not None:
        pin(baseline_pid, rest)
    pin(0, rest)


async def one_request(client: httpx.AsyncClient, tokens: int, tagged: bool) -> Sample:
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    headers = {"X-MoE-Domain": "codegen"} if tagged else {}
    t0 = time.perf_counter()
    ttft = 0.0
    n = 0
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                n += 1
                if not ttft:
                    ttft = time.perf_counter() - t0
    return Sample(time.perf_counter() - t0, ttft, n)


async def batch(client: httpx.AsyncClient, concurrency: int, tokens: int, tagged: bool) -> tuple[float, list[Sample]]:
    t0 = time.perf_counter()
    samples = await asyncio.gather(*(one_request(client, tokens, tagged) for _ in range(concurrency)))
    return time.perf_counter() - t0, list(samples)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summarize(samples: list[Sample], walls: list[float]) -> dict:
    latencies = [s.latency_s for s in samples]
    ttfts = [s.ttft_s for s in samples]
    tokens = sum(s.tokens for s in samples)
    return {
        "requests": len(samples),
        "latency_p50_ms": round(statistics.median(latencies) * 1000, 3),
        "latency_p99_ms": round(percentile(latencies, 0.99) * 1000, 3),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 3),
        "ttft_p99_ms": round(percentile(ttfts, 0.99) * 1000, 3),
        "tokens_per_s": round(tokens / sum(walls), 1),
    }


async def gateway_cost(gateways: dict[str, tuple[httpx.AsyncClient, int]], tokens: int, requests: int) -> dict:
    """Each gateway's CPU per request and per relayed token: 1-token and `tokens`-token streams at
    concurrency 1, tagged (no prediction), fitted as fixed + per-token cost. Gateways alternate."""
    cpu: dict[str, dict[int, float]] = {name: {} for name in gateways}
    for n in (1, tokens, 1, tokens):  # twice each, alternating; the sums are what counts
        for name, (client, pid) in gateways.items():
            before = cpu_seconds(pid)
            for _ in range(requests // 2):
                await one_request(client, n, tagged=True)
            cpu[name][n] = cpu[name].get(n, 0.0) + cpu_seconds(pid) - before
    out = {}
    for name, used in cpu.items():
        per_token = (used[tokens] - used[1]) / (requests * (tokens - 1))
        per_request = used[1] / requests - per_token
        out[name] = {
            "requests_each": requests,
            "cpu_ms_per_1_token_stream": round(used[1] / requests * 1000, 3),
            f"cpu_ms_per_{tokens}_token_stream": round(used[tokens] / requests * 1000, 3),
            "cpu_ms_per_request": round(per_request * 1000, 3),
            "cpu_us_per_token": round(per_token * 1e6, 1),
        }
    return out


async def measure(
    urls: dict[str, str], rounds: dict[int, int], tokens: int, pids: dict[str, int], cost_requests: int
) -> dict:
    targets = [t for t in TARGETS if t in urls]
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    clients = {t: httpx.AsyncClient(base_url=urls[t], timeout=300, limits=limits) for t in targets}
    results: dict[str, dict] = {}
    try:
        for target in targets:  # warm-up: connections, caches, the keyword tier
            await batch(clients[target], 4, 8, target != "keyword")
        gateways = {t: (clients[t], pids[t]) for t in ("gateway", "baseline") if t in urls}
        costs = await gateway_cost(gateways, tokens, cost_requests)
        results["gateway_cpu"] = costs["gateway"]
        if "baseline" in costs:
            results["baseline_cpu"] = costs["baseline"]
        for name, cost in costs.items():
            print(
                f"  {name} CPU: {cost['cpu_ms_per_request']:.3f} ms per request"
                f" + {cost['cpu_us_per_token']:.1f} µs per token",
                flush=True,
            )
        for concurrency, n_rounds in rounds.items():
            samples: dict[str, list[Sample]] = {t: [] for t in targets}
            walls: dict[str, list[float]] = {t: [] for t in targets}
            round_p50: dict[str, list[float]] = {t: [] for t in targets}
            for r in range(n_rounds):
                shift = r % len(targets)
                for target in targets[shift:] + targets[:shift]:
                    try:
                        wall, got = await batch(clients[target], concurrency, tokens, target != "keyword")
                    except httpx.HTTPError as exc:
                        print(f"  {target} failed at concurrency {concurrency}, round {r}: {exc!r}", file=sys.stderr)
                        raise
                    samples[target] += got
                    walls[target].append(wall)
                    round_p50[target].append(statistics.median(x.latency_s for x in got))
            stats = {t: summarize(samples[t], walls[t]) for t in targets}
            for t in targets[1:]:
                stats[t] |= compare(
                    stats[t], stats["direct"], round_p50[t], round_p50["direct"], walls[t], walls["direct"]
                )
            if "baseline" in stats:
                versus = compare(
                    stats["gateway"], stats["baseline"], round_p50["gateway"], round_p50["baseline"],
                    walls["gateway"], walls["baseline"],
                )  # fmt: skip
                stats["gateway"]["vs_baseline"] = versus
            results[str(concurrency)] = stats
            print_level(concurrency, stats)
    finally:
        for client in clients.values():
            await client.aclose()
    return results


def compare(
    stats: dict, ref: dict, p50: list[float], ref_p50: list[float], walls: list[float], ref_walls: list[float]
) -> dict:
    """One target against a reference target measured in the same rounds."""
    # per round, the median latency less the reference's (adjacent batches), then the median
    deltas = [g - d for g, d in zip(p50, ref_p50, strict=True)]
    # the median of per-round ratios: a round's batches ran back to back, so a slow spell of the
    # machine hits both sides of a pair; the pooled ratio lets one slow batch decide
    paired = [d / w for d, w in zip(ref_walls, walls, strict=True)]
    return {
        "added_latency_p50_ms": round(stats["latency_p50_ms"] - ref["latency_p50_ms"], 3),
        "added_latency_paired_ms": round(statistics.median(deltas) * 1000, 3),
        "added_latency_p99_ms": round(stats["latency_p99_ms"] - ref["latency_p99_ms"], 3),
        "added_ttft_p50_ms": round(stats["ttft_p50_ms"] - ref["ttft_p50_ms"], 3),
        "throughput_ratio": round(statistics.median(paired), 4),
        "throughput_ratio_pooled": round(stats["tokens_per_s"] / ref["tokens_per_s"], 4),
    }


def print_level(concurrency: int, stats: dict) -> None:
    print(f"  concurrency {concurrency}")
    print(
        f"    {'target':<8} {'p50 ms':>9} {'p99 ms':>9} {'ttft p50':>9} {'tok/s':>8} {'+p50 ms':>8} {'paired':>7}"
        f" {'ratio':>6}"
    )
    for target, s in stats.items():
        added, ratio = s.get("added_latency_p50_ms", 0.0), s.get("throughput_ratio", 1.0)
        paired = s.get("added_latency_paired_ms", 0.0)
        print(
            f"    {target:<8} {s['latency_p50_ms']:>9.2f} {s['latency_p99_ms']:>9.2f} {s['ttft_p50_ms']:>9.2f} "
            f"{s['tokens_per_s']:>8.0f} {added:>8.2f} {paired:>7.2f} {ratio:>6.3f}",
            flush=True,
        )
    versus = stats.get("gateway", {}).get("vs_baseline")
    if versus:
        print(
            f"    gateway vs baseline: {versus['added_latency_p50_ms']:+.3f} ms p50"
            f" (paired {versus['added_latency_paired_ms']:+.3f} ms), throughput ratio {versus['throughput_ratio']:.3f}",
            flush=True,
        )


def parse_rounds(text: str) -> dict[int, int]:
    pairs = (item.split(":") for item in text.split(","))
    return {int(c): int(r) for c, r in pairs}


async def run_layouts(
    layouts: list[str], urls: dict[str, str], pids: dict[str, int], rounds: dict[int, int], args: argparse.Namespace
) -> dict:
    results = {}
    for layout in layouts:
        apply_layout(layout, pids["llama"], pids["gateway"], pids.get("baseline"))
        print(f"\n{layout}: {LAYOUT_TEXT[layout]}", flush=True)
        results[layout] = await measure(urls, rounds, args.tokens, pids, args.cost_requests)
    apply_layout("shared", pids["llama"], pids["gateway"], pids.get("baseline"))
    return results


LAYOUT_TEXT = {
    "shared": "every process on every CPU",
    "isolated": "llama-server on CPU 0; the gateway and the client on the others",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--rounds", default="1:150,8:12,32:12", help="concurrency:rounds, comma-separated")
    parser.add_argument("--threads", type=int, default=1, help="llama-server CPU threads")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="CPU layouts to measure, comma-separated")
    parser.add_argument("--cost-requests", type=int, default=100, help="streams of each length for the CPU cost")
    parser.add_argument(
        "--baseline-ref",
        default="",
        help="also run the gateway as it is at this git ref (commit, tag, branch), side by side",
    )
    parser.add_argument(
        "--current-ref",
        default="",
        help="run the `gateway` target from this git ref instead of the working tree (with --baseline-ref: "
        "the two sides of exactly one change, e.g. --baseline-ref C~1 --current-ref C)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="JSON report (default: bench/results/gateway_overhead.json, or gateway_overhead_vs_baseline.json "
        "with --baseline-ref)",
    )
    args = parser.parse_args(argv)
    rounds = parse_rounds(args.rounds)
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout {unknown[0]!r}; choose from {', '.join(LAYOUTS)}")
    if "isolated" in layouts and _cpus() < 2:
        print("one CPU: the isolated layout needs two, measuring the shared layout only", file=sys.stderr)
        layouts = [name for name in layouts if name != "isolated"]
    if args.out is None:
        name = "gateway_overhead_vs_baseline.json" if args.baseline_ref else "gateway_overhead.json"
        args.out = Path(__file__).parent / "results" / name

    binary = build()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        baseline_tree = stack.enter_context(checkout(args.baseline_ref, "baseline")) if args.baseline_ref else None
        current_tree = stack.enter_context(checkout(args.current_ref, "gateway")) if args.current_ref else None
        model = tmp / "demo.gguf"
        make_demo_model(model, seed=0)
        supervisor = Supervisor(tmp / "logs")
        try:
            llama = start_llama(supervisor, binary, model, args.threads)
            services = [llama, start_gateway(supervisor, llama.spec.url, source=current_tree)]
            urls = {"direct": llama.spec.url, "gateway": services[1].spec.url, "keyword": services[1].spec.url}
            pids = {"llama": llama.proc.pid, "gateway": services[1].proc.pid}
            if baseline_tree is not None:
                services.append(start_gateway(supervisor, llama.spec.url, "bench-baseline", baseline_tree))
                urls["baseline"] = services[2].spec.url
                pids["baseline"] = services[2].proc.pid
            try:
                results = asyncio.run(run_layouts(layouts, urls, pids, rounds, args))
            except httpx.HTTPError:
                for service in services:  # the logs go with the temporary folder
                    print(f"--- last lines of {service.spec.name}'s log", *service.tail(30), sep="\n", file=sys.stderr)
                raise
        finally:
            supervisor.stop()

    report = {
        "benchmark": "gateway_overhead",
        "workload": {
            "endpoint": "/v1/chat/completions",
            "stream": True,
            "tokens_per_request": args.tokens,
            "rounds": rounds,
            "layouts": {name: LAYOUT_TEXT[name] for name in layouts},
            "llama": {"parallel": 32, "ctx_size": 32 * 1024, "threads": args.threads, "model": "demo (seed 0)"},
            "baseline_ref": args.baseline_ref or None,
            "current_ref": args.current_ref or "working tree",
            "command": " ".join(["python", "bench/gateway_overhead.py", *(sys.argv[1:] if argv is None else argv)]),
        },
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": _cpus()},
        "targets": {
            "added_latency_p50_ms_max": 1.0,
            "throughput_ratio_at_32_min": 0.97,
            **({"vs_baseline_added_latency_p50_ms_at_1_max": 0.2} if args.baseline_ref else {}),
        },
        "summary": {layout: summary(results[layout]) for layout in layouts},
        "results": results,
    }
    write_json(args.out, report)
    for layout in layouts:
        print(f"\n{layout}: {json.dumps(report['summary'][layout])}")
    print(f"\nwritten to {args.out}")
    return 0


def summary(results: dict) -> dict:
    gw1 = results.get("1", {}).get("gateway", {})
    gw32 = results.get("32", {}).get("gateway", {})
    out = {
        "added_latency_p50_ms_at_1": gw1.get("added_latency_p50_ms"),
        "added_latency_paired_ms_at_1": gw1.get("added_latency_paired_ms"),
        "throughput_ratio_at_32": gw32.get("throughput_ratio"),
        "gateway_cpu_ms_per_request": results["gateway_cpu"]["cpu_ms_per_request"],
        "gateway_cpu_us_per_token": results["gateway_cpu"]["cpu_us_per_token"],
    }
    if "baseline_cpu" in results:
        base1 = results.get("1", {}).get("baseline", {})
        versus1 = gw1.get("vs_baseline", {})
        out |= {
            "baseline_added_latency_p50_ms_at_1": base1.get("added_latency_p50_ms"),
            "baseline_added_latency_paired_ms_at_1": base1.get("added_latency_paired_ms"),
            # the change itself: this gateway less the baseline, measured in the same rounds
            "vs_baseline_latency_p50_ms_at_1": versus1.get("added_latency_p50_ms"),
            "vs_baseline_latency_paired_ms_at_1": versus1.get("added_latency_paired_ms"),
            "vs_baseline_throughput_ratio": {
                level: stats["gateway"]["vs_baseline"]["throughput_ratio"]
                for level, stats in results.items()
                if level.isdigit()
            },
            "baseline_throughput_ratio_at_32": results.get("32", {}).get("baseline", {}).get("throughput_ratio"),
            "baseline_cpu_ms_per_request": results["baseline_cpu"]["cpu_ms_per_request"],
            "baseline_cpu_us_per_token": results["baseline_cpu"]["cpu_us_per_token"],
        }
    return out


def _cpus() -> int:
    return os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())
