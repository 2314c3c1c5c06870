"""Tokens/s of the patched llama-server with routing telemetry on vs off, while the flywheel pulls.

Two servers run on the same generated MoE model, one with --moe-telemetry and one without;
requests alternate between them (only one generates at a time) so machine noise hits both alike.
All along, a puller plays the cache-manager's flywheel: `GET /moe/routing?reset=1` with the admin
token on every telemetry server, once per `--pull-interval` seconds. A pull must never hold up the
compute thread, which takes the counters' lock at every MoE layer; on a model of many layers and
experts a pull that serialised under that lock would show here as lost decode speed. Requests
rotate over the default domain tags, so the counters hold several tags, as in production.

Noise control, measured (2026-12-02, 2 cores): unpinned, two identical servers differed by up to 4% over
31 runs, as much as the effect to be shown. So by default (`--pin`, machines with 2+ CPUs) every server
runs on CPU 0 and this process (client and puller) on the others, and `--control` adds a second server
with telemetry off per binary: its ratio to the first ("off/off") is the noise floor of the figures.

With `--baseline BINARY` a second build (e.g. the one before a change) runs in the same loop, on
and off, so before and after are measured side by side on the same machine state; the paired ratio
current/baseline with telemetry off is what the current build's other changes cost when they are off
(the expert cache: `moe-l2 build-llama --patches-dir` a folder of the patches before it). Throughput
comes from llama-server's own timings (decode and prompt processing), medians over runs.

    python bench/telemetry_overhead.py [--models demo,wide,large] [--runs 21] [--tokens 256]
        [--pull-interval 1] [--baseline PATH] [--no-pin] [--control]
        [--out bench/results/telemetry_overhead.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from moe_l2_contracts.admin import ADMIN_TOKEN_HEADER
from moe_l2_contracts.domains import DEFAULT_DOMAINS
from moe_l2_gguf.demo_model import DemoModelSpec, load_planted, make_demo_model
from moe_l2_llama.serving_plan import llama_server_binary
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.llama_service import llama_service_spec
from moe_l2_ops.supervisor import Supervisor, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own modules
from harness.output import machine, write_json
from harness.timing import paired_ratio

MODELS = {
    # the model the tests use: tiny layers, so the per-layer cost of telemetry weighs most here
    "demo": DemoModelSpec(),
    # wider layers, closer to the per-token work of a real MoE (still far smaller than one)
    "wide": DemoModelSpec(n_embd=512, n_ff=256, n_head=8),
    # the layer and expert counts of a large MoE (Qwen3-30B-A3B has 48 x 128, top-8): what a pull
    # has to go through grows with layers x experts x tags
    "large": DemoModelSpec(n_layer=48, n_expert=128, n_expert_used=8, n_planted=16),
    # DeepSeek-V3's routed experts (61 layers x 256, top-8): about a million cells with 64 tags
    "deepseek": DemoModelSpec(n_layer=61, n_expert=256, n_expert_used=8, n_planted=32),
}


@dataclass
class Server:
    label: str  # "<binary>-<on|off>"
    url: str
    telemetry: bool


@dataclass
class Puller:
    """The flywheel's pull loop, in a thread: reset=1 on every telemetry server each interval."""

    urls: dict[str, str]
    token: str
    interval_s: float
    latencies_ms: dict[str, list[float]] = field(default_factory=dict)
    sizes: dict[str, list[int]] = field(default_factory=dict)
    failures: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.urls:
            self.latencies_ms[name], self.sizes[name], self.failures[name] = [], [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="puller", daemon=True)

    def start(self) -> None:
        if self.urls and self.interval_s > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        with httpx.Client(timeout=60, headers={ADMIN_TOKEN_HEADER: self.token}) as client:
            next_at = time.monotonic()
            while not self._stop.wait(max(0.0, next_at - time.monotonic())):
                for name, url in self.urls.items():
                    t0 = time.perf_counter()
                    try:
                        resp = client.get(f"{url}/moe/routing", params={"reset": "1"})
                    except httpx.HTTPError as exc:
                        self.failures[name].append(repr(exc))
                        continue
                    if resp.status_code != 200:
                        self.failures[name].append(f"{resp.status_code} {resp.text[:200]}")
                        continue
                    self.latencies_ms[name].append((time.perf_counter() - t0) * 1000)
                    self.sizes[name].append(len(resp.content))
                next_at += self.interval_s

    def summary(self, name: str) -> dict:
        lat = sorted(self.latencies_ms[name])
        return {
            "pulls": len(lat),
            "failures": len(self.failures[name]),
            "first_failure": self.failures[name][0] if self.failures[name] else None,
            "latency_ms_p50": statistics.median(lat) if lat else None,
            "latency_ms_p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
            "latency_ms_max": lat[-1] if lat else None,
            "bytes_median": statistics.median(self.sizes[name]) if self.sizes[name] else None,
        }


SERVER_CPUS = {0}


def pin_self_off_the_servers() -> None:
    """This process (client, puller) leaves CPU 0 to the servers, so its work never preempts a decode."""
    others = set(os.sched_getaffinity(0)) - SERVER_CPUS
    if others:
        os.sched_setaffinity(0, others)


def start(
    supervisor: Supervisor,
    binary: Path,
    model: Path,
    label: str,
    telemetry: bool,
    threads: int,
    token: str,
    pin: bool,
) -> Server:
    settings = LlamaSettings(
        port=free_port(), parallel=1, ctx_size=2048, telemetry=telemetry, threads=threads, admin_token=token
    )
    spec = llama_service_spec(f"{model.stem}-{label}", binary, model, settings)
    if pin:
        cpus = ",".join(str(c) for c in sorted(SERVER_CPUS))
        spec = dataclasses.replace(spec, argv=["taskset", "-c", cpus, *spec.argv])
    url = supervisor.start(spec).spec.url
    return Server(label=label, url=url, telemetry=telemetry)


def one_run(client: httpx.Client, url: str, prompt: str, tokens: int, tag: str) -> tuple[float, float]:
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "cache_prompt": False, "ignore_eos": True}
    resp = client.post(f"{url}/completion", json=body, headers={"X-MoE-Domain": tag})
    timings = resp.raise_for_status().json()["timings"]
    return timings["predicted_per_second"], timings["prompt_per_second"]


def measure(
    binaries: dict[str, Path],
    model: Path,
    prompts: dict[str, str],
    args: argparse.Namespace,
    logs: Path,
) -> dict:
    token = secrets.token_hex(16)
    supervisor = Supervisor(logs)
    puller: Puller | None = None
    try:
        modes = ("on", "off", "off2") if args.control else ("on", "off")
        servers = [
            start(supervisor, binary, model, f"{name}-{mode}", mode == "on", args.threads, token, args.pin)
            for name, binary in binaries.items()
            for mode in modes
        ]
        decode: dict[str, list[float]] = {s.label: [] for s in servers}
        prompt_tps: dict[str, list[float]] = {s.label: [] for s in servers}
        tags = list(DEFAULT_DOMAINS)
        with httpx.Client(timeout=600) as client:
            for s in servers:  # warm-up
                one_run(client, s.url, prompts[tags[0]], 8, tags[0])
            puller = Puller({s.label: s.url for s in servers if s.telemetry}, token, args.pull_interval)
            puller.start()
            for i in range(args.runs):
                tag = tags[i % len(tags)]
                # every server in turn, the order rotated each run so none always follows the same one
                for s in servers[i % len(servers) :] + servers[: i % len(servers)]:
                    tg, pp = one_run(client, s.url, prompts[tag], args.tokens, tag)
                    decode[s.label].append(tg)
                    prompt_tps[s.label].append(pp)
        puller.stop()
    finally:
        if puller is not None:
            puller.stop()
        supervisor.stop()

    results = {}
    for name in binaries:
        on, off = f"{name}-on", f"{name}-off"
        pair = {"on": decode[on], "off": decode[off]}
        pair_pp = {"on": prompt_tps[on], "off": prompt_tps[off]}
        results[name] = {
            "decode_tokens_per_s": {
                "on": statistics.median(pair["on"]),
                "off": statistics.median(pair["off"]),
                "runs": pair,
            },
            "prompt_tokens_per_s": {
                "on": statistics.median(pair_pp["on"]),
                "off": statistics.median(pair_pp["off"]),
                "runs": pair_pp,
            },
            "decode_ratio_on_off": paired_ratio(pair["on"], pair["off"]),
            "prompt_ratio_on_off": paired_ratio(pair_pp["on"], pair_pp["off"]),
            "decode_ratio_of_medians": statistics.median(pair["on"]) / statistics.median(pair["off"]),
            "prompt_ratio_of_medians": statistics.median(pair_pp["on"]) / statistics.median(pair_pp["off"]),
            "pulls": puller.summary(on) if puller else None,
        }
        if args.control:
            control = {"on": decode[f"{name}-off2"], "off": decode[off]}
            results[name]["control_decode_ratio_off_off"] = paired_ratio(control["on"], control["off"])
            results[name]["decode_tokens_per_s"]["off2"] = statistics.median(control["on"])
            results[name]["decode_tokens_per_s"]["runs"]["off2"] = control["on"]
    if "baseline" in binaries:
        # telemetry off in both: what the current build's other changes (e.g. the expert cache, off) cost
        for mode in ("off", "on"):
            pair = {"on": decode[f"current-{mode}"], "off": decode[f"baseline-{mode}"]}
            results["current"][f"decode_ratio_vs_baseline_{mode}"] = paired_ratio(pair["on"], pair["off"])
    return results


def build_key(binary: Path) -> str:
    """The cache key of a cached build (~/.cache/moe-l2/llama/<key>/bin/llama-server), else the path."""
    return binary.parent.parent.name if binary.parent.name == "bin" else str(binary)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-words", type=int, default=400, help="prompt length (about one token per word)")
    parser.add_argument("--models", default="demo,wide,large", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument(
        "--pull-interval", type=float, default=1.0, help="seconds between the flywheel's pulls (0: no puller)"
    )
    parser.add_argument(
        "--baseline", type=Path, help="another llama-server binary (e.g. the build before a change) measured alongside"
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=(os.cpu_count() or 1) >= 2,
        help="servers on CPU 0, this process on the others (default: on with 2+ CPUs; needs --threads 1)",
    )
    parser.add_argument("--control", action="store_true", help="a second telemetry-off server: the noise floor")
    parser.add_argument("--out", type=Path, default=Path("bench/results/telemetry_overhead.json"))
    args = parser.parse_args()
    if args.pin:
        if args.threads > len(SERVER_CPUS):
            parser.error(f"--pin runs the servers on {len(SERVER_CPUS)} CPU: use --threads 1 (or --no-pin)")
        pin_self_off_the_servers()

    binaries = {"current": llama_server_binary(LlamaSettings())}  # MOE_L2_LLAMA_SERVER, else the cached build
    if args.baseline is not None:
        if not args.baseline.is_file():
            parser.error(f"--baseline {args.baseline} does not exist")
        binaries["baseline"] = args.baseline
    results: dict = {
        "benchmark": "telemetry_overhead",
        "machine": machine(),
        "runs": args.runs,
        "tokens": args.tokens,
        "threads": args.threads,
        "pull_interval_s": args.pull_interval,
        "pinned": args.pin,
        "binaries": {name: {"path": str(path), "build": build_key(path)} for name, path in binaries.items()},
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            spec = MODELS[name]
            model = Path(tmp) / f"{name}.gguf"
            make_demo_model(model, seed=0, spec=spec)
            planted = load_planted(model)
            prompts = {}
            for tag in DEFAULT_DOMAINS:
                words = planted["domains"][tag]["words"]
                prompts[tag] = " ".join(words[i % len(words)] for i in range(args.prompt_words))
            print(
                f"[{name}] {spec.n_layer} layers x {spec.n_expert} experts: {args.runs} interleaved runs of "
                f"{args.tokens} tokens on {len(binaries) * (3 if args.control else 2)} servers ...",
                file=sys.stderr,
                flush=True,
            )
            res = measure(binaries, model, prompts, args, Path(tmp) / "logs")
            results["models"][name] = {"spec": asdict(spec), "model_bytes": model.stat().st_size, "binaries": res}
            for binary, r in res.items():
                pulls = r["pulls"] or {}
                pull_text = ""
                if pulls.get("pulls"):
                    pull_text = (
                        f"; {pulls['pulls']} pulls, p50 {pulls['latency_ms_p50']:.1f} ms, "
                        f"max {pulls['latency_ms_max']:.1f} ms"
                    )
                print(
                    f"[{name}] {binary}: decode tokens/s on {r['decode_tokens_per_s']['on']:.1f}, "
                    f"off {r['decode_tokens_per_s']['off']:.1f}, ratio on/off {r['decode_ratio_on_off']:.3f}; "
                    f"prompt tokens/s ratio {r['prompt_ratio_on_off']:.3f}{pull_text}"
                )
                if "decode_ratio_vs_baseline_off" in r:
                    print(
                        f"[{name}] current/baseline decode, telemetry off {r['decode_ratio_vs_baseline_off']:.3f}, "
                        f"on {r['decode_ratio_vs_baseline_on']:.3f}"
                    )
                if "control_decode_ratio_off_off" in r:
                    control = r["control_decode_ratio_off_off"]
                    print(f"[{name}] {binary}: control (two servers, both off) ratio {control:.3f}")
                if pulls.get("failures"):
                    print(f"[{name}] {binary}: {pulls['failures']} pulls failed: {pulls['first_failure']}")

    write_json(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
