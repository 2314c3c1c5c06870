"""Tokens/s of the patched llama-server with routing telemetry on vs off, measured side by side.

Two servers run on the same generated MoE model, one with LLAMA_MOE_TELEMETRY=1 and one without;
requests alternate between them (only one generates at a time) so machine noise hits both alike.
Throughput comes from llama-server's own timings (decode and prompt processing), medians over runs.

    python bench/telemetry_overhead.py [--runs 10] [--tokens 128] [--out bench/results/telemetry_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from moe_l2_common.demo_model import DemoModelSpec, load_planted, make_demo_model
from moe_l2_common.supervisor import Supervisor, free_port
from moe_l2_llama.service import llama_service_spec
from moe_l2_llama.settings import LlamaSettings, llama_server_binary

MODELS = {
    # the model the tests use: tiny layers, so the per-layer cost of telemetry weighs most here
    "demo": DemoModelSpec(),
    # wider layers, closer to the per-token work of a real MoE (still far smaller than one)
    "wide": DemoModelSpec(n_embd=512, n_ff=256, n_head=8),
}


def start(supervisor: Supervisor, binary: Path, model: Path, name: str, telemetry: bool, threads: int) -> str:
    settings = LlamaSettings(llama_port=free_port(), parallel=1, ctx_size=2048, telemetry=telemetry, threads=threads)
    return supervisor.start(llama_service_spec(name, binary, model, settings)).spec.url


def one_run(client: httpx.Client, url: str, prompt: str, tokens: int) -> tuple[float, float]:
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "cache_prompt": False, "ignore_eos": True}
    timings = client.post(f"{url}/completion", json=body).raise_for_status().json()["timings"]
    return timings["predicted_per_second"], timings["prompt_per_second"]


def measure(binary: Path, model: Path, prompt: str, runs: int, tokens: int, threads: int, logs: Path) -> dict:
    supervisor = Supervisor(logs)
    try:
        urls = {
            "on": start(supervisor, binary, model, f"{model.stem}-on", True, threads),
            "off": start(supervisor, binary, model, f"{model.stem}-off", False, threads),
        }
        decode: dict[str, list[float]] = {"on": [], "off": []}
        prompt_tps: dict[str, list[float]] = {"on": [], "off": []}
        with httpx.Client(timeout=300) as client:
            for mode in ("on", "off"):  # warm-up
                one_run(client, urls[mode], prompt, 8)
            for i in range(runs):
                order = ("on", "off") if i % 2 == 0 else ("off", "on")
                for mode in order:
                    tg, pp = one_run(client, urls[mode], prompt, tokens)
                    decode[mode].append(tg)
                    prompt_tps[mode].append(pp)
    finally:
        supervisor.stop()
    med = {m: statistics.median(v) for m, v in decode.items()}
    med_pp = {m: statistics.median(v) for m, v in prompt_tps.items()}
    # Each on/off pair ran back to back: the median of the pairs' ratios cancels slow drifts of a
    # shared machine better than the ratio of the medians.
    return {
        "decode_tokens_per_s": {"on": med["on"], "off": med["off"], "runs": decode},
        "prompt_tokens_per_s": {"on": med_pp["on"], "off": med_pp["off"], "runs": prompt_tps},
        "decode_ratio_on_off": paired_ratio(decode),
        "prompt_ratio_on_off": paired_ratio(prompt_tps),
        "decode_ratio_of_medians": med["on"] / med["off"],
        "prompt_ratio_of_medians": med_pp["on"] / med_pp["off"],
    }


def paired_ratio(samples: dict[str, list[float]]) -> float:
    return statistics.median(on / off for on, off in zip(samples["on"], samples["off"], strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-words", type=int, default=400, help="prompt length (about one token per word)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--out", type=Path, default=Path("bench/results/telemetry_overhead.json"))
    args = parser.parse_args()

    binary = llama_server_binary(LlamaSettings())  # MOE_L2_LLAMA_SERVER, else the cached build
    results: dict = {
        "benchmark": "telemetry_overhead",
        "machine": {"cpu_count": __import__("os").cpu_count(), "platform": platform.platform()},
        "runs": args.runs,
        "tokens": args.tokens,
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model = Path(tmp) / f"{name}.gguf"
            make_demo_model(model, seed=0, spec=MODELS[name])
            words = load_planted(model)["domains"]["codegen"]["words"]
            prompt = " ".join(words[i % len(words)] for i in range(args.prompt_words))
            print(f"[{name}] {args.runs} interleaved runs of {args.tokens} tokens ...", file=sys.stderr, flush=True)
            res = measure(binary, model, prompt, args.runs, args.tokens, args.threads, Path(tmp) / "logs")
            res["model_bytes"] = model.stat().st_size
            results["models"][name] = res
            print(
                f"[{name}] decode tokens/s: on {res['decode_tokens_per_s']['on']:.1f}, "
                f"off {res['decode_tokens_per_s']['off']:.1f}, ratio on/off {res['decode_ratio_on_off']:.3f}; "
                f"prompt tokens/s ratio {res['prompt_ratio_on_off']:.3f}"
            )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
