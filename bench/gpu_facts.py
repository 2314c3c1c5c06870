"""The machine's constants for the placement cost model (issue 32), and one read of the cache-manager's
GPU gauges against nvidia-smi, for `make bench-gpu`.

    python bench/gpu_facts.py constants [--expert-bytes 4866048] [--out constants.json]
    python bench/gpu_facts.py gauges [--out gauges.json]

`constants`: host→device copy rates, pinned and pageable, at 512 MiB and at one expert's bytes,
through torch where it imports and sees a CUDA device (else each rate is None with the reason); the
GPU's name and PCIe link (nvidia-smi); the CPU's model and core count. The H200 of 2026-12-04 copied
pageable memory at 9.8 GB/s and pinned at 55.3 GB/s (512 MiB), and one 4.87 MB expert at 16.6 and
49.8 GB/s (`bench/data/gpu-2026-12-04/h2d.txt`): a 3-6x spread that decides whether the expert
cache wins, so the figures are measured on every machine, not assumed.

`gauges`: what moe_l2_cache.gpu (nvidia-ml-py, the cache-manager's /metrics and the dashboard's GPU
panels) reads, beside nvidia-smi's own memory.used/memory.total/utilization.gpu, at the same moment.
The gauges had never run on a GPU before this check.

Standard library only at import time (torch, pynvml and moe_l2_cache are imported inside the
functions), so a bare interpreter can run it and say what is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own modules
from harness.output import meminfo_bytes

DS_V2_LITE_EXPERT_BYTES = 4_866_048  # gate + up (Q4_K) + down (Q4_0) of one ds-v2-lite expert
BIG_COPY_BYTES = 512 << 20  # the size h2d.txt was measured at: long enough that launch costs vanish
SMI_FIELDS = (
    "name",
    "memory.total",
    "pcie.link.gen.current",
    "pcie.link.gen.max",
    "pcie.link.width.current",
    "pcie.link.width.max",
    "driver_version",
    "compute_cap",
)


def nvidia_smi(fields: tuple[str, ...] | list[str], timeout_s: float = 20.0) -> dict[str, str] | str:
    """GPU 0's `fields` from nvidia-smi, or a one-line reason why not."""
    if not shutil.which("nvidia-smi"):
        return "no nvidia-smi on PATH"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi failed: {exc}"
    if out.returncode != 0:
        return f"nvidia-smi exit {out.returncode}: {(out.stderr or out.stdout).strip()[:200]}"
    return parse_smi_csv(out.stdout, fields)


def parse_smi_csv(text: str, fields: tuple[str, ...] | list[str]) -> dict[str, str]:
    """The first row of `nvidia-smi --format=csv,noheader` as {field: value}; GPU names hold no commas."""
    row = [v.strip() for v in text.strip().splitlines()[0].split(",")]
    return dict(zip(fields, row, strict=False))


def cpu_facts() -> dict:
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "model": model,
        "cpu_count": os.cpu_count(),
        "usable_cpus": affinity,
        "platform": platform.platform(),
        "meminfo": meminfo(),
    }


def meminfo() -> dict[str, int]:
    """MemTotal and MemAvailable in bytes: the engine pins the experts only when the model and a margin fit
    in MemAvailable (patch 0018), and a lent machine's memory may start small and grow as it is used."""
    figures = {key: meminfo_bytes(key) for key in ("MemTotal", "MemAvailable")}
    return {key: value for key, value in figures.items() if value}


def gbps(n_bytes: int, seconds: float) -> float:
    return n_bytes / seconds / 1e9


def h2d_rates(expert_bytes: int, big_bytes: int = BIG_COPY_BYTES) -> dict:
    """Host→device GB/s through torch: pinned and pageable sources, one big copy and one expert.

    Each figure is the median of several timed copies after a warm-up (the first copy of a pageable
    buffer also faults its pages in). Pageable copies go through the driver's own staging buffer,
    which is what a copy from llama.cpp's mmap'd model does; pinned ones are direct DMA.
    """
    try:
        import torch
    except ImportError as exc:
        return {"skipped": f"torch does not import: {exc}"}
    if not torch.cuda.is_available():
        return {"skipped": "torch sees no CUDA device"}
    dev = torch.device("cuda", 0)
    result: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    for label, n_bytes, reps in (("512MiB", big_bytes, 5), ("expert", expert_bytes, 50)):
        dst = torch.empty(n_bytes, dtype=torch.uint8, device=dev)
        for kind in ("pageable", "pinned"):
            src = torch.ones(n_bytes, dtype=torch.uint8, pin_memory=kind == "pinned")
            dst.copy_(src, non_blocking=False)  # warm-up: page faults, the driver's staging
            torch.cuda.synchronize()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=kind == "pinned")
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            times.sort()
            best, med = times[0], times[len(times) // 2]
            result[f"{kind}_{label}_gbps"] = round(gbps(n_bytes, med), 2)
            result[f"{kind}_{label}_best_gbps"] = round(gbps(n_bytes, best), 2)
            result[f"{kind}_{label}_ms"] = round(med * 1e3, 4)
            del src
        del dst
    result["bytes"] = {"512MiB": big_bytes, "expert": expert_bytes}
    torch.cuda.empty_cache()
    return result


def constants(expert_bytes: int) -> dict:
    t0 = time.monotonic()
    smi = nvidia_smi(SMI_FIELDS)
    out = {
        "gpu": smi,
        "cpu": cpu_facts(),
        "h2d": h2d_rates(expert_bytes),
        "expert_bytes": expert_bytes,
    }
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def gauges() -> dict:
    """moe_l2_cache.gpu's read and nvidia-smi's, one right after the other."""
    t = time.time()
    smi_fields = ("memory.used", "memory.total", "utilization.gpu")
    try:
        from moe_l2_cache.gpu import nvml_report

        report = nvml_report()
        nvml: dict | str
        if report is None:
            nvml = "nvml_report() is None: no nvidia-ml-py, no driver or no GPU"
        else:
            nvml = {
                "driver_version": report.driver_version,
                "cuda_version": report.cuda_version,
                "gpus": [g.__dict__ for g in report.gpus],
            }
    except ImportError as exc:
        nvml = f"moe_l2_cache.gpu does not import: {exc}"
    smi = nvidia_smi(smi_fields)
    return {"time": t, "moe_l2_cache_gpu": nvml, "nvidia_smi": smi, "compare": compare_gauges(nvml, smi)}


def _mib(text: str) -> int | None:
    """'1234 MiB' -> bytes."""
    try:
        value, unit = text.split()
    except ValueError:
        return None
    return int(float(value) * (1 << 20)) if unit == "MiB" else None


def compare_gauges(nvml: dict | str, smi: dict | str) -> dict | str:
    """The two reads side by side in bytes and percent; nvidia-smi prints MiB, so a difference under
    1 MiB is its rounding, and used memory moves between the two reads by what a server allocates."""
    if not isinstance(nvml, dict) or not isinstance(smi, dict) or not nvml.get("gpus"):
        return "not both read"
    gpu = nvml["gpus"][0]
    util = smi.get("utilization.gpu", "").replace("%", "").strip()
    used, total = _mib(smi.get("memory.used", "")), _mib(smi.get("memory.total", ""))
    return {
        "memory_used_bytes": {"nvml": gpu["memory_used_bytes"], "nvidia_smi": used},
        "memory_total_bytes": {"nvml": gpu["memory_total_bytes"], "nvidia_smi": total},
        "utilization": {"nvml": gpu["utilization_ratio"], "nvidia_smi": float(util) / 100 if util else None},
        "used_diff_mib": None if used is None else round((gpu["memory_used_bytes"] - used) / (1 << 20), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("constants", "gauges"))
    parser.add_argument("--expert-bytes", type=int, default=DS_V2_LITE_EXPERT_BYTES)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    doc = constants(args.expert_bytes) if args.what == "constants" else gauges()
    text = json.dumps(doc, indent=2)
    if not args.out:
        print(text)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    if args.what == "gauges":
        print(f"gauges -> {args.out}: {doc['compare']}")
        return 0
    h2d = doc["h2d"]
    rates = h2d if "skipped" in h2d else {k: v for k, v in h2d.items() if k.endswith("_gbps") and "best" not in k}
    print(f"constants -> {args.out}: gpu {doc['gpu']}; h2d {rates}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
