"""Where the experts live: decode and prompt tokens/s, and host→device expert bytes per token, for the
ways llama-server can place a MoE model's experts on a device, side by side in one run.

One llama-server per configuration, all on the same model and device, every one with -ngl 99:
  a  all-device    everything on the device (only when it fits in the device's free memory)
  b  cpu-moe       --cpu-moe: the routed experts stay in host memory and are computed on the CPU
  c  n-cpu-moe     --n-cpu-moe N: the experts of the last layers on the device, N chosen so that the
                   device holds no more expert bytes than the expert cache's budget (--cache-bytes)
  d  copy-used     --cpu-moe with GGML_OP_OFFLOAD_MIN_BATCH=1: the scheduler copies the experts each
                   micro-batch uses to the device and computes them there (the path the cache sits on)
  e  expert-cache  --cpu-moe with the expert cache (--moe-cache-bytes) at the device expert bytes of c:
                   used experts computed on the device, only the misses copied (docs/expert-cache.md)
Variants: bp, cp, dp, ep are b, c, d, e with `--load-mode none` (no mmap: llama.cpp keeps host-resident
weights in the device's pinned host buffer), so that the best stock row is the best a llama.cpp user
could configure; em is e with `--load-mode mmap` forced, el e with `--moe-cache-policy lru`; e itself
names no load mode (the engine chooses, and its "expert cache: host experts" line goes into the JSON).
The project's rows are set against the best stock row at no more device expert bytes (vs_best_stock).
--concurrent N measures N concurrent requests on servers of their own (-np N; domains mixed);
--constants puts bench/gpu_facts.py's machine constants into the JSON beside those the runs give
(CPU expert GB/s from b, GPU time per token from a), and on CUDA the copy rate from the mapped model
file itself (constants.h2d_mapped); bench/placement_model.py --against checks a folder of these JSON
files against its cost model; --gauges reads the NVML gauges against nvidia-smi.
Requests take turns over the servers (one generates at a time, the order rotated each run) so that
machine noise hits all alike. Every run is two requests per server: the prompt alone (n_predict 1,
no prompt cache: prompt tokens/s) and then the same prompt with the cache (one token re-evaluated,
then --tokens decode steps: decode tokens/s).

Host→device expert bytes per token: llama.cpp counts no such thing, so for the stock rows they are derived
from the routing telemetry (bench/offload_bytes.py says how); the expert cache's rows are measured by its own
counters.

With a route trace (LLAMA_MOE_ROUTE_TRACE, the telemetry patch's test override) every server routes
exactly the experts DeepSeek-V2-Lite routed on the ESFT prompts; without one the model's own
(random) router picks them, which the JSON and the table say.

    python bench/expert_offload.py [--backend vulkan|cuda|cpu|rpc] [--binary PATH] [--model PATH | --full]
        [--cache-bytes 50%|4GiB|N] [--configs a,b,bp,c,cp,d,dp,e,ep,em,el] [--runs 5] [--tokens 32]
        [--trace FILE|auto|none] [--concurrent 4 --concurrent-configs cp,e] [--constants FILE|measure]
        [--gauges] [--start-jobs N] [--out bench/results/expert_offload.json] [--log-dir DIR]

The parts, each a module of bench/ beside the shared harness (bench/harness):
    offload_configs    the configs, the model's expert bytes, the choice of --n-cpu-moe
    offload_device     the device's free memory, each server's need, the buffers it holds
    offload_servers    a config's llama-server (its arguments: server_plan), its completions
    offload_bytes      host→device expert bytes: derived from the routing telemetry, or the cache's counters
    offload_replay     the cache's held-out profile, the Python replay of its access log
    offload_runs       the servers started, the runs taking turns, the -np N rounds
    offload_results    each config's row, the engine's own log lines
    offload_constants  the cost model's constants: given, measured on the GPU, derived from the runs
    offload_tables     the Markdown tables
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moe_l2_gguf.index import GGUFIndexError, load_index
from moe_l2_llama.cpu_features import cpu_has_amx
from moe_l2_llama.route_trace import ROUTE_TRACE_ENV, esft_sequence_tasks

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own modules: harness, data_paths
import data_paths
from harness.models import given_model, model_shape, write_model
from harness.output import fresh_log_dir, machine, write_json
from harness.servers import BenchError, Interrupted, on_sigterm, resolve_binary, trace_patch_present
from harness.traces import interleave_domains, subset_trace
from offload_configs import (
    BACKENDS,
    CONFIGS,
    ExpertLayout,
    choose_n_cpu_moe,
    concurrency,
    parse_bytes,
    parse_concurrent,
    parse_configs,
)
from offload_constants import derived_constants, load_constants, mapped_h2d
from offload_device import DEVICE_MARGIN_BYTES, check_fits
from offload_replay import held_out_profile
from offload_results import config_rows, row_notes
from offload_runs import measure
from offload_tables import table, versus_best_stock, versus_table

DEVICE_NOTES = {
    "vulkan": "Vulkan device (llvmpipe when no GPU: device memory is host memory, absolute speeds mean little)",
    "cuda": "CUDA device 0",
    "cpu": "no device: the CPU build runs every config on the CPU (checks the plumbing only)",
    "rpc": "ggml's RPC device: a ggml-rpc-server per llama-server, its CPU backend as the device (plumbing)",
}


def resolve_model(args: argparse.Namespace, tmp: Path) -> tuple[Path, dict]:
    if args.model is not None:
        return args.model, given_model(args.model)
    shape = model_shape(args.shape, None if args.full else (args.layers, args.vocab))
    path = (args.model_dir or tmp) / f"{shape.name}-{shape.n_layer}l.gguf"
    print(f"writing the {shape.name} shape ({shape.n_layer} layers) to {path} ...", file=sys.stderr, flush=True)
    seconds = write_model(path, shape, progress=False)
    info = {"path": str(path), "generated": True, "shape": shape.name, "layers": shape.n_layer}
    info |= {"vocab": shape.n_vocab, "write_seconds": round(seconds, 1)}
    return path, info


def resolve_trace(args: argparse.Namespace, binary: Path, layout: ExpertLayout, tmp: Path) -> tuple[Path | None, str]:
    """(the trace file or None, a note for the JSON and the table)."""
    if args.trace == "none":
        return None, "the model's own router (--trace none)"
    present = trace_patch_present(binary)
    if args.trace != "auto":
        path = Path(args.trace)
        if not path.is_file():
            raise BenchError(f"--trace {path} does not exist")
        if not present:
            raise BenchError(f"--trace given but {binary} was built without the {ROUTE_TRACE_ENV} patch")
        return path.resolve(), f"route trace {path.name} ({ROUTE_TRACE_ENV})"
    if not present:
        return None, f"the model's own (random) router: this llama-server lacks the {ROUTE_TRACE_ENV} patch"
    src = data_paths.esft_npz()
    if not src.is_file():
        return None, f"the model's own (random) router: no ESFT routing data at {src} (set MOE_L2_ROUTING_DATA)"
    out = tmp / "esft.trace"
    cmd = [sys.executable, "-m", "moe_l2_ops.cli", "make-route-trace", "--from", str(src), "--out", str(out)]
    cmd += ["--layers", str(len(layout.expert_bytes)), "--experts", str(layout.n_expert)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not out.is_file():
        why = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchError(f"cannot make the ESFT route trace ({why}); pass --trace FILE or --trace none")
    return out, f"ESFT route trace of DeepSeek-V2-Lite ({ROUTE_TRACE_ENV}, moe-l2 make-route-trace)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, default=os.environ.get("MOE_L2_BENCH_BACKEND", "vulkan"))
    parser.add_argument("--binary", type=Path, help="llama-server built with the patches for --backend")
    parser.add_argument("--cuda-arch", default="90", help="CMAKE_CUDA_ARCHITECTURES when building for cuda")
    parser.add_argument("--model", type=Path, help="a MoE GGUF (default: generate the --shape)")
    parser.add_argument("--shape", default="ds-v2-lite")
    parser.add_argument("--full", action="store_true", help="the whole shape (else --layers and --vocab reduce it)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--model-dir", type=Path, help="where to write the generated model (default: a temp dir)")
    parser.add_argument("--cache-bytes", default="50%", help="the expert cache's device budget: 4GiB, 512M, 50%%")
    parser.add_argument(
        "--configs",
        default="a,b,c,d,e",
        help="of " + ",".join(CONFIGS) + " (b is the baseline; p: pinned, m: mmap, l: lru)",
    )
    parser.add_argument("--trace", default="auto", help="a route trace file, auto (ESFT if the patch exists), none")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="decode tokens per run")
    parser.add_argument("--prompt-words", type=int, default=40, help="about 4 tokens each (the shapes' vocabulary)")
    parser.add_argument("--ubatch", type=int, default=512, help="llama-server --ubatch-size")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds for a server to load")
    parser.add_argument("--request-timeout", type=float, default=900.0, help="seconds for one request")
    parser.add_argument(
        "--repack",
        dest="no_repack",
        action="store_false",
        help="let llama.cpp repack CPU weights (default off on AMX CPUs, where it crashes on these models)",
    )
    parser.add_argument(
        "--no-repack",
        dest="force_no_repack",
        action="store_true",
        help="never repack the host's weights: the expert cache cannot read repacked experts (gpt-oss's MXFP4)",
    )
    parser.add_argument(
        "--cache-slots",
        type=int,
        help="e's budget as slots per cached layer (e.g. 16) instead of c's device expert bytes",
    )
    parser.add_argument(
        "--profile",
        choices=("auto", "none"),
        default="auto",
        help="auto: with the ESFT trace, push e the transitions of the sequences the run does not replay",
    )
    parser.add_argument(
        "--domains",
        choices=("esft", "none"),
        default="esft",
        help="esft: with the ESFT trace, tag each request with its sequence's task (e gets per-domain tables)",
    )
    parser.add_argument(
        "--concurrent", type=int, default=0, help="-np N: also measure N concurrent requests on own servers"
    )
    parser.add_argument(
        "--concurrent-configs",
        dest="concurrent_configs_text",
        default="cp,e",
        help="the configs --concurrent measures (default cp,e: the best stock at 50%% on the H200, the default)",
    )
    parser.add_argument(
        "--constants",
        default="none",
        help="the machine's constants for the JSON: a bench/gpu_facts.py constants FILE, measure, or none",
    )
    parser.add_argument("--gauges", action="store_true", help="read the NVML gauges against nvidia-smi once")
    parser.add_argument("--start-jobs", type=int, default=1, help="servers started at once")
    parser.add_argument("--rpc-threads", type=int, default=2, help="--backend rpc: each ggml-rpc-server's threads")
    parser.add_argument(
        "--device-margin-mib",
        type=int,
        default=DEVICE_MARGIN_BYTES >> 20,
        help="device memory per server beyond its weights, for the fit check (KV, compute, driver)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/expert_offload.json"))
    parser.add_argument("--log-dir", type=Path, help="the server logs (default: <out>-logs beside the JSON)")
    args = parser.parse_args(argv)
    if args.cache_slots is not None and args.cache_slots < 1:
        parser.error("--cache-slots must be at least 1")
    if args.no_repack:
        args.no_repack = cpu_has_amx()
    args.no_repack = args.no_repack or args.force_no_repack
    if args.runs < 1 or args.tokens < 2:
        parser.error("--runs must be at least 1 and --tokens at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.token = secrets.token_hex(16)
    args.interrupted = False
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        configs = parse_configs(args.configs)
        args.concurrent_configs = parse_concurrent(args.concurrent_configs_text, args.concurrent)
        args.constants_doc = load_constants(args)
        # the route-trace hook replays a trace: a test build; with --trace none the serving build does
        binary = resolve_binary(args.binary, args.backend, test_hooks=args.trace != "none", cuda_arch=args.cuda_arch)
        with tempfile.TemporaryDirectory(prefix="expert-offload-") as tmp_name:
            tmp = Path(tmp_name)
            model, model_info = resolve_model(args, tmp)
            if isinstance(args.constants_doc, dict) and args.backend == "cuda":
                # before any server holds the device; bench/placement_model.py reads it for mapped rows
                args.constants_doc["h2d_mapped"] = mapped_h2d(model)
            try:
                layout = ExpertLayout.from_index(load_index(model))
            except GGUFIndexError as exc:
                raise BenchError(str(exc)) from exc
            cache_bytes = parse_bytes(args.cache_bytes, layout.routed_bytes)
            n_cpu_moe, device_expert_c = choose_n_cpu_moe(layout, cache_bytes)
            margin = args.device_margin_mib << 20
            everything = configs + args.concurrent_configs
            fitting, skipped = check_fits(everything, layout, device_expert_c, args.backend, margin)
            configs = [c for c in fitting if concurrency(c) == 1]
            args.concurrent_configs = [c for c in fitting if concurrency(c) > 1]
            args.trace_file, trace_note = resolve_trace(args, binary, layout, tmp)
            slot_bytes = max(layout.expert_bytes.values())
            args.e_bytes = args.cache_slots * slot_bytes * len(layout.expert_bytes) if args.cache_slots else 0
            if not args.e_bytes and device_expert_c == 0 and cache_bytes >= slot_bytes * len(layout.expert_bytes):
                # a budget under one layer's experts: c keeps none on the device, and e at c's bytes
                # would be off; e gets the budget itself, against the stock rows' 0 (a reduced model's
                # 25% and 12.5%, as in the rehearsal; the full ds-v2-lite's 12.5% is 3 whole layers)
                args.e_bytes = cache_bytes
            args.profile_bodies, args.profile_tables, profile_note = None, None, "none"
            esft = args.trace_file is not None and args.trace == "auto"
            args.seq_tags = esft_sequence_tasks(data_paths.esft_npz()) if esft and args.domains == "esft" else None
            replayed = 1 + 2 * args.runs  # the warm-up and two requests a run: sequences 0..2 runs
            concurrent_seqs: list[int] = []
            if args.concurrent_configs and args.trace_file is not None and args.seq_tags:
                # the trace's sequences come grouped by task (127 intent first): the -np servers get a
                # trace of their own, sequences taken round-robin over the tasks, so that every round
                # of N concurrent requests mixes domains
                concurrent_seqs = interleave_domains(args.seq_tags, replayed, 2 * args.concurrent)
                args.concurrent_trace = tmp / "concurrent.trace"
                args.concurrent_tags = subset_trace(
                    args.trace_file, concurrent_seqs, args.concurrent_trace, args.seq_tags
                )
            if args.profile == "auto" and esft:
                args.profile_bodies, args.profile_tables, profile_note = held_out_profile(
                    args.trace_file, replayed, layout.n_expert, args.seq_tags, frozenset(concurrent_seqs)
                )
            t0 = time.monotonic()
            log_dir = fresh_log_dir(args.out, args.log_dir)
            args.cache_log_dir = log_dir
            servers, logs = measure(binary, model, layout, configs, n_cpu_moe, device_expert_c, args, log_dir)
            seconds = time.monotonic() - t0
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Interrupted:
        print("error: interrupted (SIGTERM) before any run", file=sys.stderr)
        return 124

    measured = configs + args.concurrent_configs
    rows = config_rows(measured, servers, logs, skipped, args, layout, profile_note, device_expert_c)
    versus = versus_best_stock(rows)
    results = {
        "benchmark": "expert_offload",
        "machine": machine(),
        "backend": args.backend,
        "device": DEVICE_NOTES[args.backend],
        "binary": str(binary),
        "model": model_info
        | {
            "n_layer": layout.n_layer,
            "n_expert": layout.n_expert,
            "n_expert_used": layout.n_expert_used,
            "expert_bytes_per_layer": {str(k): v for k, v in layout.expert_bytes.items()},
            "routed_bytes": layout.routed_bytes,
            "other_bytes": layout.other_bytes,
            "file_bytes": layout.file_bytes,
        },
        "cache_bytes": cache_bytes,
        "e_cache_bytes": args.e_bytes or device_expert_c,
        "n_cpu_moe": n_cpu_moe,
        "routing": trace_note,
        "no_repack": args.no_repack,
        "runs": args.runs,
        "runs_done": len(servers["b"].decode_tps),
        "interrupted": args.interrupted,
        "tokens": args.tokens,
        "prompt_words": args.prompt_words,
        "ubatch": args.ubatch,
        "threads": args.threads,
        "seconds": round(seconds, 1),
        "h2d_bytes_method": (
            "derived, not measured: per request, GET /moe/routing?reset=1 gives each layer's expert counts; "
            "a layer whose experts are in host memory is copied when its rows in the micro-batch reach the "
            "offload minimum (GGML_OP_OFFLOAD_MIN_BATCH); a prompt (one micro-batch) copies its distinct "
            "experts, a decode step (one row) each activation; times one expert's bytes from the GGUF; "
            "llama.cpp's padding (<= 512 B per run of consecutive experts) is left out; config e (the expert "
            "cache) is measured instead: its counters' loaded and bypassed bytes per request"
        ),
        "configs": rows,
        "vs_best_stock": versus,
        "constants": args.constants_doc,
        "derived_constants": derived_constants(rows, layout),
        "gpu_gauges": getattr(args, "gauges_read", None),
    }
    write_json(args.out, results)
    print(
        f"\n{args.backend}: {model_info.get('shape', model.name)}, {layout.n_layer} layers x {layout.n_expert} "
        f"experts, one expert {max(layout.expert_bytes.values()) / 1e6:.2f} MB; cache budget "
        f"{cache_bytes / 1e6:.0f} MB -> --n-cpu-moe {n_cpu_moe}; routing: {trace_note}"
    )
    print(table(rows))
    print()
    print(versus_table(versus))
    for line in row_notes(rows):
        print(line)
    print(
        "H2D: host->device expert bytes, derived from the routing telemetry (see h2d_bytes_method in "
        f"{args.out}); for e, measured by the expert cache's own counters"
    )
    return 124 if args.interrupted else 0  # as timeout(1) says it: the table holds only the runs done


if __name__ == "__main__":
    sys.exit(main())
