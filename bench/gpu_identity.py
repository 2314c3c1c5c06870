"""Greedy identity on the device: the text that copy-used (d) and the expert cache (e) generate at
temperature 0 against all-on-device (a), with the model's own router, pinned and mmap'd host memory.

    python bench/gpu_identity.py --binary PATH --model M.gguf [--backend cuda] [--slots 7,32]
        [--load-modes none,mmap] [--prompts 6] [--tokens 48] [--out identity.json]

One server per row, all started and queried at once (their speed is not measured, only their text):
  a              -ngl 99, every expert on the device: the reference
  d-<mode>       --cpu-moe, GGML_OP_OFFLOAD_MIN_BATCH=1, --load-mode <mode>
  e<S>-<mode>    --cpu-moe --moe-cache-bytes S slots per MoE layer, --load-mode <mode>
`none` is llama.cpp's load mode without mmap (host-resident experts in the pinned host buffer), `mmap`
the mapped file. The JSON has the shape of `bench/data/gpu-2026-12-04/identity.json` (runs: argv,
env, outputs, decode_tps, seconds, equal_to_a per prompt) plus the prompts and one verdict. On the
H200 (2026-12-04) 36 of 36 outputs were identical, mmap and pinned together; a difference would be a
wrong expert in a slot, which a correct cache never produces (the same weights, the same kernels).
Exit 0 when every output equals a's, 1 when one differs, 2 on bad input, 124 when SIGTERM cut it.
"""

from __future__ import annotations

import argparse
import copy
import os
import secrets
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

# bench/ is not a package: expert_offload's modules by path (its configs and servers), the shared harness
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.output import write_json
from harness.prompts import make_prompt
from harness.servers import Interrupted, on_sigterm
from offload_configs import BACKENDS, CONFIGS, Config, ExpertLayout, cache_patch_present
from offload_servers import start_server

from moe_l2_gguf.index import GGUFIndexError, load_index
from moe_l2_llama.cpu_features import cpu_has_amx
from moe_l2_ops.supervisor import Supervisor, SupervisorError

LOAD_MODE_NAMES = {"none": "pinned", "mmap": "mmap"}


def plan_rows(slots: list[int], load_modes: list[str]) -> list[tuple[Config, int]]:
    """(config, slots per layer or 0) of every row, a first."""
    rows: list[tuple[Config, int]] = [(CONFIGS["a"], 0)]
    for mode in load_modes:
        label = LOAD_MODE_NAMES.get(mode, mode)
        d = CONFIGS["d"]
        rows.append((Config(f"d-{label}", f"{d.name} {label}", d.what, "d", mode), 0))
    for n in slots:
        for mode in load_modes:
            label = LOAD_MODE_NAMES.get(mode, mode)
            what = f"-ngl 99 --cpu-moe --moe-cache-bytes ({n} slots per MoE layer) --load-mode {mode}"
            rows.append((Config(f"e{n}-{label}", f"expert-cache {n} slots {label}", what, "e", mode), n))
    return rows


def generate(url: str, prompt: str, tokens: int, timeout_s: float) -> tuple[str, float]:
    """(the text, decode tok/s) of one greedy completion; no prompt cache, so each is from scratch."""
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "cache_prompt": False, "ignore_eos": True}
    resp = httpx.post(f"{url}/completion", json=body, timeout=timeout_s).raise_for_status().json()
    return resp["content"], resp["timings"]["predicted_per_second"]


def compare(outputs: dict[str, list[str]], reference: str = "a") -> dict[str, list[bool]]:
    """equal_to_a per prompt for every row but the reference; a row cut short compares its prompts only."""
    ref = outputs[reference]
    return {k: [o == r for o, r in zip(v, ref, strict=False)] for k, v in outputs.items() if k != reference}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, default="cuda")
    parser.add_argument("--binary", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--slots", default="7,32", help="expert-cache slots per MoE layer, comma-separated")
    parser.add_argument("--load-modes", default="none,mmap", help="llama.cpp --load-mode of d and e rows")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-words", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--ubatch", type=int, default=512)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument(
        "--no-repack",
        action="store_true",
        help="never repack the host's weights: the expert cache cannot read repacked experts (gpt-oss's MXFP4)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_identity.json"))
    parser.add_argument("--log-dir", type=Path, help="the server logs (default: <out>-logs beside the JSON)")
    args = parser.parse_args(argv)
    try:
        args.slot_list = [int(x) for x in args.slots.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--slots {args.slots!r} is not a list of numbers")
    args.mode_list = [m.strip() for m in args.load_modes.split(",") if m.strip()]
    if any(n < 1 for n in args.slot_list) or args.prompts < 1 or args.tokens < 1:
        parser.error("--slots, --prompts and --tokens must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, on_sigterm)
    if not args.binary.is_file() or not args.model.is_file():
        print(f"error: --binary {args.binary} and --model {args.model} must exist", file=sys.stderr)
        return 2
    try:
        layout = ExpertLayout.from_index(load_index(args.model))
    except GGUFIndexError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    slot_bytes = max(layout.expert_bytes.values())
    # what start_server reads of the benchmark's arguments: no trace (the model's own router), no tags
    base = argparse.Namespace(
        ubatch=args.ubatch, backend=args.backend, trace_file=None, seq_tags=None, ctx=args.ctx,
        threads=args.threads, no_repack=args.no_repack or cpu_has_amx(), start_timeout=args.start_timeout,
        cache_log_dir=None, e_bytes=0, rpc_threads=2,
    )  # fmt: skip
    token = secrets.token_hex(16)
    prompts = [make_prompt(i, args.prompt_words) for i in range(args.prompts)]
    rows = plan_rows(args.slot_list, args.mode_list)
    if not cache_patch_present(args.binary):
        rows = [(c, n) for c, n in rows if c.base != "e"]
    log_dir = args.log_dir or args.out.parent / f"{args.out.stem}-logs"
    supervisor = Supervisor(log_dir)
    runs: dict[str, dict] = {}
    interrupted = False
    t_start = time.monotonic()

    def one(row: tuple[Config, int]) -> None:
        config, n = row
        ns = copy.copy(base)
        ns.e_bytes = n * slot_bytes * len(layout.expert_bytes)
        t0 = time.monotonic()
        s = start_server(supervisor, args.binary, args.model, config, layout, layout.n_layer, 0, ns, token)
        entry = runs[config.key] = {"argv": s.args, "env": s.env, "outputs": [], "decode_tps": []}
        entry["start_seconds"] = round(time.monotonic() - t0, 1)
        t1 = time.monotonic()
        for prompt in prompts:
            text, tps = generate(s.url, prompt, args.tokens, args.request_timeout)
            entry["outputs"].append(text)
            entry["decode_tps"].append(tps)
        entry["seconds"] = round(time.monotonic() - t1, 1)
        print(f"  {config.key}: {len(prompts)} outputs in {entry['seconds']:.0f}s", file=sys.stderr, flush=True)

    errors: dict[str, str] = {}
    pool = ThreadPoolExecutor(len(rows))
    try:
        futures = {pool.submit(one, row): row[0].key for row in rows}
        for future, key in futures.items():
            try:
                future.result()
            except (SupervisorError, httpx.HTTPError) as exc:
                errors[key] = str(exc).splitlines()[0]
    except (Interrupted, KeyboardInterrupt):
        interrupted = True
    finally:
        supervisor.stop()  # first: a request waiting on a stopped server fails at once, its thread ends
        pool.shutdown(wait=True, cancel_futures=True)
    for key, why in errors.items():
        runs.setdefault(key, {})["error"] = why
    outputs = {k: v["outputs"] for k, v in runs.items() if v.get("outputs")}
    equal = compare(outputs) if "a" in outputs else {}
    for key, flags in equal.items():
        runs[key]["equal_to_a"] = flags
    compared = sum(len(f) for f in equal.values())
    same = sum(sum(f) for f in equal.values())
    doc = {
        "benchmark": "gpu_identity",
        "backend": args.backend,
        "model": str(args.model),
        "slot_bytes": slot_bytes,
        "moe_layers": len(layout.expert_bytes),
        "n_predict": args.tokens,
        "routing": "the model's own router (no route trace)",
        "prompts": prompts,
        "runs": runs,
        "identical": f"{same} of {compared}",
        "interrupted": interrupted,
        "seconds": round(time.monotonic() - t_start, 1),
    }
    write_json(args.out, doc)
    for key, flags in equal.items():
        print(f"{key}: {sum(flags)}/{len(flags)} outputs equal to a's")
    print(f"greedy identity: {same} of {compared} outputs equal to a's; errors: {errors or 'none'}")
    if interrupted:
        return 124
    return 0 if same == compared and compared and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
