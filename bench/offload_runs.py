"""bench/expert_offload.py's measurement: every config's server started, then the runs, taking turns over the
servers (one generates at a time, the order rotated each run) so that machine noise hits all alike, and last the
-np N servers' concurrent rounds."""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from harness.output import fmt_num
from harness.prompts import make_prompt
from harness.servers import BenchError, Interrupted
from harness.timing import rotated
from offload_bytes import (
    cache_counters,
    counters_delta,
    decode_bytes,
    moe_cache_metrics,
    prompt_step_bytes,
    pull_counts,
)
from offload_configs import Config, ExpertLayout, cache_patch_present, concurrency
from offload_replay import push_profile
from offload_servers import Server, complete, next_domain, start_server

from moe_l2_ops.supervisor import Supervisor, SupervisorError


def start_all(
    supervisor: Supervisor,
    binary: Path,
    model: Path,
    layout: ExpertLayout,
    configs: list[Config],
    n_cpu_moe: int,
    device_expert_c: int,
    args: argparse.Namespace,
) -> dict[str, Server]:
    """Every config's server, `--start-jobs` at a time. Loading is most of a server's start (9.5 GB
    from the page cache, and with --load-mode none into freshly pinned memory), and loads of
    separate servers overlap well on a many-core host; the measurements start only when all are up."""

    def one(c: Config) -> Server:
        print(f"starting {c.key} ({c.name}) ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            s = start_server(supervisor, binary, model, c, layout, n_cpu_moe, device_expert_c, args, args.token)
        except SupervisorError as exc:
            raise BenchError(f"llama-server for {c.key} ({c.name}) did not start: {exc}".splitlines()[0]) from exc
        s.start_seconds = round(time.monotonic() - t0, 1)
        print(f"  {c.key} ready in {s.start_seconds:.0f}s", file=sys.stderr, flush=True)
        if c.base == "e":
            for body in getattr(args, "profile_bodies", None) or []:
                push_profile(s.url, body, args.token)
        return s

    wanted = [c for c in configs if c.base != "e" or cache_patch_present(binary)]
    jobs = max(1, getattr(args, "start_jobs", 1))
    if jobs == 1:
        started = [one(c) for c in wanted]
    else:
        pool = ThreadPoolExecutor(jobs)
        try:
            started = list(pool.map(one, wanted))  # the first failure is raised, in config order
        finally:
            # not waiting for the other starts: on a failure or SIGTERM the caller's supervisor.stop()
            # ends their servers, and their threads end with them (a wait would last the start timeout)
            pool.shutdown(wait=False, cancel_futures=True)
    return {s.config.key: s for s in started}


def measure(
    binary: Path,
    model: Path,
    layout: ExpertLayout,
    configs: list[Config],
    n_cpu_moe: int,
    device_expert_c: int,
    args: argparse.Namespace,
    logs: Path,
) -> tuple[dict[str, Server], dict[str, str]]:
    """(every config's server with its runs, the text of its log). The warm-up sends every server the same
    requests, so that the trace cursors stay aligned; SIGTERM ends the runs, keeping those every server
    finished."""
    supervisor = Supervisor(logs)
    servers: dict[str, Server] = {}
    try:
        all_configs = configs + getattr(args, "concurrent_configs", [])
        servers = start_all(supervisor, binary, model, layout, all_configs, n_cpu_moe, device_expert_c, args)
        order = [s for s in servers.values() if concurrency(s.config) == 1]
        with httpx.Client(timeout=args.request_timeout) as client:
            try:
                for s in order:  # warm-up: every server the same requests, so a trace cursor stays aligned
                    print(f"  warm-up {s.config.key} ...", file=sys.stderr, flush=True)
                    warm = make_prompt(0, min(8, args.prompt_words))
                    complete(client, s.url, warm, 2, cache_prompt=False, domain=next_domain(s, args))
                for i in range(args.runs):
                    prompt = make_prompt(i, args.prompt_words)
                    for s in rotated(order, i):
                        one_run(client, s, prompt, layout, args)
                    done = ", ".join(f"{s.config.key} {s.decode_tps[-1]:.2f}" for s in order)
                    print(f"  run {i + 1}/{args.runs}: decode tok/s {done}", file=sys.stderr, flush=True)
                if getattr(args, "gauges", False):
                    args.gauges_read = read_gauges()
                for s in servers.values():
                    if concurrency(s.config) > 1:
                        s.concurrent = concurrent_run(s, args)
                        print(f"  {s.config.key}: {s.concurrent['summary']}", file=sys.stderr, flush=True)
            except httpx.HTTPError as exc:
                raise BenchError(f"a request failed: {exc!r} (see the server logs under {logs})") from exc
            except (Interrupted, KeyboardInterrupt):
                args.interrupted = True
                print("  interrupted: reporting the runs every server finished", file=sys.stderr, flush=True)
                trim_to_complete_runs(order)
            for s in order:
                if s.config.base == "e":
                    s.final_cache = moe_cache_metrics(client, s.url)
        logs_text = {k: s.log_path.read_text(errors="replace") for k, s in servers.items()}
    finally:
        supervisor.stop()
    return servers, logs_text


def one_run(client: httpx.Client, s: Server, prompt: str, layout: ExpertLayout, args: argparse.Namespace) -> None:
    """The prompt alone, then the same prompt from the cache and --tokens decode steps; each followed
    by a reset pull, so each pull holds one request's routing."""
    pull_counts(client, s.url, args.token)  # drop anything before (a warm-up)
    cached = s.config.base == "e"
    before = cache_counters(client, s.url) if cached else {}
    t = complete(client, s.url, prompt, 1, cache_prompt=False, domain=next_domain(s, args))
    prompt_counts = pull_counts(client, s.url, args.token)
    if t["prompt_n"] > args.ubatch:
        raise BenchError(
            f"a prompt of {t['prompt_n']} tokens is more than one micro-batch (--ubatch {args.ubatch}): "
            "the bytes derivation needs one step per prompt; use a shorter --prompt-words"
        )
    s.prompt_tps.append(t["prompt_per_second"])
    s.prompt_tokens.append(t["prompt_n"])
    if cached:
        after = cache_counters(client, s.url)
        delta = counters_delta(after, before)
        s.prompt_h2d.append(delta["h2d_bytes"] + delta["bypass_bytes"])
        before = after
    else:
        s.prompt_h2d.append(
            prompt_step_bytes(prompt_counts, s.host_layers, layout.expert_bytes, layout.n_expert_used, s.min_batch)
        )

    t = complete(client, s.url, prompt, args.tokens, cache_prompt=True, domain=next_domain(s, args))
    counts = pull_counts(client, s.url, args.token)
    if t["prompt_n"] > 1:
        # the slot lost the prompt: that step had many rows and the decode derivation counts it wrong
        print(f"  warning: {s.config.key} re-evaluated {t['prompt_n']} prompt tokens", file=sys.stderr, flush=True)
    s.reevaluated.append(t["prompt_n"])
    s.decode_tps.append(t["predicted_per_second"])
    s.decode_tokens.append(t["predicted_n"])
    first_moe = min(layout.expert_bytes)
    s.decode_steps.append(round(sum(counts.get(first_moe, {}).values()) / layout.n_expert_used))
    if cached:
        delta = counters_delta(cache_counters(client, s.url), before)
        s.decode_cache.append(delta)
        s.decode_h2d.append(delta["h2d_bytes"] + delta["bypass_bytes"])
    else:
        s.decode_h2d.append(decode_bytes(counts, s.host_layers, layout.expert_bytes, s.min_batch))


def trim_to_complete_runs(servers: list[Server]) -> None:
    """Keep the runs that every server finished, so that the paired ratios stay paired."""
    n = min(len(s.decode_h2d) for s in servers)
    for s in servers:
        for name in ("prompt_tps", "decode_tps", "prompt_tokens", "decode_tokens", "prompt_h2d", "decode_h2d"):
            setattr(s, name, getattr(s, name)[:n])
        s.decode_steps, s.reevaluated = s.decode_steps[:n], s.reevaluated[:n]
        s.decode_cache = s.decode_cache[:n]


def read_gauges() -> dict:
    """bench/gpu_facts.py's read of the cache-manager's NVML gauges against nvidia-smi, while the
    servers hold their device memory."""
    from gpu_facts import gauges

    return gauges()


def concurrent_run(s: Server, args: argparse.Namespace) -> dict:
    """-np N: N requests at once, distinct prompts, each tagged with the domain of the trace sequence
    it replays (the r-th request assigned to a slot replays sequence r, so the tags follow the send
    order), --tokens decode tokens each, twice (the first fills the slots' caches of nothing: it is
    the warm-up). Aggregate decode tok/s = all decode tokens / the longest request's decode time
    (the slots decode in one batch); the wall figure divides by the whole round, prompts included."""
    n = concurrency(s.config)
    rounds = []
    with httpx.Client(timeout=args.request_timeout) as client, ThreadPoolExecutor(n) as pool:
        for r in range(2):
            prompts = [make_prompt(r * n + i, args.prompt_words) for i in range(n)]
            domains = [next_domain(s, args) for _ in range(n)]
            t0 = time.monotonic()
            futures = [
                pool.submit(complete, client, s.url, p, args.tokens, False, d)
                for p, d in zip(prompts, domains, strict=True)
            ]
            timings = [f.result() for f in futures]
            rounds.append({"wall_s": time.monotonic() - t0, "timings": timings, "domains": domains})
    return concurrent_summary(rounds[-1], n) | {"warm_up_round": concurrent_summary(rounds[0], n)}


def concurrent_summary(round_: dict, n: int) -> dict:
    """One round of N concurrent requests in figures (see concurrent_run)."""
    timings = round_["timings"]
    tokens = sum(t["predicted_n"] for t in timings)
    decode_s = max(t["predicted_ms"] for t in timings) / 1e3
    prompt_tokens = sum(t["prompt_n"] for t in timings)
    agg = tokens / decode_s if decode_s > 0 else None
    return {
        "requests": n,
        "domains": round_["domains"],
        "decode_tokens": tokens,
        "aggregate_decode_tokens_per_s": agg,
        "wall_tokens_per_s": tokens / round_["wall_s"] if round_["wall_s"] > 0 else None,
        "wall_s": round(round_["wall_s"], 3),
        "prompt_tokens": prompt_tokens,
        "per_request_decode_tokens_per_s": [t["predicted_per_second"] for t in timings],
        "summary": f"{n} concurrent: {tokens} decode tokens, aggregate {fmt_num(agg, '.1f')} tok/s",
    }
