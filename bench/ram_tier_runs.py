"""One bench/ram_tier.py configuration at one budget: the model dropped from the page cache, the services
started, the balloon inflated, then the requests, each measured from the processes themselves while a thread
samples the model's residency."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from balloon import BalloonProc
from harness.output import meminfo_bytes
from harness.prompts import make_prompt
from harness.servers import BenchError
from kernel_probes import (
    FileResidency,
    Sampler,
    block_read_bytes,
    drop_from_page_cache,
    proc_majflt,
    proc_read_bytes,
)
from ram_tier_inputs import ModelBytes
from ram_tier_services import Stack, start_stack

from moe_l2_domains.known import known_domains

SEED = 42


@dataclass
class Sample:
    """One request of one configuration."""

    budget_pct: float
    round: int
    config: str
    request: int
    domain: str | None
    prompt_tokens: int
    decode_tokens: int
    decode_tps: float
    prompt_tps: float
    majflt: int
    read_bytes: int  # llama + cache-manager, /proc/PID/io
    block_read_bytes: int | None
    text: str
    hint_ms: float | None = None
    hint_status: int | None = None
    sent_s: float = 0.0  # on the sampler's clock: when the request went, when its prefill ended, when it returned
    prefilled_s: float = 0.0
    done_s: float = 0.0

    @property
    def majflt_per_token(self) -> float:
        return self.majflt / max(1, self.decode_tokens)

    @property
    def read_bytes_per_token(self) -> float:
        return self.read_bytes / max(1, self.decode_tokens)

    @property
    def block_read_bytes_per_token(self) -> float | None:
        return None if self.block_read_bytes is None else self.block_read_bytes / max(1, self.decode_tokens)


@dataclass
class ConfigRun:
    budget_pct: float
    round: int
    config: str
    budget_bytes: int
    cold_resident_bytes: int
    samples: list[Sample] = field(default_factory=list)
    max_resident_bytes: int = 0
    max_rss_file_bytes: int = 0
    max_rss_anon_bytes: int = 0
    residency_samples: int = 0
    over_budget: list[tuple[float, int]] = field(default_factory=list)  # the samples above the budget: (s, bytes)
    balloon: dict | None = None
    ram_tier: dict | None = None
    cache_stats_problem: str | None = None
    start_seconds: float = 0.0


def domain_of(i: int, args: argparse.Namespace) -> str:
    """Request i replays trace sequence i (the server is fresh for every config): its ESFT task;
    without a trace the taxonomy's domains in turn."""
    if args.seq_tags:
        return str(args.seq_tags[i % len(args.seq_tags)])
    domains = sorted(known_domains())
    return domains[i % len(domains)]


def counters(stack: Stack, block: Path | None) -> tuple[int, int, int | None]:
    """(llama's major faults, bytes the stack read from storage, the block device's bytes read), read before
    and after a request."""
    return (
        proc_majflt(stack.llama_pid),
        sum(proc_read_bytes(p) for p in stack.pids()),
        block_read_bytes(block),
    )


def one_request(
    client: httpx.Client, stack: Stack, i: int, run: ConfigRun, args: argparse.Namespace, origin: float
) -> Sample:
    domain = domain_of(i, args)
    hint_ms = hint_status = None
    if stack.cache_url and args.hints == "on":
        t0 = time.perf_counter()
        resp = client.post(f"{stack.cache_url}/v1/hint", json={"domain": domain})
        hint_ms, hint_status = (time.perf_counter() - t0) * 1000, resp.status_code
    body = {
        "prompt": make_prompt(i, args.prompt_words),
        "n_predict": args.tokens,
        "temperature": 0,
        "top_k": 1,
        "seed": SEED,
        "cache_prompt": False,
        "ignore_eos": True,
    }
    before = counters(stack, args.block_stat)
    sent = time.monotonic() - origin
    resp = client.post(f"{stack.llama_url}/completion", json=body, headers={"X-MoE-Domain": domain})
    after = counters(stack, args.block_stat)
    done = time.monotonic() - origin
    resp.raise_for_status()
    answer = resp.json()
    t = answer["timings"]
    return Sample(
        budget_pct=run.budget_pct,
        round=run.round,
        config=run.config,
        request=i,
        domain=domain,
        prompt_tokens=int(t["prompt_n"]),
        decode_tokens=int(t["predicted_n"]),
        decode_tps=float(t["predicted_per_second"]),
        prompt_tps=float(t["prompt_per_second"]),
        majflt=after[0] - before[0],
        read_bytes=after[1] - before[1],
        block_read_bytes=None if after[2] is None or before[2] is None else after[2] - before[2],
        text=str(answer.get("content", "")),
        hint_ms=hint_ms,
        hint_status=hint_status,
        sent_s=round(sent, 2),
        prefilled_s=round(sent + float(t["prompt_ms"]) / 1000, 2),
        done_s=round(done, 2),
    )


def cache_stats(client: httpx.Client, stack: Stack) -> tuple[dict | None, str | None]:
    """The cache-manager's ram_tier stats (None if it has no such field yet: say so)."""
    try:
        stats = client.get(f"{stack.cache_url}/v1/stats").raise_for_status().json()
    except httpx.HTTPError as exc:
        return None, f"GET /v1/stats failed: {exc!r}"
    if "ram_tier" not in stats:
        return None, "this cache-manager's /v1/stats has no ram_tier field (MOE_L2_RAM_BUDGET not implemented?)"
    return stats["ram_tier"], None


def run_config(
    config: str, pct: float, rnd: int, model: Path, binary: Path, args: argparse.Namespace, logs: Path
) -> ConfigRun:
    """`config` at `pct`% in round `rnd`, from a cold page cache to its services stopped."""
    mb: ModelBytes = args.model_bytes
    budget = mb.budget(pct)
    drop_from_page_cache(mb.files)
    residency = FileResidency(mb.files)
    run = ConfigRun(pct, rnd, config, budget, cold_resident_bytes=residency.resident_bytes())
    mlocked_before = meminfo_bytes("Mlocked")
    t0 = time.monotonic()
    stack = start_stack(config, model, binary, budget, args, logs / f"b{pct:g}-r{rnd}-{config}")
    balloon: BalloonProc | None = None
    sampler = Sampler(residency, stack.llama_pid, budget)
    try:
        run.start_seconds = round(time.monotonic() - t0, 1)
        if not args.no_balloon:
            # locked pages of the model are the budget's own but no longer count in MemAvailable
            locked = max(0, meminfo_bytes("Mlocked") - mlocked_before)
            balloon = BalloonProc(budget + args.margin - locked, args.margin, args.balloon_max_s)
            balloon.wait_ready()
        sampler.start()
        with httpx.Client(timeout=args.request_timeout) as client:
            for i in range(args.requests):
                run.samples.append(one_request(client, stack, i, run, args, sampler.started))
            if stack.cache_url:
                run.ram_tier, run.cache_stats_problem = cache_stats(client, stack)
    except httpx.HTTPError as exc:
        raise BenchError(f"{config}: a request failed: {exc!r} (logs under {logs})") from exc
    finally:
        sampler.finish()
        run.max_resident_bytes, run.max_rss_file_bytes = sampler.max_resident, sampler.max_rss_file
        run.max_rss_anon_bytes, run.residency_samples = sampler.max_rss_anon, sampler.samples
        run.over_budget = sampler.over
        stack.supervisor.stop()
        if balloon is not None:
            run.balloon = balloon.stop()
        residency.close()
    return run
