"""Decode tokens/s of ggml's CPU code built for this CPU (native) against built for any x86-64 CPU
(portable), with the experts on the CPU (--cpu-moe), on the CPU build of llama-server.

With `--cpu-moe` the CPU computes every routed expert, on a GPU build too, and that CPU code is the
same in the CPU build: measuring the CPU build measures what a local CUDA or Vulkan build gains from
`GGML_NATIVE=ON` over the images' `--portable` (llama.cpp's x86-64 baseline: AVX2, FMA, F16C, no
AVX-512, VNNI or AMX). Both builds are made from the same source and patches (`moe-l2 build-llama`
and `moe-l2 build-llama --portable`, cached), or given with --native / --portable.

Both servers run on the same model; requests alternate between them, one generating at a time, the
order swapped every run, so machine noise hits both alike; the figure is the median of the per-run
ratios native/portable. Each server's `system_info` line (the instruction sets its CPU code uses) is
kept in the JSON.

    python bench/native_cpu.py [--models demo,ds-v2-lite-3] [--runs 11] [--tokens 128] [--threads N]
        [--native PATH] [--portable PATH] [--out bench/results/native_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from moe_l2_gguf.demo_model import DemoModelSpec, load_planted, make_demo_model
from moe_l2_gguf.model_shapes import get_shape, write_shape_model
from moe_l2_llama.build import BuildConfig, build, cpu_isa
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.llama_service import llama_service_spec
from moe_l2_ops.supervisor import Supervisor, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own modules
from harness.output import write_json
from harness.timing import paired_ratio

BUILDS = ("native", "portable")
PROMPT_WORDS = 32  # decode is the question: a short prompt keeps each run's prefill small


def demo_model(path: Path) -> str:
    """The demo model (F16 experts, 8 layers x 32 experts of 64 x 64) and a prompt of its words."""
    make_demo_model(path, seed=0, spec=DemoModelSpec())
    words = load_planted(path)["domains"]["codegen"]["words"]
    return " ".join(words[i % len(words)] for i in range(PROMPT_WORDS))


def ds_v2_lite_3(path: Path) -> str:
    """DeepSeek-V2-Lite's layer shapes, 3 layers (Q4_K experts, Q8_0 elsewhere): quantized dot products."""
    write_shape_model(path, get_shape("ds-v2-lite").reduced(3, 8192), seed=0, progress=False)
    return " ".join(f"word{i}" for i in range(PROMPT_WORDS))


MODELS: dict[str, Callable[[Path], str]] = {"demo": demo_model, "ds-v2-lite-3": ds_v2_lite_3}


def binaries(args: argparse.Namespace) -> dict[str, Path]:
    """The two builds: given, else built (or found in the cache) from the same source and patches."""
    found = {}
    for name in BUILDS:
        given: Path | None = getattr(args, name)
        if given is not None:
            if not given.is_file():
                raise SystemExit(f"error: --{name} {given} does not exist")
            found[name] = given
        else:
            found[name] = build(BuildConfig(native=name == "native"))
    return found


def system_info(binary: Path, model: Path, timeout_s: float = 60.0) -> str:
    """llama-server's `system_info: ...` line (the instruction sets its CPU backend was built with),
    which it logs only at -lv 4: read from a start of its own, so the measured servers log as usual."""
    cmd = [str(binary), "--model", str(model), "--port", str(free_port()), "-t", "1", "-lv", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found = ""
    try:
        deadline = time.monotonic() + timeout_s
        assert proc.stdout is not None
        for line in proc.stdout:
            if "system_info:" in line:
                found = line.split("system_info:", 1)[1].strip()
                break
            if time.monotonic() > deadline:
                break
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return found


def one_run(client: httpx.Client, url: str, prompt: str, tokens: int) -> tuple[float, float]:
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "cache_prompt": False, "ignore_eos": True}
    timings = client.post(f"{url}/completion", json=body).raise_for_status().json()["timings"]
    return timings["predicted_per_second"], timings["prompt_per_second"]


def measure(bins: dict[str, Path], model: Path, prompt: str, args: argparse.Namespace, logs: Path) -> dict:
    supervisor = Supervisor(logs)
    try:
        urls = {}
        for name, binary in bins.items():
            settings = LlamaSettings(
                port=free_port(), parallel=1, ctx_size=2048, threads=args.threads, cpu_moe=True, backend="cpu"
            )
            spec = llama_service_spec(f"{model.stem}-{name}", binary, model, settings)
            urls[name] = supervisor.start(spec).spec.url
        decode: dict[str, list[float]] = {name: [] for name in bins}
        prompt_tps: dict[str, list[float]] = {name: [] for name in bins}
        with httpx.Client(timeout=900) as client:
            for url in urls.values():  # warm-up: pages in, first-call allocations
                one_run(client, url, prompt, 8)
            for i in range(args.runs):
                for name in BUILDS if i % 2 == 0 else tuple(reversed(BUILDS)):
                    tg, pp = one_run(client, urls[name], prompt, args.tokens)
                    decode[name].append(tg)
                    prompt_tps[name].append(pp)
                print(
                    f"  run {i + 1}/{args.runs}: " + ", ".join(f"{n} {decode[n][-1]:.1f}" for n in BUILDS),
                    file=sys.stderr,
                )
    finally:
        supervisor.stop()
    return {
        "decode_tokens_per_s": {name: statistics.median(v) for name, v in decode.items()},
        "prompt_tokens_per_s": {name: statistics.median(v) for name, v in prompt_tps.items()},
        "decode_ratio_native_portable": paired_ratio(decode["native"], decode["portable"]),
        "prompt_ratio_native_portable": paired_ratio(prompt_tps["native"], prompt_tps["portable"]),
        "runs": {"decode": decode, "prompt": prompt_tps},
    }


def build_facts(binary: Path) -> dict:
    """Where the binary is, and what its build-info.json (next to a cached build) says about GGML_NATIVE."""
    facts: dict = {"path": str(binary)}
    try:
        info = json.loads((binary.parent.parent / "build-info.json").read_text())
        facts["key"] = info.get("key")
        facts["ggml_native"] = next((f for f in info.get("cmake_flags", []) if f.startswith("-DGGML_NATIVE=")), None)
        facts["cmake_flags"] = info.get("cmake_flags")
        facts["patches"] = sorted(info.get("patches", {}))
    except (OSError, ValueError):
        pass
    return facts


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return m.group(1).strip() if m else platform.processor()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,ds-v2-lite-3", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--runs", type=int, default=11, help="interleaved runs per build (odd: a clean median)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens decoded per run")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server -t (default: all)")
    parser.add_argument("--native", type=Path, help="a native llama-server (default: `moe-l2 build-llama`)")
    parser.add_argument("--portable", type=Path, help="a portable one (default: `moe-l2 build-llama --portable`)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/native_cpu.json"))
    args = parser.parse_args()
    # a timeout's SIGTERM unwinds through measure()'s finally, which stops the servers it started
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}: choose from {sorted(MODELS)}")

    bins = binaries(args)
    results: dict = {
        "benchmark": "native_cpu",
        "question": "decode with --cpu-moe: ggml's CPU code native (GGML_NATIVE=ON) over portable (OFF)",
        "machine": {
            "cpu": cpu_model(),
            "isa": cpu_isa(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_before": os.getloadavg(),
        },
        "runs": args.runs,
        "tokens": args.tokens,
        "threads": args.threads,
        "binaries": {name: build_facts(path) for name, path in bins.items()},
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model = Path(tmp) / f"{name}.gguf"
            prompt = MODELS[name](model)
            if "system_info" not in results:
                results["system_info"] = {b: system_info(path, model) for b, path in bins.items()}
            print(
                f"[{name}] {args.runs} interleaved runs of {args.tokens} tokens, native and portable ...",
                file=sys.stderr,
            )
            res = measure(bins, model, prompt, args, Path(tmp) / "logs")
            res["model_bytes"] = model.stat().st_size
            results["models"][name] = res
            tps = res["decode_tokens_per_s"]
            print(
                f"[{name}] decode tokens/s native {tps['native']:.1f}, portable {tps['portable']:.1f}: "
                f"ratio native/portable {res['decode_ratio_native_portable']:.3f} "
                f"(prompt {res['prompt_ratio_native_portable']:.3f})"
            )
    results["machine"]["load_avg_after"] = os.getloadavg()
    write_json(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
