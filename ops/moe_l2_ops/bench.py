"""`moe-l2 bench`: the project's claims checked on a user's own machine and model, in the spirit of llama-bench.

On a GPU (or any device llama.cpp offloads to, the RPC device included) it runs `bench/expert_offload.py` once
per device budget: stock `--cpu-moe` (b), stock `--n-cpu-moe` fitted to the same device memory with its host
weights pinned (cp) and the project's default (ea: `--moe-cache-bytes auto`, whole layers and a cache), side by
side in one run each, so the ratios are measured on the same noisy machine. On a machine without a GPU it runs
`bench/ram_tier.py`: the RAM tier against llama.cpp's mmap under the same memory budget (`--ram-tier` adds it
to a device run). The output is what a user pastes into an issue: a markdown table with the machine, the model
and the version, the JSON of every run, and a PNG of tokens/s against device memory.

    moe-l2 bench --model my-moe.gguf                    # CUDA when nvidia-smi finds a GPU, else the RAM tier
    moe-l2 bench --shape gpt-oss-20b --budgets 50%,25%  # a generated model of a real shape
    moe-l2 bench --backend rpc --shape ds-v2-lite --layers 4 --ram-tier   # a machine without a GPU

The benchmarks are scripts of the repository (bench/), run as child processes with this interpreter; their
logs go to the output folder, a progress bar shows the budgets.
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
PLACEMENTS = ("b", "cp", "ea")  # stock --cpu-moe, stock --n-cpu-moe pinned, the project's default
LABELS = {"b": "stock --cpu-moe", "cp": "stock --n-cpu-moe (pinned)", "ea": "moe-l2 default (auto)"}
DEFAULT_BUDGETS = "50%,25%,12.5%"


class BenchError(Exception):
    """A usage or setup error: one line, exit status 2."""


@dataclass(frozen=True)
class Row:
    """One placement at one device budget."""

    budget: str
    config: str
    device_expert_bytes: int
    decode_tps: float
    prompt_tps: float


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moe-l2 bench", description=__doc__.splitlines()[0])
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", type=Path, help="a MoE GGUF (default: a generated --shape)")
    model.add_argument("--shape", default=None, help="a real model's shape, generated once (default ds-v2-lite)")
    p.add_argument("--layers", type=int, help="the shape's first N layers (default: all on a GPU, 4 otherwise)")
    p.add_argument(
        "--backend",
        choices=("auto", "cuda", "vulkan", "rpc"),
        default="auto",
        help="the device (auto: cuda when nvidia-smi finds a GPU; without one, the RAM tier only)",
    )
    p.add_argument(
        "--budgets",
        default=DEFAULT_BUDGETS,
        # argparse formats help with %: the default's own percent signs are escaped
        help=f"device budgets, shares of the routed experts' bytes ({DEFAULT_BUDGETS.replace('%', '%%')})",
    )
    p.add_argument("--runs", type=int, default=1, help="runs of each placement at each budget (default 1)")
    p.add_argument("--tokens", type=int, default=32, help="decode tokens a run (default 32)")
    p.add_argument("--binary", type=Path, help="llama-server for --backend (default: the cached build)")
    p.add_argument("--ram-tier", action="store_true", help="also the RAM tier against mmap (bench/ram_tier.py)")
    p.add_argument("--out", type=Path, help="output folder (default: ./moe-l2-bench-<date>-<time>)")
    return p.parse_args(argv)


def has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    probe = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False)
    return probe.returncode == 0 and "GPU" in probe.stdout


def plan(args: argparse.Namespace) -> tuple[str | None, bool]:
    """(the device backend or None, whether the RAM tier runs)."""
    backend = args.backend
    if backend == "auto":
        backend = "cuda" if has_gpu() else None
    return backend, bool(args.ram_tier or backend is None)


def budgets(text: str) -> list[str]:
    out = [b.strip() for b in text.split(",") if b.strip()]
    for b in out:
        try:
            share = float(b.rstrip("%"))
        except ValueError:
            raise BenchError(f"--budgets: {b!r} is not a share like 50%") from None
        if not 0 < share < 100:
            raise BenchError(f"--budgets: {b} must be between 0% and 100% (100% is every expert on the device)")
    if not out:
        raise BenchError("--budgets: give at least one share, e.g. 50%")
    return [b if b.endswith("%") else f"{b}%" for b in out]


MODELS = Path.home() / ".cache" / "moe-l2" / "models"


def resolve_model(args: argparse.Namespace, backend: str | None) -> Path:
    """The model both benchmarks run: the user's file, or a shape written once under ~/.cache/moe-l2/models (the
    whole shape on a GPU; its first 4 layers elsewhere, where a device is the CPU under another name)."""
    if args.model is not None:
        if not args.model.is_file():
            raise BenchError(f"--model {args.model} does not exist")
        return args.model.resolve()
    from moe_l2_gguf.model_files import DemoModelError
    from moe_l2_gguf.model_shapes import get_shape, write_shape_model

    layers = args.layers if args.layers is not None else (None if backend == "cuda" else 4)
    try:
        shape = get_shape(args.shape or "ds-v2-lite").reduced(layers, 8192 if layers else None)
    except ValueError as e:
        raise BenchError(str(e)) from None
    path = MODELS / (f"{shape.name}-{layers}l.gguf" if layers else f"{shape.name}.gguf")
    if not path.is_file():
        try:
            write_shape_model(path, shape)
        except DemoModelError as e:
            raise BenchError(str(e)) from None
    return path


def child_env() -> dict[str, str]:
    """The benchmarks import the project's packages: the roots pyproject.toml lists, as `make test` has them."""
    roots = ("shared", "ops", "services/llama", "services/proxy", "services/predictor", "services/cache-manager")
    path = os.pathsep.join(str(REPO / r) for r in roots)
    env = dict(os.environ)
    env["PYTHONPATH"] = path + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_child(cmd: list[str], log: Path) -> None:
    """A benchmark with its output in `log`; on failure its last lines, in one error."""
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO, check=False)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-8:]
        raise BenchError(f"{Path(cmd[1]).name} exited {proc.returncode} (log {log}):\n  " + "\n  ".join(tail))


def offload_cmd(args: argparse.Namespace, backend: str, budget: str, model: Path, out: Path) -> list[str]:
    # the model's own router (--trace none): a user's model routes for real; the ESFT trace is one model's
    cmd = [sys.executable, str(BENCH / "expert_offload.py"), "--backend", backend, "--model", str(model)]
    cmd += ["--cache-bytes", budget, "--configs", ",".join(PLACEMENTS), "--runs", str(args.runs)]
    cmd += ["--tokens", str(args.tokens), "--trace", "none"]
    cmd += ["--out", str(out), "--log-dir", str(out.with_suffix("")) + "-logs"]
    if args.binary is not None:
        cmd += ["--binary", str(args.binary)]
    return cmd


def rows_of(budget: str, doc: dict[str, Any]) -> list[Row]:
    rows = []
    for name in PLACEMENTS:
        c = doc["configs"].get(name) or {}
        if c.get("status") != "measured":
            continue
        rows.append(
            Row(
                budget,
                name,
                int(c.get("device_expert_bytes") or 0),
                float(c["decode_tokens_per_s"]),
                float(c["prompt_tokens_per_s"]),
            )
        )
    return rows


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()
        info["ram_gib"] = round(int(mem[1]) / 2**20, 1)
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        q = ["nvidia-smi", "--query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current"]
        probe = subprocess.run([*q, "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=False)
        info["gpus"] = [g.strip() for g in probe.stdout.splitlines() if g.strip()]
    return info


def version() -> str:
    from importlib.metadata import version as pkg_version

    return f"moe-l2 {pkg_version('moe-l2')}"


def table(rows: list[Row]) -> str:
    lines = [
        "| device budget | placement | device experts (GB) | decode tok/s | prompt tok/s | decode vs best stock |",
        "|---|---|---|---|---|---|",
    ]
    for budget in dict.fromkeys(r.budget for r in rows):
        at = [r for r in rows if r.budget == budget]
        stock = max((r.decode_tps for r in at if r.config != "ea"), default=0.0)
        for r in at:
            ratio = f"**{r.decode_tps / stock:.2f}x**" if r.config == "ea" and stock else ""
            lines.append(
                f"| {budget} | {LABELS[r.config]} | {r.device_expert_bytes / 1e9:.2f} | {r.decode_tps:.1f} "
                f"| {r.prompt_tps:.1f} | {ratio} |"
            )
    return "\n".join(lines)


def plot(rows: list[Row], title: str, path: Path) -> str:
    """tok/s against device expert memory, one line a placement; '' or why there is no PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (`make install` brings it)"
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for name in PLACEMENTS:
        pts = sorted((r.device_expert_bytes / 1e9, r.decode_tps) for r in rows if r.config == name)
        if name == "b" and pts:  # no expert on the device at any budget: a reference line, its runs' mean
            ax.axhline(sum(t for _, t in pts) / len(pts), color="grey", linestyle="--", label=LABELS[name])
        elif pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=LABELS[name])
    ax.set_xlabel("device memory for experts (GB)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return ""


def run_placements(args: argparse.Namespace, backend: str, out: Path) -> tuple[list[Row], dict[str, Any]]:
    from tqdm import tqdm

    model = resolve_model(args, backend)
    rows: list[Row] = []
    docs: dict[str, Any] = {}
    shares = budgets(args.budgets)
    for budget in tqdm(shares, desc=f"placements on {backend}", unit="budget", disable=None):
        name = budget.rstrip("%").replace(".", "_")
        json_path = out / f"offload_{name}.json"
        run_child(offload_cmd(args, backend, budget, model, json_path), out / f"offload_{name}.log")
        docs[budget] = json.loads(json_path.read_text())
        rows += rows_of(budget, docs[budget])
    return rows, docs


def run_ram_tier(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    model = resolve_model(args, None)
    json_path = out / "ram_tier.json"
    cmd = [sys.executable, str(BENCH / "ram_tier.py"), "--model", str(model), "--budgets", "50", "--rounds", "1"]
    cmd += ["--requests", "2", "--tokens", str(args.tokens), "--out", str(json_path)]
    if args.binary is not None:
        cmd += ["--binary", str(args.binary)]
    print("RAM tier against mmap (bench/ram_tier.py): a few minutes ...", file=sys.stderr)
    run_child(cmd, out / "ram_tier.log")
    return json.loads(json_path.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not BENCH.is_dir():
        print(
            f"error: moe-l2 bench runs the benchmarks of a clone of the repository; {BENCH} is missing", file=sys.stderr
        )
        return 2
    out = args.out or Path(f"moe-l2-bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    try:
        budgets(args.budgets)
        backend, ram = plan(args)
        report: dict[str, Any] = {"version": version(), "machine": machine(), "backend": backend}
        rows: list[Row] = []
        if backend is not None:
            rows, report["placements"] = run_placements(args, backend, out)
        if ram:
            report["ram_tier"] = run_ram_tier(args, out)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_report(report, rows, out)
    return 0


def write_report(report: dict[str, Any], rows: list[Row], out: Path) -> None:
    m = report["machine"]
    gpus = ", ".join(m.get("gpus") or []) or "none"
    lines = [f"## moe-l2 bench ({report['version']})", ""]
    lines.append(f"- machine: {m.get('cpu')}, {m.get('cores')} cores, {m.get('ram_gib')} GiB RAM; GPU: {gpus}")
    if "placements" in report:
        first = next(iter(report["placements"].values()))
        mod = first["model"]
        n_moe = len(mod["expert_bytes_per_layer"])
        lines.append(
            f"- model: {Path(mod['path']).name}, {mod['n_layer']} layers ({n_moe} MoE) x {mod['n_expert']} experts, "
            f"top-{mod['n_expert_used']}, {mod['file_bytes'] / 1e9:.2f} GB "
            f"({mod['routed_bytes'] / 1e9:.2f} GB of experts)"
        )
        lines.append(f"- device: {report['backend']} ({first.get('device') or ''}); binary {first.get('binary')}")
        lines += ["", table(rows)]
        why = plot(rows, f"{Path(mod['path']).name} on {report['backend']}", out / "bench.png")
        lines += ["", why or "![decode tokens/s against device memory](bench.png)"]
    if "ram_tier" in report:
        lines += ["", "### RAM tier against mmap (bench/ram_tier.py)", "", ram_tier_lines(report["ram_tier"])]
    text = "\n".join(lines) + "\n"
    (out / "bench.md").write_text(text)
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    print(text)
    print(f"(written to {out}/: bench.md, bench.json{', bench.png' if (out / 'bench.png').exists() else ''})")


def ram_tier_lines(doc: dict[str, Any]) -> str:
    """bench/ram_tier.py's figures a budget and config: decode, bytes read from storage, the model's residency."""
    lines = [
        "| memory budget | config | decode tok/s | read MB/token | max model resident GiB | budget GiB | vs stock |",
        "|---|---|---|---|---|---|---|",
    ]
    for pct, at in (doc.get("budgets") or {}).items():
        configs = at.get("configs") or {}
        stock = (configs.get("stock") or {}).get("decode_tokens_per_s")
        for name, c in configs.items():
            tps = c.get("decode_tokens_per_s") or 0.0
            ratio = f"**{tps / stock:.2f}x**" if name != "stock" and stock else ""
            read_mb = (c.get("read_bytes_per_token") or 0) / 1e6
            resident = (c.get("max_model_resident_bytes") or 0) / 2**30
            lines.append(
                f"| {pct}% of the experts | {name} | {tps:.1f} | {read_mb:.1f} | {resident:.2f} "
                f"| {at['budget_bytes'] / 2**30:.2f} | {ratio} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
