"""Prefetch bandwidth of the expert pool vs a raw sequential read of the same bytes, cold page cache.

A MoE GGUF is generated (experts of 1 MiB per tensor by default) and a hot set of scattered experts
is chosen. Each trial first drops the file from the page cache (fsync + POSIX_FADV_DONTNEED, checked
with mincore), then one of:

  prefetch  ExpertPool.prefetch (madvise WILLNEED on every slice), timed until mincore says every
            byte of the hot set is resident;
  pin       ExpertPool.pin (madvise WILLNEED, then mlock, which returns once the pages are in);
  read      os.preadv of the same byte ranges in file order into one buffer (the baseline).

Methods alternate trial by trial so machine noise hits them alike; medians are compared.

    python bench/pool_prefetch.py [--trials 5] [--expert-mib 1] [--out bench/results/pool_prefetch.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

from moe_l2_cache.residency import ExpertPool
from moe_l2_gguf.index import ByteRange, ExpertIndex, load_index

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own modules
from harness.output import write_json

N_LAYER, N_EXPERT = 8, 32


def write_model(path: Path, expert_mib: float, seed: int) -> None:
    """gate/up/down expert tensors of `expert_mib` MiB per expert each (F16), plus a small rest."""
    n_embd = 1024
    n_ff = max(32, int(expert_mib * (1 << 20) / 2 / n_embd) // 32 * 32)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_block_count(N_LAYER)
    w.add_embedding_length(n_embd)
    w.add_expert_count(N_EXPERT)
    w.add_expert_used_count(4)
    w.add_tensor("token_embd.weight", rng.standard_normal((256, n_embd), dtype=np.float32))
    for layer in range(N_LAYER):
        w.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", rng.standard_normal((N_EXPERT, n_embd), dtype=np.float32))
        for kind, shape in (("gate", (n_ff, n_embd)), ("up", (n_ff, n_embd)), ("down", (n_embd, n_ff))):
            data = np.frombuffer(rng.bytes(N_EXPERT * shape[0] * shape[1] * 2), dtype=np.float16)
            w.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", data.reshape(N_EXPERT, *shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_ranges(path: Path, ranges: list[ByteRange]) -> int:
    buf = bytearray(max(r.length for r in ranges))
    view = memoryview(buf)
    done = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for r in sorted(ranges, key=lambda r: r.offset):
            done += os.preadv(fd, [view[: r.length]], r.offset)
    finally:
        os.close(fd)
    return done


def one_trial(method: str, index: ExpertIndex, hot: dict[int, list[int]]) -> tuple[float, float]:
    """Seconds until the hot set is resident, and the resident share before starting (coldness)."""
    experts = [(layer, e) for layer, ids in hot.items() for e in ids]
    pool = ExpertPool(index, budget_bytes=index.routed_bytes)  # room for everything: nothing is evicted
    try:
        drop_cache(index.path)
        before, total = pool.resident_bytes(experts)
        start = time.perf_counter()
        if method == "read":
            assert read_ranges(index.path, [r for x in experts for r in index.expert_ranges(*x)]) == total
        elif method == "pin":
            pool.pin(None, hot)
        else:
            pool.prefetch(hot)
            while pool.resident_bytes(experts)[0] < total:
                time.sleep(0.0005)
        seconds = time.perf_counter() - start
        if method != "read":
            assert pool.resident_bytes(experts)[0] == total
        return seconds, before / total
    finally:
        pool.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--expert-mib", type=float, default=1.0, help="MiB per expert per tensor (default 1)")
    parser.add_argument("--hot", type=int, default=12, help="hot experts per layer (default 12 of 32)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the model (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "pool_prefetch.json")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "bench-moe.gguf"
        print(f"writing {path} ...", file=sys.stderr, flush=True)
        write_model(path, args.expert_mib, seed=0)
        index = load_index(path)
        model_mib = round(path.stat().st_size / 2**20)
        rng = random.Random(0)
        hot = {layer: sorted(rng.sample(range(N_EXPERT), args.hot)) for layer in index.moe_layers}
        hot_bytes = sum(index.expert_bytes(layer) * len(ids) for layer, ids in hot.items())
        print(
            f"model {model_mib} MiB, hot set {sum(map(len, hot.values()))} experts "
            f"= {hot_bytes / 2**20:.0f} MiB in {3 * sum(map(len, hot.values()))} ranges",
            file=sys.stderr,
        )
        methods = ("prefetch", "read", "pin")
        seconds: dict[str, list[float]] = {m: [] for m in methods}
        coldness: list[float] = []
        for trial in range(args.trials):
            for method in methods if trial % 2 == 0 else tuple(reversed(methods)):
                s, before = one_trial(method, index, hot)
                seconds[method].append(s)
                coldness.append(before)
                print(f"  trial {trial} {method:<8} {hot_bytes / s / 2**20:8.0f} MiB/s", file=sys.stderr)

    bandwidth = {m: hot_bytes / statistics.median(v) / 2**20 for m, v in seconds.items()}
    result = {
        "bench": "pool_prefetch",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "model_mib": model_mib,
        "hot_set_mib": round(hot_bytes / 2**20, 1),
        "hot_experts": sum(map(len, hot.values())),
        "trials": args.trials,
        "max_resident_share_before_trial": max(coldness),
        "median_mib_per_s": {m: round(v, 1) for m, v in bandwidth.items()},
        "seconds": seconds,
        "ratio_prefetch_vs_read": round(bandwidth["prefetch"] / bandwidth["read"], 3),
        "ratio_pin_vs_read": round(bandwidth["pin"] / bandwidth["read"], 3),
        "target_ratio": 0.8,
    }
    write_json(args.out, result)
    print(
        f"prefetch {bandwidth['prefetch']:.0f} MiB/s, pin {bandwidth['pin']:.0f} MiB/s, sequential read "
        f"{bandwidth['read']:.0f} MiB/s: prefetch/read = {result['ratio_prefetch_vs_read']:.2f}, "
        f"pin/read = {result['ratio_pin_vs_read']:.2f} (target >= 0.8); cold before each trial: "
        f"<= {max(coldness):.1%} resident -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
