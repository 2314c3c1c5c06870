"""Models larger than memory: stock llama-server (mmap) vs moe-l2's RAM tier, at the same memory budget.

Issue 17's benchmark. For each budget (a share of the model's routed expert bytes, on top of its
non-expert bytes) and each round, two configurations run one after the other, the order rotated
every round, on the same llama-server binary, flags, model, prompts and route trace:

  stock   llama-server alone: llama.cpp's mmap, the kernel's page cache is the only cache
  moe-l2  the same llama-server with --moe-willneed (each MoE layer's chosen experts read ahead
          by the engine) + a real redis-server + the real cache-manager with MOE_L2_RAM_BUDGET;
          before each request the bench POSTs /v1/hint {"domain": D} (the prefetch the gateway
          triggers when a request starts) and sends X-MoE-Domain to llama
  willneed  (only with --configs ...,willneed) stock + --moe-willneed: the engine's part alone

--hints off and --willneed off take those parts out of moe-l2, to measure what each brings.

Before each configuration everything is stopped and the model file is dropped from the page cache
(POSIX_FADV_DONTNEED with no process mapping it), so both start cold. Once the services are up, a
balloon (bench/balloon.py, a separate process) holds anonymous memory so that MemAvailable is about
the budget + --margin-mib: there is no swap, so the page cache (the model's only home under mmap) gets
no more than that. It is sized after the services have loaded, so their own working memory (llama's
KV cache and compute buffers, the cache-manager's heap) is already outside MemAvailable and needs no
guess; pages the cache-manager has already locked are subtracted (they are the budget's, yet no
longer count as available).

Measured per request, from the processes themselves: decode tokens/s (llama's own timings), major
faults of llama per generated token (/proc/PID/stat), bytes read from storage per generated token
(/proc/PID/io read_bytes of llama and the cache-manager; the block device's sectors read as a second
figure, which sees everything on the machine), and, sampled every 100 ms by a thread, the model
file's page-cache residency (mincore on a read-only mapping of our own, which never faults a page
in) and llama's RssFile; the maxima are kept. Greedy decoding (temperature 0, top_k 1, one seed):
the texts of stock and moe-l2 for the same prompt must be identical.

    python bench/ram_tier.py [--model PATH | --shape ds-v2-lite] [--budgets 50,75] [--rounds 2]
        [--requests 4] [--tokens 32] [--binary PATH] [--trace auto|none|FILE] [--margin-mib 768]
        [--no-balloon] [--hints on|off] [--willneed on|off] [--configs stock,willneed,moe-l2]
        [--out bench/results/ram_tier.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from moe_l2_cache.ram_tier import kept_page_bytes
from moe_l2_domains.known import known_domains
from moe_l2_gguf.index import ExpertIndex, GGUFIndexError, load_index
from moe_l2_llama.route_trace import ROUTE_TRACE_ENV
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.llama_service import llama_service_spec
from moe_l2_ops.supervisor import ServiceSpec, Supervisor, SupervisorError, free_port, http_ok, tcp_open

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own modules: harness, data_paths
import data_paths
from balloon import BalloonProc
from harness.output import meminfo_bytes, write_json
from harness.prompts import make_prompt
from harness.servers import BenchError, Interrupted, on_sigterm, resolve_binary, trace_patch_present
from harness.timing import median, rotated
from harness.traces import interleave_domains, write_sequences
from kernel_probes import (
    FileResidency,
    Sampler,
    block_read_bytes,
    block_stat_path,
    drop_from_page_cache,
    proc_majflt,
    proc_read_bytes,
)

REPO = Path(__file__).resolve().parent.parent
MODELS_DIR = Path.home() / ".cache" / "moe-l2" / "models"
TRACE_ENV = ROUTE_TRACE_ENV
ESFT_TASKS = ("intent", "law", "summary", "translation")
ESFT_N_EXPERT = 64
MIB = 1 << 20
SEED = 42
# "willneed": stock + the engine's read-ahead of each layer's chosen experts alone, no tier (--configs)
CONFIGS = ("stock", "willneed", "moe-l2")
DEFAULT_CONFIGS = ("stock", "moe-l2")

# -- the model ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelBytes:
    """The split the budget is defined on: routed expert bytes vs everything else in the file(s)."""

    files: tuple[Path, ...]
    file_bytes: int
    expert_bytes: int  # every routed expert slice (gate + up + down) of every MoE layer
    non_expert_bytes: int  # the rest of the file(s): always needed, always kept by moe-l2
    kept_bytes: int  # the pages those bytes and the experts' shared boundaries occupy: what the tier always keeps
    n_layer: int
    n_moe_layers: int
    n_expert: int
    n_expert_used: int
    model_id: str

    @classmethod
    def from_index(cls, index: ExpertIndex) -> ModelBytes:
        file_bytes = sum(index.file_sizes)
        return cls(
            files=tuple(index.files),
            file_bytes=file_bytes,
            expert_bytes=index.routed_bytes,
            non_expert_bytes=file_bytes - index.routed_bytes,
            kept_bytes=kept_page_bytes(index),
            n_layer=index.n_layer,
            n_moe_layers=len(index.layers),
            n_expert=index.n_expert,
            n_expert_used=index.n_expert_used,
            model_id=index.model_id,
        )

    def budget(self, pct: float) -> int:
        """RAM_BUDGET for `pct`% of the expert bytes: the pages always kept are in it (the non-expert bytes and
        the pages two experts share: 0.25% more on ds-v2-lite, twice them on the demo model's 8 KiB slices)."""
        return self.kept_bytes + int(self.expert_bytes * pct / 100)


def parse_budgets(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--budgets {text!r}: expected percentages of the expert bytes, e.g. 50,75") from None
    if not values or any(not 0 < v <= 100 for v in values):
        raise BenchError(f"--budgets {text!r}: each must be in (0, 100]")
    return values


# -- the services of one configuration ------------------------------------------------------------


@dataclass
class Stack:
    """The processes of one configuration while it runs."""

    config: str
    supervisor: Supervisor
    llama_url: str
    llama_pid: int
    cache_url: str | None = None
    cache_pid: int | None = None

    def pids(self) -> list[int]:
        return [p for p in (self.llama_pid, self.cache_pid) if p is not None]


def llama_env(args: argparse.Namespace) -> dict[str, str]:
    env = {"LLAMA_ARG_MOE_DOMAINS": ",".join(sorted(known_domains() | set(ESFT_TASKS)))}
    if args.trace_file:
        env[TRACE_ENV] = str(args.trace_file)
    return env


def start_stack(config: str, model: Path, binary: Path, budget: int, args: argparse.Namespace, logs: Path) -> Stack:
    supervisor = Supervisor(logs)
    try:
        settings = LlamaSettings(
            port=free_port(),
            parallel=1,
            ctx_size=args.ctx,
            threads=args.threads,
            telemetry=True,
            admin_token=args.token,
            moe_willneed=config == "willneed" or (config == "moe-l2" and args.willneed == "on"),
            cpu_repack=False,  # repacked weights would live in anonymous memory, not in the mapping
        )
        spec = llama_service_spec(f"llama-{config}", binary, model, settings, start_timeout_s=args.start_timeout)
        spec.env.update(llama_env(args))
        llama = supervisor.start(spec)
        stack = Stack(config, supervisor, llama.spec.url, llama.proc.pid)
        if config == "moe-l2":
            redis_port = free_port()
            redis_dir = logs / "redis"
            redis_dir.mkdir(exist_ok=True)
            argv = [redis_binary(), "--bind", "127.0.0.1", "--port", str(redis_port), "--dir", str(redis_dir)]
            argv += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
            supervisor.start(
                ServiceSpec("redis", argv, tcp_open("127.0.0.1", redis_port), f"redis://127.0.0.1:{redis_port}/0")
            )
            redis_url = f"redis://127.0.0.1:{redis_port}/0"
            if args.seed_bodies:
                seed_flywheel(redis_url, args.seed_bodies, args.model_bytes.model_id)
            cache_port = free_port()
            env = {
                "MOE_L2_MODEL_PATH": str(model),
                "MOE_L2_LLAMA_URL": stack.llama_url,
                "MOE_L2_REDIS_URL": redis_url,
                "MOE_L2_CACHE_PORT": str(cache_port),
                "MOE_L2_CACHE_HOST": "127.0.0.1",
                "MOE_L2_ADMIN_TOKEN": args.token,
                "MOE_L2_RAM_BUDGET": str(budget),
                "MOE_L2_EXTRA_DOMAINS": ",".join(ESFT_TASKS),
                # requests run one at a time, each its own domain: every hint switches at once
                "MOE_L2_CACHE_DWELL_S": str(args.dwell_s),
            }
            base = f"http://127.0.0.1:{cache_port}"
            cm = supervisor.start(
                ServiceSpec(
                    "cache-manager",
                    [sys.executable, "-m", "moe_l2_cache"],
                    http_ok(f"{base}/healthz"),
                    base,
                    env=env,
                    start_timeout_s=args.start_timeout,
                )
            )
            stack.cache_url, stack.cache_pid = base, cm.proc.pid
        return stack
    except SupervisorError as exc:
        supervisor.stop()
        raise BenchError(f"{config}: a service did not start: {str(exc).splitlines()[0]} (logs under {logs})") from exc
    except BaseException:
        supervisor.stop()
        raise


def redis_binary() -> str:
    from moe_l2_ops.stack import redis_server_binary

    try:
        return redis_server_binary()
    except SupervisorError as exc:
        raise BenchError(str(exc)) from exc


def seed_flywheel(redis_url: str, seed: dict[str, dict], model_id: str) -> None:
    """The flywheel's tables as if the held-out sequences had been served (the keys of
    moe_l2_cache.redis_keys): per domain, per MoE layer, expert -> activations, and its tokens."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        base = f"moe:{model_id}"
        for domain, table in seed.items():
            client.sadd(f"{base}:domains", domain)
            client.hincrby(f"{base}:tokens", domain, int(table["tokens"]))
            for layer, experts in table["layers"].items():
                client.hset(f"{base}:routing:{domain}:{layer}", mapping={str(e): c for e, c in experts.items()})
    finally:
        client.close()


# -- one configuration ----------------------------------------------------------------------------


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


# -- results --------------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; 0 / 0 is 1.0 (neither faulted nor read: no difference), x / 0 is undefined (None)."""
    if a is None or b is None:
        return None
    if b == 0:
        return 1.0 if a == 0 else None
    return a / b


def summarize_config(runs: list[ConfigRun]) -> dict:
    samples = [s for r in runs for s in r.samples]
    block = [x for s in samples if (x := s.block_read_bytes_per_token) is not None]
    budget = runs[0].budget_bytes if runs else 0
    max_res = max((r.max_resident_bytes for r in runs), default=0)
    return {
        "decode_tokens_per_s": median([s.decode_tps for s in samples]),
        "prompt_tokens_per_s": median([s.prompt_tps for s in samples]),
        "majflt_per_token": median([s.majflt_per_token for s in samples]),
        "read_bytes_per_token": median([s.read_bytes_per_token for s in samples]),
        "block_read_bytes_per_token": median(block),
        "max_model_resident_bytes": max_res,
        "max_rss_file_bytes": max((r.max_rss_file_bytes for r in runs), default=0),
        "max_rss_anon_bytes": max((r.max_rss_anon_bytes for r in runs), default=0),
        "budget_bytes": budget,
        "resident_within_budget": max_res <= budget,
        "residency_samples": sum(r.residency_samples for r in runs),
        "requests": len(samples),
    }


def greedy_check(runs: list[ConfigRun]) -> tuple[bool, list[dict]]:
    """Every request index's text must be the same in every run (config, round, budget)."""
    texts: dict[int, dict[str, str]] = {}
    for r in runs:
        for s in r.samples:
            texts.setdefault(s.request, {})[f"{s.config}/b{s.budget_pct:g}/r{s.round}"] = s.text
    mismatches = [
        {"request": i, "texts": by_run} for i, by_run in sorted(texts.items()) if len(set(by_run.values())) > 1
    ]
    both = {s.config for r in runs for s in r.samples} >= {"stock", "moe-l2"}
    return both and not mismatches, mismatches


def ratios(x: dict, stock: dict) -> dict[str, float | None]:
    keys = ("decode_tokens_per_s", "majflt_per_token", "read_bytes_per_token", "block_read_bytes_per_token")
    return {k: ratio(x[k], stock[k]) for k in keys}


def summarize(
    runs: list[ConfigRun], budgets: list[float], mb: ModelBytes, configs: tuple[str, ...] = DEFAULT_CONFIGS
) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for pct in budgets:
        at = [r for r in runs if r.budget_pct == pct]
        per = {c: summarize_config([r for r in at if r.config == c]) for c in configs}
        identical, mismatches = greedy_check(at)
        out[f"{pct:g}"] = {
            "budget_pct_of_expert_bytes": pct,
            "budget_bytes": mb.budget(pct),
            "configs": per,
            "ratios_moe_l2_vs_stock": ratios(per["moe-l2"], per["stock"]),
            "greedy_identical": identical,
            "greedy_mismatches": mismatches,
        }
        if "willneed" in per:
            out[f"{pct:g}"]["ratios_willneed_vs_stock"] = ratios(per["willneed"], per["stock"])
    return out


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(pct: str, b: dict) -> str:
    lines = [
        f"budget {pct}% of the expert bytes = {b['budget_bytes'] / 2**30:.2f} GiB (with the non-expert bytes)",
        "",
        "| config | decode tok/s | majflt/token | read MB/token (proc) | read MB/token (block dev) "
        "| max model resident GiB | max RssFile GiB | resident <= budget |",
        "|" + " --- |" * 8,
    ]
    for c in (c for c in CONFIGS if c in b["configs"]):
        x = b["configs"][c]
        lines.append(
            f"| {c} | {_f(x['decode_tokens_per_s'], '.2f')} | {_f(x['majflt_per_token'], '.1f')} "
            f"| {_f(x['read_bytes_per_token'] and x['read_bytes_per_token'] / 1e6, '.3f')} "
            f"| {_f(x['block_read_bytes_per_token'] and x['block_read_bytes_per_token'] / 1e6, '.3f')} "
            f"| {x['max_model_resident_bytes'] / 2**30:.3f} | {x['max_rss_file_bytes'] / 2**30:.3f} "
            f"| {'pass' if x['resident_within_budget'] else 'FAIL'} |"
        )
    for c in ("willneed", "moe_l2"):
        if (r := b.get(f"ratios_{c}_vs_stock")) is None:
            continue
        x = {k: "-" if v is None else f"{v:.2f}x" for k, v in r.items()}
        lines.append(
            f"| {c.replace('_', '-')} / stock | {x['decode_tokens_per_s']} | {x['majflt_per_token']} "
            f"| {x['read_bytes_per_token']} | {x['block_read_bytes_per_token']} | | | |"
        )
    lines.append(
        f"\ngreedy output identical (stock vs moe-l2, every prompt): {'yes' if b['greedy_identical'] else 'NO'}"
    )
    return "\n".join(lines)


# -- inputs ---------------------------------------------------------------------------------------


def shape_size_estimate(name: str) -> int | None:
    """The generated file's tensor bytes (the header adds a few MB)."""
    from moe_l2_gguf.model_shapes import get_shape, sizes

    try:
        return sizes(get_shape(name)).tensor_bytes
    except ValueError:
        return None


def resolve_model(args: argparse.Namespace) -> tuple[Path, dict]:
    if args.model is not None:
        if not args.model.is_file():
            raise BenchError(f"--model {args.model} does not exist")
        return args.model, {"path": str(args.model), "generated": False}
    from moe_l2_gguf.model_shapes import DemoModelError, get_shape, write_shape_model

    try:
        shape = get_shape(args.shape)
    except ValueError as exc:
        raise BenchError(str(exc)) from exc
    path = args.model_dir / f"{shape.name}-full.gguf"
    info = {"path": str(path), "generated": True, "shape": shape.name, "layers": shape.n_layer}
    if path.is_file():
        return path, info | {"reused": True}
    args.model_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.model_dir).free
    need = shape_size_estimate(args.shape) or 11 * 10**9  # ds-v2-lite with Q4 experts: about 9-10 GB
    if free < need + (2 << 30):
        raise BenchError(
            f"{args.model_dir} has {free / 1e9:.1f} GB free; the {shape.name} model needs about {need / 1e9:.1f} GB"
        )
    print(
        f"writing the full {shape.name} shape to {path} (about {need / 1e9:.0f} GB, {free / 1e9:.0f} GB free) ...",
        file=sys.stderr,
        flush=True,
    )
    try:
        result = write_shape_model(path, shape, seed=0, progress=True)
    except DemoModelError as exc:
        raise BenchError(str(exc)) from exc
    return path, info | {"reused": False, "write_seconds": round(result.seconds, 1)}


def resolve_trace(args: argparse.Namespace, binary: Path, mb: ModelBytes, tmp: Path) -> tuple[Path | None, str]:
    """(trace file or None, a note). auto: the ESFT trace when the binary replays traces and the
    model's experts match DeepSeek-V2-Lite's (64 per layer, at most its 26 MoE layers)."""
    if args.trace == "none":
        return None, "the model's own router (--trace none)"
    if args.trace != "auto":
        path = Path(args.trace)
        if not path.is_file():
            raise BenchError(f"--trace {path} does not exist")
        return path.resolve(), f"route trace {path.name}"
    if not trace_patch_present(binary):
        return None, f"the model's own router: this llama-server lacks the {TRACE_ENV} patch"
    if mb.n_expert != ESFT_N_EXPERT or mb.n_moe_layers > 26:
        return None, f"the model's own router: {mb.n_moe_layers} x {mb.n_expert} experts is not the ESFT traces' shape"
    src = data_paths.esft_npz()
    if not src.is_file():
        return None, f"the model's own router: no ESFT routing data at {src}"
    out = tmp / "esft.trace"
    try:
        args.seq_tags = write_interleaved_trace(src, out, mb.n_moe_layers, mb.n_expert)
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot make the ESFT route trace ({exc}); pass --trace FILE or --trace none") from exc
    return out, (
        f"ESFT route trace of DeepSeek-V2-Lite ({TRACE_ENV}), sequences reordered so the tasks take turns; "
        "request i replays sequence i"
    )


def write_interleaved_trace(src: Path, out: Path, layers: int, n_expert: int) -> list[str]:
    """The ESFT trace with its sequences reordered so that the four tasks take turns (the npz holds
    them task by task: the first requests would all be `intent`); returns each sequence's task."""
    from moe_l2_llama.route_trace import esft_sequence_tasks, from_esft_npz

    tags = esft_sequence_tasks(src)
    order = interleave_domains(tags, order=ESFT_TASKS)
    write_sequences(from_esft_npz(src, layers=layers, n_expert=n_expert), order, out)
    return [tags[s] for s in order]


def held_out_seed(trace_file: Path, n_requests: int, seq_tags: list[str], moe_layers: list[int]) -> tuple[dict, str]:
    """Per-domain routing counts of the trace's sequences no request replays (sequences >= n_requests)."""
    from moe_l2_llama.route_trace import read_route_trace

    trace = read_route_trace(trace_file)
    if trace.n_seq <= n_requests:
        return {}, "none: the trace has no sequence the run does not replay"
    seed: dict[str, dict] = {}
    for s in range(n_requests, trace.n_seq):
        table = seed.setdefault(seq_tags[s], {"tokens": 0, "layers": {}})
        seq = trace.sequence(s)
        table["tokens"] += len(seq)
        for i, layer in enumerate(moe_layers[: trace.n_layer]):
            row = table["layers"].setdefault(layer, {})
            ids, counts = np.unique(seq[:, i, :], return_counts=True)
            for e, c in zip(ids.tolist(), counts.tolist(), strict=True):
                row[e] = row.get(e, 0) + c
    note = (
        f"Redis routing tables seeded from trace sequences {n_requests}..{trace.n_seq - 1} (none replayed): "
        + ", ".join(f"{d} {t['tokens']} tokens" for d, t in sorted(seed.items()))
    )
    return seed, note


def machine() -> dict:
    return {
        "mem_total_bytes": meminfo_bytes("MemTotal"),
        "mem_available_bytes_at_start": meminfo_bytes("MemAvailable"),
        "swap_total_bytes": meminfo_bytes("SwapTotal"),
        "cpu_count": os.cpu_count(),
        "kernel": platform.release(),
        "platform": platform.platform(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", type=Path, help="a MoE GGUF (default: the --shape, generated once)")
    parser.add_argument("--shape", default="ds-v2-lite", help="a real shape (moe_l2_gguf.model_shapes)")
    parser.add_argument("--model-dir", type=Path, default=MODELS_DIR)
    parser.add_argument("--budgets", default="50,75", help="percentages of the routed expert bytes")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=4, help="requests per config per round")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--prompt-words", type=int, default=24)
    parser.add_argument("--binary", type=Path, help="llama-server (default: the cached CPU build)")
    parser.add_argument("--trace", default="auto", help="auto (ESFT when the shape fits), none, or a trace file")
    parser.add_argument("--seed-tables", choices=("auto", "none"), default="auto", help="held-out ESFT counts")
    parser.add_argument("--margin-mib", type=float, default=768.0)
    parser.add_argument("--no-balloon", action="store_true", help="no memory pressure (smoke tests only)")
    parser.add_argument("--balloon-max-s", type=float, default=3600.0)
    parser.add_argument("--dwell-s", type=float, default=0.0, help="the cache-manager's MOE_L2_CACHE_DWELL_S")
    parser.add_argument(
        "--hints",
        choices=("on", "off"),
        default="on",
        help="off: moe-l2 without the request-start hint (its prefetch of the domain's hot set): the tier alone",
    )
    parser.add_argument(
        "--willneed",
        choices=("on", "off"),
        default="on",
        help="off: moe-l2 without the engine's read-ahead of each layer's chosen experts (--moe-willneed)",
    )
    parser.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"which of {', '.join(CONFIGS)} to run (stock and moe-l2 always); willneed: stock + --moe-willneed",
    )
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--request-timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/ram_tier.json"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.tokens < 1:
        parser.error("--rounds, --requests and --tokens must be at least 1")
    args.margin = int(args.margin_mib * MIB)
    chosen = {c.strip() for c in args.configs.split(",") if c.strip()}
    if unknown := chosen - set(CONFIGS):
        parser.error(f"--configs: unknown {', '.join(sorted(unknown))} (known: {', '.join(CONFIGS)})")
    args.configs = tuple(c for c in CONFIGS if c in chosen | set(DEFAULT_CONFIGS))
    return args


def main(argv: list[str] | None = None, progress: Callable[[str], None] | None = None) -> int:
    args = parse_args(argv)
    say = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    args.token = secrets.token_hex(16)
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    runs: list[ConfigRun] = []
    interrupted = False
    t_start = time.monotonic()
    try:
        budgets = parse_budgets(args.budgets)
        # MOE_L2_LLAMA_SERVER where --binary is not given; else the CPU build with the route-trace hook
        env = os.environ.get("MOE_L2_LLAMA_SERVER")
        binary = resolve_binary(args.binary or (Path(env) if env else None), "cpu", test_hooks=True)
        model, model_info = resolve_model(args)
        try:
            mb = ModelBytes.from_index(load_index(model))
        except GGUFIndexError as exc:
            raise BenchError(str(exc)) from exc
        args.model_bytes = mb
        args.block_stat = block_stat_path(model)
        with tempfile.TemporaryDirectory(prefix="ram-tier-") as tmp_name:
            args.seq_tags = None
            args.trace_file, trace_note = resolve_trace(args, binary, mb, Path(tmp_name))
            args.seed_bodies, seed_note = {}, "none"
            if args.seq_tags is not None:  # the ESFT trace: each sequence's task is its domain
                if args.seed_tables == "auto":
                    moe_layers = sorted(load_index(model).layers)
                    args.seed_bodies, seed_note = held_out_seed(
                        args.trace_file, args.requests, args.seq_tags, moe_layers
                    )
            logs = args.out.parent / f"{args.out.stem}-logs"
            shutil.rmtree(logs, ignore_errors=True)
            logs.mkdir(parents=True)
            say(
                f"model {model.name}: {mb.file_bytes / 2**30:.2f} GiB, experts {mb.expert_bytes / 2**30:.2f} GiB, "
                f"non-expert {mb.non_expert_bytes / 2**30:.2f} GiB; routing: {trace_note}"
            )
            try:
                for pct in budgets:
                    for rnd in range(args.rounds):
                        for config in rotated(args.configs, rnd):
                            say(f"budget {pct:g}% round {rnd + 1}/{args.rounds}: {config} ...")
                            run = run_config(config, pct, rnd, model, binary, args, logs)
                            runs.append(run)
                            tps = median([s.decode_tps for s in run.samples])
                            say(
                                f"  {config}: decode {_f(tps, '.2f')} tok/s, max resident "
                                f"{run.max_resident_bytes / 2**30:.3f} GiB (budget {run.budget_bytes / 2**30:.3f})"
                            )
            except (Interrupted, KeyboardInterrupt):
                interrupted = True
                say("interrupted: reporting the configs that finished")
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)

    results = {
        "benchmark": "ram_tier",
        "machine": machine(),
        "binary": str(binary),
        "model": model_info
        | {
            "file_bytes": mb.file_bytes,
            "expert_bytes": mb.expert_bytes,
            "non_expert_bytes": mb.non_expert_bytes,
            "kept_bytes": mb.kept_bytes,
            "n_layer": mb.n_layer,
            "n_moe_layers": mb.n_moe_layers,
            "n_expert": mb.n_expert,
            "n_expert_used": mb.n_expert_used,
        },
        "settings": {
            "budgets_pct": budgets,
            "rounds": args.rounds,
            "requests": args.requests,
            "tokens": args.tokens,
            "prompt_words": args.prompt_words,
            "threads": args.threads,
            "ctx": args.ctx,
            "balloon": not args.no_balloon,
            "margin_bytes": args.margin,
            "dwell_s": args.dwell_s,
            "hints": args.hints,
            "willneed": args.willneed,
            "configs": list(args.configs),
            "greedy": {"temperature": 0, "top_k": 1, "seed": SEED},
            "llama_flags": "--parallel 1 --no-repack, default mmap, the same for every config but "
            "--moe-willneed (moe-l2 unless --willneed off, and willneed)",
        },
        "routing": trace_note,
        "flywheel_seed": seed_note,
        "block_device_stat": str(args.block_stat) if args.block_stat else None,
        "interrupted": interrupted,
        "seconds": round(time.monotonic() - t_start, 1),
        "method": (
            "per request: llama's timings (decode tok/s); deltas of /proc/<llama>/stat majflt, /proc/<pid>/io "
            "read_bytes of llama + cache-manager, and the block device's sectors read, each / generated tokens "
            "(the prompt's evaluation is inside the same request); every 100 ms: mincore of the model file on "
            "the bench's own unread mapping (its page-cache residency) and llama's RssFile, maxima kept; the "
            "balloon is sized once the services are up so that MemAvailable ~ budget + margin (minus model "
            "pages already locked)"
        ),
        "budgets": summarize(runs, budgets, mb, args.configs),
        "runs": [
            {k: v for k, v in asdict(r).items() if k != "samples"}
            | {"samples": [asdict(s) | {"majflt_per_token": s.majflt_per_token} for s in r.samples]}
            for r in runs
        ],
    }
    write_json(args.out, results)
    print(f"\nram_tier: {model_info.get('shape', model.name)}; routing: {trace_note}; flywheel seed: {seed_note}")
    for pct, b in results["budgets"].items():
        print()
        print(table(pct, b))
    print(f"\n-> {args.out}")
    return 124 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
