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

The parts, each a module of bench/ beside the shared harness (bench/harness):
    ram_tier_inputs    the model and its budgets, the ESFT trace with the tasks taking turns, the flywheel seed
    ram_tier_services  one config's processes: llama-server, and for moe-l2 redis and the cache-manager
    ram_tier_runs      one config at one budget: cold start, balloon, the requests and their counters
    ram_tier_results   the figures at each budget, the ratios against stock, the greedy check, the table
    kernel_probes      what the kernel says: faults, bytes read, residency (mincore), the page cache dropped
    balloon            the memory balloon, and BalloonProc, its client
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from moe_l2_gguf.index import GGUFIndexError, load_index

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own modules: harness, data_paths
from harness.output import fmt_num, fresh_log_dir, write_json
from harness.servers import BenchError, Interrupted, on_sigterm, resolve_binary
from harness.timing import median, rotated
from kernel_probes import block_stat_path
from ram_tier_inputs import ModelBytes, held_out_seed, parse_budgets, resolve_model, resolve_trace
from ram_tier_results import machine, summarize, table
from ram_tier_runs import SEED, ConfigRun, run_config
from ram_tier_services import CONFIGS, DEFAULT_CONFIGS

MODELS_DIR = Path.home() / ".cache" / "moe-l2" / "models"
MIB = 1 << 20


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
            logs = fresh_log_dir(args.out)
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
                                f"  {config}: decode {fmt_num(tps, '.2f')} tok/s, max resident "
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
