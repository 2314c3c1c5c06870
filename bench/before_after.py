"""One benchmark, before and after a change, side by side: its runs from two checkouts alternated.

For the benchmarks that have no baseline mode of their own (gateway_overhead has `--baseline-ref`,
telemetry_overhead `--baseline BINARY`). REF is checked out into a temporary git worktree; the
benchmark's script then runs `--pairs` times from each checkout, alternately (before, after, after,
before, ...: an ABBA order, so a drift of the machine's load hits both alike), each in its own
process importing its own checkout's packages (PYTHONPATH puts them ahead of this tree's editable
install). Every run writes its JSON; the numbers named by the benchmark's metric patterns are
compared as medians over the runs, after / before. Writes bench/results/<bench>_before_after.json.

    python bench/before_after.py predictor_eval --ref 61e53f3 [--pairs 2] [-- --rounds 1]
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The numbers worth comparing, as dotted paths into the benchmark's JSON (fnmatch patterns), and
# which way is better.
METRICS: dict[str, dict[str, str]] = {
    "predictor_eval": {
        "accuracy.*.accuracy": "higher",
        "latency.*.p50_ms": "lower",
        "latency.*.p99_ms": "lower",
        "throughput.*.prompts_per_s": "higher",
    },
}


def package_path(tree: Path) -> str:
    """PYTHONPATH importing a checkout's packages, whatever its layout (shared/, ops/, services/*)."""
    roots = [tree / "shared", tree / "ops", *sorted((tree / "services").iterdir())]
    return os.pathsep.join(str(r) for r in roots if r.is_dir() and any(r.glob("moe_l2_*/__init__.py")))


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[tuple[Path, str]]:
    """`ref` in a temporary git worktree (removed afterwards), and its commit."""
    with tempfile.TemporaryDirectory(prefix="moe-l2-before-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(tree), ref], check=True)
        try:
            commit = subprocess.run(
                ["git", "-C", str(tree), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
            ).stdout.strip()
            yield tree, commit
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def run_once(tree: Path, bench: str, out: Path, extra: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": package_path(tree)}
    cmd = [sys.executable, str(tree / "bench" / f"{bench}.py"), "--out", str(out), *extra]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def flatten(value: Any, prefix: str = "") -> dict[str, float]:
    """Every number in a JSON document, by dotted path."""
    if isinstance(value, dict):
        out: dict[str, float] = {}
        for key, inner in value.items():
            out |= flatten(inner, f"{prefix}{key}.")
        return out
    if isinstance(value, int | float) and not isinstance(value, bool):
        return {prefix[:-1]: float(value)}
    return {}


def compare(
    before: list[dict[str, Any]], after: list[dict[str, Any]], patterns: dict[str, str]
) -> dict[str, dict[str, float | str]]:
    """Per metric: the medians over the runs of each side, and after / before."""
    flat_before, flat_after = [flatten(r) for r in before], [flatten(r) for r in after]
    rows: dict[str, dict[str, float | str]] = {}
    for path in sorted(flat_after[0]):
        better = next((way for pattern, way in patterns.items() if fnmatch.fnmatchcase(path, pattern)), None)
        if better is None or any(path not in f for f in flat_before):
            continue
        b = statistics.median(f[path] for f in flat_before)
        a = statistics.median(f[path] for f in flat_after)
        rows[path] = {"before": b, "after": a, "ratio": a / b if b else float("nan"), "better": better}
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench", choices=sorted(METRICS))
    parser.add_argument("--ref", required=True, help="the commit before the change")
    parser.add_argument("--pairs", type=int, default=2, help="runs from each checkout")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or ROOT / "bench" / "results" / f"{args.bench}_before_after.json"

    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with worktree(args.ref) as (before_tree, commit), tempfile.TemporaryDirectory() as tmp:
        trees = {"before": before_tree, "after": ROOT}
        for i in range(args.pairs):
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            for side in order:
                print(f"run {i + 1}/{args.pairs}: {side}", flush=True)
                runs[side].append(run_once(trees[side], args.bench, Path(tmp) / f"{side}-{i}.json", extra))
    rows = compare(runs["before"], runs["after"], METRICS[args.bench])
    print(f"\n{args.bench}: after / before ({args.ref} = {commit[:12]}), medians of {args.pairs} runs each")
    for path, row in rows.items():
        print(
            f"  {path:<48} {row['before']:12.4g} {row['after']:12.4g}   x{row['ratio']:.3f} ({row['better']} is better)"
        )
    report = {"bench": args.bench, "before": {"ref": args.ref, "commit": commit}, "pairs": args.pairs, "metrics": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
