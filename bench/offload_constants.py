"""The cost model's constants beside a run (bench/placement_model.py reads them): those bench/gpu_facts.py measures
(--constants), those the runs themselves give (CPU expert GB/s from b, GPU time per token from a), and on CUDA
the copy rate from the mapped model file itself."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from harness.servers import BenchError
from offload_configs import ExpertLayout


def derived_constants(rows: Mapping[str, dict], layout: ExpertLayout) -> dict:
    """Constants of the cost model (issue 32) that the runs themselves measure.

    CPU expert GB/s: a decode step of b (--cpu-moe) reads top-k experts per MoE layer from host memory
    on the CPU threads; bytes per token / seconds per token. `raw` divides by the whole step, `net`
    by the step less a's (all on the device: the non-expert work b's step also does on the GPU), which
    bounds the CPU's share from above: a's step also holds the experts' own GPU time.
    GPU time per token: a's decode step; per activated expert, that step over the activations, an
    upper bound (it holds the attention and the rest too).
    """
    per_token = sum(layout.expert_bytes.values()) * layout.n_expert_used  # every MoE layer's top-k experts
    activations = len(layout.expert_bytes) * layout.n_expert_used
    out: dict = {"expert_bytes_read_per_token": per_token, "activations_per_token": activations}
    a = (rows.get("a") or {}).get("decode_tokens_per_s")
    if a:
        out["gpu_ms_per_token"] = 1e3 / a
        out["gpu_ms_per_activation_upper_bound"] = 1e3 / a / activations
    for key in ("b", "bp"):
        tps = (rows.get(key) or {}).get("decode_tokens_per_s")
        if not tps:
            continue
        step = 1 / tps
        entry = {"raw_gbps": per_token / step / 1e9, "step_ms": step * 1e3}
        if a and step > 1 / a:
            entry["net_of_a_gbps"] = per_token / (step - 1 / a) / 1e9
        out[f"cpu_expert_{key}"] = entry
    return out


def load_constants(args: argparse.Namespace) -> dict | str | None:
    """--constants: a JSON file of bench/gpu_facts.py, `measure` (run it now, before any server holds
    the device), or `none`."""
    if args.constants == "none":
        return None
    if args.constants == "measure":
        from gpu_facts import DS_V2_LITE_EXPERT_BYTES, constants

        return constants(DS_V2_LITE_EXPERT_BYTES)
    path = Path(args.constants)
    if not path.is_file():
        raise BenchError(f"--constants {path} does not exist")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise BenchError(f"--constants {path} is not JSON: {exc}") from exc


# Run in a child process, so that no CUDA context stays in the bench's (it would hold device memory the
# fit check does not count). Standard library, numpy and torch; prints one JSON object.
MAPPED_H2D_SCRIPT = """
import json, sys, time
import numpy as np
path, size = sys.argv[1], int(sys.argv[2])
try:
    import torch
except ImportError as exc:
    print(json.dumps({"skipped": f"torch does not import: {exc}"})); sys.exit()
if not torch.cuda.is_available():
    print(json.dumps({"skipped": "torch sees no CUDA device"})); sys.exit()
m = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: writable for torch, pages still the mapping's
n = min(size, m.size)
src = torch.from_numpy(m[m.size - n:])  # the file's end: expert tensors, as llama.cpp maps them
dst = torch.empty(n, dtype=torch.uint8, device="cuda")
dst.copy_(src); torch.cuda.synchronize()  # the first copy faults the pages in
times = []
for _ in range(3):
    t0 = time.perf_counter(); dst.copy_(src); torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
times.sort()
print(json.dumps({"mapped_512MiB_gbps": round(n / times[1] / 1e9, 2), "bytes": n, "ms": round(times[1] * 1e3, 2)}))
"""


def mapped_h2d(model: Path, size: int = 512 << 20, timeout_s: float = 120.0) -> dict:
    """Host->device GB/s from the mapped model file itself (torch, in a child process): the rate a miss of a
    mapped model is copied at. On the H200 of 2026-12-04 the mapped rows copied at about 0.85x torch's
    pageable rate (an anonymous buffer: bench/placement_model.py's MAPPED_FACTOR), so it is measured, not
    assumed. {"skipped": why} without torch or a CUDA device."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", MAPPED_H2D_SCRIPT, str(model), str(size)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"skipped": f"the measurement did not finish: {exc}"}
    lines = out.stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if lines else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        why = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"skipped": f"exit {out.returncode}: {why[:200]}"}
    return doc
