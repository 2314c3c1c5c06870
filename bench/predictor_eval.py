"""Predictor evaluation: held-out accuracy per tier and hybrid, latency per tier on one core, throughput.

The held-out set (bench/data/predictor_heldout.jsonl) was written separately from the taxonomy's
examples and calibration prompts, in a different style (casual, typos, longer, multi-turn
chats), and nothing is fitted on it: the TF-IDF and semantic tiers learn from the taxonomy's
examples, the hybrid's combiner from its calibration prompts. Latency is measured on one CPU
core with one torch thread, each configuration in its own block per round, the blocks
interleaved with rotating order. Writes bench/results/predictor_eval.json.

    python bench/predictor_eval.py [--heldout FILE] [--rounds N] [--cores 1]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
DEFAULT_HELDOUT = ROOT / "data" / "predictor_heldout.jsonl"
RESULTS = ROOT / "results" / "predictor_eval.json"
CONFIGS = {
    "keyword": "keyword",
    "tfidf": "tfidf",
    "semantic": "semantic",
    "keyword+tfidf": "keyword,tfidf",
    "hybrid": "keyword,tfidf,semantic",
}


def pin_to_cores(n: int) -> list[int]:
    cores = sorted(os.sched_getaffinity(0))[:n]
    os.sched_setaffinity(0, cores)
    return cores


def per_domain(names: tuple[str, ...], truth: list[str], pred: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    for d in names:
        tp = sum(t == d and p == d for t, p in zip(truth, pred, strict=True))
        predicted = sum(p == d for p in pred)
        actual = sum(t == d for t in truth)
        out[d] = {
            "precision": tp / predicted if predicted else 0.0,
            "recall": tp / actual if actual else 0.0,
            "support": actual,
        }
    return out


def confusion(names: tuple[str, ...], truth: list[str], pred: list[str]) -> list[list[int]]:
    index = {d: i for i, d in enumerate(names)}
    matrix = [[0] * len(names) for _ in names]
    for t, p in zip(truth, pred, strict=True):
        matrix[index[t]][index[p]] += 1
    return matrix


def calibration(conf: list[float], correct: list[bool], bins: int = 10) -> dict[str, float]:
    """Expected calibration error, and accuracy above common confidence thresholds."""
    c, ok = np.array(conf), np.array(correct, dtype=float)
    edges = np.linspace(0, 1, bins + 1)
    ece = 0.0
    for lo, hi in itertools.pairwise(edges):
        mask = (c > lo) & (c <= hi)
        if mask.any():
            ece += mask.mean() * abs(ok[mask].mean() - c[mask].mean())
    out = {"ece": float(ece), "mean_confidence": float(c.mean())}
    for threshold in (0.5, 0.8, 0.9):
        mask = c >= threshold
        out[f"share_conf_ge_{threshold}"] = float(mask.mean())
        out[f"accuracy_conf_ge_{threshold}"] = float(ok[mask].mean()) if mask.any() else float("nan")
    return out


def print_confusion(names: tuple[str, ...], matrix: list[list[int]]) -> None:
    short = [n[:7] for n in names]
    print("    truth \\ predicted " + " ".join(f"{s:>7}" for s in short))
    for name, row in zip(names, matrix, strict=True):
        print(f"    {name:<19} " + " ".join(f"{v:>7}" for v in row))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heldout", type=Path, default=DEFAULT_HELDOUT)
    parser.add_argument("--rounds", type=int, default=3, help="latency passes over the held-out prompts")
    parser.add_argument("--cores", type=int, default=1, help="CPU cores to pin to (0: no pinning)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="artefact cache (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    cores = pin_to_cores(args.cores) if args.cores else sorted(os.sched_getaffinity(0))
    load_before = os.getloadavg()
    import torch

    torch.set_num_threads(max(1, len(cores)))

    from moe_l2_domains.keywords import KeywordClassifier
    from moe_l2_domains.taxonomy import load_default_taxonomy
    from moe_l2_predictor.dataset import read_jsonl
    from moe_l2_predictor.predictor import Predictor
    from moe_l2_predictor.prompt import from_text
    from moe_l2_predictor.settings import PredictorSettings

    taxonomy = load_default_taxonomy()
    names = taxonomy.names
    heldout = read_jsonl(args.heldout, taxonomy)
    # Never fitted on: prove no held-out prompt is among the fitting examples.
    fitted_on = {text for text, _ in taxonomy.labeled_examples() + taxonomy.calibration_prompts()}
    overlap = [item.prompt.main for item in heldout if item.prompt.main in fitted_on]
    assert not overlap, f"held-out prompts found among the examples or calibration prompts: {overlap[:3]}"
    prompts = [item.prompt for item in heldout]
    truth = [item.domain for item in heldout]
    threads = torch.get_num_threads()
    print(f"held-out: {len(heldout)} prompts from {args.heldout.name}; cores {cores}; torch threads {threads}")

    with tempfile.TemporaryDirectory(prefix="moe-l2-predictor-eval-") as tmp:
        cache = args.cache_dir or Path(tmp)
        predictors: dict[str, Predictor] = {}
        for label, tiers in CONFIGS.items():
            started = time.monotonic()
            predictors[label] = Predictor.from_settings(
                PredictorSettings(tiers=tiers, cache_dir=cache), cross_validate=True
            )
            print(f"  {label:<14} ready in {time.monotonic() - started:5.1f}s")

        results: dict[str, dict] = {}
        print("\naccuracy on the held-out set (never fitted on):")
        for label, predictor in predictors.items():
            outcomes = predictor.predict_many(prompts)
            pred = [o.response.domain for o in outcomes]
            conf = [o.response.confidence for o in outcomes]
            correct = [p == t for p, t in zip(pred, truth, strict=True)]
            accuracy = sum(correct) / len(correct)
            entry = {
                "tiers": list(predictor.tiers),
                "accuracy": accuracy,
                "per_domain": per_domain(names, truth, pred),
                "confusion": confusion(names, truth, pred),
                "calibration": calibration(conf, correct),
                "cv_accuracy_on_examples": predictor.artefacts.report.get("cv_accuracy_on_examples", {}),
                "errors": [
                    {
                        "text": prompts[i].main[:120],
                        "truth": truth[i],
                        "predicted": pred[i],
                        "confidence": round(conf[i], 3),
                    }
                    for i in range(len(pred))
                    if not correct[i]
                ],
            }
            if "semantic" in predictor.tiers and len(predictor.tiers) > 1:
                entry["semantic_skipped_share"] = sum("semantic" not in o.tiers_run for o in outcomes) / len(outcomes)
            results[label] = entry
            extra = (
                f"  semantic skipped for {entry['semantic_skipped_share']:.0%}"
                if "semantic_skipped_share" in entry
                else ""
            )
            print(f"  {label:<14} {accuracy:6.1%}  (ECE {entry['calibration']['ece']:.3f}){extra}")

        for label in ("keyword", "hybrid"):
            print(f"\n  {label}: per domain (precision / recall)")
            for d, m in results[label]["per_domain"].items():
                print(f"    {d:<15} {m['precision']:6.1%} / {m['recall']:6.1%}")
            print(f"  {label}: confusion matrix")
            print_confusion(names, results[label]["confusion"])

        # Latency, single prompts: each round runs every configuration over all prompts, one block
        # per configuration (so each is measured warm, as a serving process is), the blocks
        # interleaved and their order rotated from round to round.
        keyword_fn = KeywordClassifier(taxonomy)
        texts = [p.main for p in prompts]
        runners = {"keyword_classifier": keyword_fn.predict} | {
            label: (lambda text, predictor=predictor: predictor.predict(from_text(text)))
            for label, predictor in predictors.items()
        }
        samples: dict[str, list[float]] = {label: [] for label in runners}
        for run in runners.values():  # warm-up
            run(texts[0])
        labels = list(runners)
        for round_ in range(args.rounds):
            for label in labels[round_ % len(labels) :] + labels[: round_ % len(labels)]:
                run = runners[label]
                for text in texts:
                    started = time.perf_counter()
                    run(text)  # from the text: language detection and clipping included
                    samples[label].append(time.perf_counter() - started)
        latency = {}
        print(f"\nlatency per single prompt ({len(cores)} core(s), {args.rounds} rounds, blocks interleaved):")
        for label, values in samples.items():
            ms = sorted(v * 1e3 for v in values)
            p50 = statistics.median(ms)
            p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
            latency[label] = {"p50_ms": p50, "p99_ms": p99, "mean_ms": statistics.fmean(ms), "n": len(ms)}
            print(f"  {label:<19} p50 {p50 * 1e3:9.1f} µs   p99 {p99 * 1e3:9.1f} µs")

        # Batch throughput: the whole held-out set in batches of 64, per configuration.
        throughput = {}
        print("\nbatch throughput (batches of 64):")
        for label, predictor in predictors.items():
            started = time.perf_counter()
            done = 0
            while time.perf_counter() - started < 3.0 or done < len(prompts):
                for i in range(0, len(prompts), 64):
                    predictor.predict_many(prompts[i : i + 64])
                done += len(prompts)
            rate = done / (time.perf_counter() - started)
            throughput[label] = {"prompts_per_s": rate}
            print(f"  {label:<14} {rate:9.0f} prompts/s")

    targets = {
        "hybrid_accuracy_ge_0.92": results["hybrid"]["accuracy"] >= 0.92,
        "keyword_p50_le_50us": latency["keyword"]["p50_ms"] <= 0.05,
        "keyword_classifier_p50_le_50us": latency["keyword_classifier"]["p50_ms"] <= 0.05,
        "hybrid_p50_le_10ms": latency["hybrid"]["p50_ms"] <= 10.0,
    }
    print(
        f"load average (1 min) before/after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )
    print("\ntargets:", ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in targets.items()))
    report = {
        "heldout": {"file": str(args.heldout.relative_to(ROOT.parent)), "prompts": len(heldout)},
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpus_online": os.cpu_count(),
            "cores_used": cores,
            # the machine is shared: other processes' load makes latencies worse than an idle core's
            "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "python": sys.version.split()[0],
        },
        "domains": list(names),
        "accuracy": results,
        "latency": latency,
        "throughput": throughput,
        "targets": targets,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, ensure_ascii=False))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
