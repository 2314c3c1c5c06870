"""Expert-cache policy study: replay real routing traces through every policy, held out.

Sources (each optional but ESFT; a missing one is reported and skipped):
- esft: per-token traces of a DeepSeek-V2-Lite-class model (26 MoE layers, 64 experts, top-6),
  4 labelled domains (bench/data/routing/deepseek-ai__ESFT, or MOE_L2_ROUTING_DATA);
- mixtral: decode traces of Mixtral-8x7B-Instruct (32 layers, 8 experts, top-2), code and math;
- demo: the demo model's per-token traces captured from the real patched llama-server
  (bench/capture_demo_traces.py; captured now if the file is missing and the server can be built).

Method: for every domain, a seeded random half of its sequences is the profile split (static
tables, domain priors, cross-layer transitions, global and per domain, and the knobs of LFRU, the
hybrid, its admission margin and the threshold prefetch's lift are fitted there; the knobs on an
inner split of it) and the other half is the test split. The test
requests of all domains are replayed in one seeded shuffled order, token by token, through each
policy at capacities 8/16/24/32 experts per layer (for 64 experts; proportional otherwise).
Domain-aware policies are also run with a noisy domain label (right 90% and 75% of the time).

    .venv/bin/python bench/cache_policies.py [--quick] [--jobs 2] [--out bench/results/cache_policies.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe_l2_cache.policy import DEFAULT_POLICY, ExpertCachePolicy, RoutingProfile, fit_profile
from moe_l2_cache.policy import hybrid as hybrid_module
from moe_l2_cache.policy import online as online_module
from moe_l2_cache.policy import prefetch as prefetch_module
from moe_l2_cache.policy.prefetch import CrossLayerPrefetch

# The study's own baselines (Belady, static sets) live beside it, not in the product's package.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_paths import esft_npz, routing_data
from study_policies import make_study_policy

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DEMO_TRACES = RESULTS / "demo_routing_traces.npz"
DOC_PLOT = ROOT / "docs" / "cache-policy-study.png"

BASE_CAPACITIES = (8, 16, 24, 32)  # per layer, for a 64-expert model
POLICIES = (
    "lru",
    "lfu",
    "lfru",
    "static_global",
    "static_domain",
    "hybrid",
    "hybrid_admit",
    "xlayer_prefetch",
    "hybrid_prefetch",
    "hybrid_threshold_prefetch",
    "belady",
)
DOMAIN_AWARE = ("static_domain", "hybrid", "hybrid_admit", "hybrid_prefetch", "hybrid_threshold_prefetch")
LABEL_ACCURACIES = (0.9, 0.75, 0.0)  # 0.0: no label at all (the policy is told None: global prior)
SEED = 0

# Knob grids, searched on an inner split of the profile split at the middle capacity.
LFRU_HALF_LIVES = (4.0, 8.0, 16.0, 32.0, 64.0)
HYBRID_GRID = [
    {"half_life": h, "prior_weight": w, "fill_weight": f}
    for h in (8.0, 16.0, 32.0)
    for w in (0.0, 1.0, 2.0, 4.0)
    for f in (0.0, 1.0)
]
# Searched second, over the hybrid knobs chosen first: the admission margin of `hybrid_admit` (in
# activations; negative favours the newcomer) and the threshold prefetch's minimum lift (P(b at l+1)
# over chance, k of n experts), which must move no more bytes than LRU on the inner split (the highest
# hit rate among the values that do).
ADMIT_MARGINS = (-1.0, -0.5, 0.0, 0.5)
PREFETCH_LIFTS = (2.0, 2.2, 2.4, 2.6, 2.8, 3.0, 3.2, 3.4, 3.6, 3.8, 4.0, 4.4, 4.8, 5.4)
# Reported on the test split at the middle capacity (the chosen lift is added).
LIFT_SWEEP = (2.0, 2.6, 3.2, 3.8, 4.4, 5.4)


# -- sources ----------------------------------------------------------------------------------


@dataclass
class Trace:
    source: str
    experts: np.ndarray  # [token, layer, k] int64
    domain: np.ndarray  # [token] str
    seq: np.ndarray  # [token] int, one id per request
    n_expert: int
    expert_bytes: int
    bytes_note: str
    note: str

    @property
    def n_layer(self) -> int:
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    def domains(self) -> list[str]:
        return sorted({str(d) for d in self.domain})


def load_esft(data: Path) -> Trace:
    """The ESFT trace of the routing folder `data` (bench/data_paths.py finds the file)."""
    d = np.load(esft_npz(data))
    names = np.array(["intent", "law", "summary", "translation"])
    # DeepSeek-V2-Lite routed expert: gate, up and down, hidden 2048 x moe_intermediate 1408, in bf16.
    return Trace(
        source="esft",
        experts=d["experts"].astype(np.int64),
        domain=names[d["task"]],
        seq=d["seq"].astype(np.int64),
        n_expert=64,
        expert_bytes=3 * 2048 * 1408 * 2,
        bytes_note="DeepSeek-V2-Lite expert (3 x 2048 x 1408) in bf16",
        note="teacher-forced prefill over prompt + reference answer, replayed as if decoded token by token",
    )


def load_mixtral(data: Path) -> Trace:
    folder = data / "Mario928__speculative-moe"
    experts: list[np.ndarray] = []
    domain: list[str] = []
    seq: list[int] = []
    n_seq = 0
    for name, label in (("humaneval_2_routing.jsonl", "code"), ("gsm8k_2_routing.jsonl", "math")):
        by_token: dict[tuple[int, int], dict[int, list[int]]] = defaultdict(dict)
        with (folder / name).open() as f:
            for line in f:
                r = json.loads(line)
                by_token[(r["problem_id"], r["token_idx"])][r["layer"]] = r["experts"]
        problems = sorted({p for p, _ in by_token})
        for problem in problems:
            # Keep tokens with all 32 layers (the source's decode-boundary heuristic drops a few rows).
            tokens = sorted(t for p, t in by_token if p == problem and len(by_token[(p, t)]) == 32)
            for t in tokens:
                layers = by_token[(problem, t)]
                experts.append(np.array([layers[layer] for layer in range(32)], dtype=np.int64))
                domain.append(label)
                seq.append(n_seq)
            n_seq += 1
    return Trace(
        source="mixtral",
        experts=np.stack(experts),
        domain=np.array(domain),
        seq=np.array(seq),
        n_expert=8,
        expert_bytes=3 * 4096 * 14336 * 2,
        bytes_note="Mixtral-8x7B expert (3 x 4096 x 14336) in bf16",
        note="greedy decode tokens only; 2 generations per domain, so 1 profiles and 1 is measured",
    )


def load_demo(path: Path) -> Trace:
    d = np.load(path)
    names = d["domains"]
    return Trace(
        source="demo",
        experts=d["experts"].astype(np.int64),
        domain=names[d["domain"]],
        seq=d["seq"].astype(np.int64),
        n_expert=int(d["n_expert"]),
        expert_bytes=int(d["expert_bytes"]),
        bytes_note="demo model expert (3 x 64 x 64) in f16, from its GGUF",
        note="captured one token at a time from the patched llama-server (prompt and generated tokens); "
        "the router is planted per domain, so this shows the mechanism, not real-model behaviour",
    )


def ensure_demo_traces(path: Path) -> bool:
    """Captures the demo traces if missing (needs the patched llama-server); False if that fails."""
    if path.exists():
        return True
    try:
        from capture_demo_traces import main as capture_main

        capture_main(["--out", str(path)])
    except Exception as exc:  # the benchmark still runs on the other sources
        print(f"demo traces: cannot capture ({exc}); skipping the demo source", file=sys.stderr)
        return False
    return path.exists()


# -- splits and streams -----------------------------------------------------------------------


@dataclass
class Stream:
    """Requests replayed in order: experts per token, the true domain, and where requests start."""

    experts: np.ndarray
    domain: np.ndarray
    starts: np.ndarray  # [token] bool, a request begins here
    request: np.ndarray  # [token] request index in replay order

    @property
    def n_tokens(self) -> int:
        return len(self.experts)


def split_sequences(trace: Trace, seed: int) -> tuple[list[int], list[int]]:
    """Per domain, a seeded random half (rounded down, at least 1) profiles; the rest is measured."""
    rng = np.random.default_rng(seed)
    profile: list[int] = []
    test: list[int] = []
    for d in trace.domains():
        seqs = np.unique(trace.seq[trace.domain == d])
        rng.shuffle(seqs)
        half = max(1, len(seqs) // 2) if len(seqs) > 1 else 0
        profile += seqs[:half].tolist()
        test += seqs[half:].tolist()
    return profile, test


def make_stream(trace: Trace, seqs: Sequence[int], seed: int) -> Stream:
    """The given requests in a seeded shuffled order, so domains interleave."""
    order = list(seqs)
    np.random.default_rng(seed).shuffle(order)
    first = {s: i for i, s in enumerate(order)}
    idx = np.concatenate([np.flatnonzero(trace.seq == s) for s in order])
    req = np.array([first[s] for s in trace.seq[idx]])
    starts = np.r_[True, req[1:] != req[:-1]]
    return Stream(trace.experts[idx], trace.domain[idx], starts, req)


def fit(trace: Trace, seqs: Sequence[int]) -> RoutingProfile:
    mask = np.isin(trace.seq, list(seqs))
    return fit_profile(trace.experts[mask], trace.domain[mask], trace.n_expert)


def noisy_labels(stream: Stream, domains: Sequence[str], accuracy: float, seed: int) -> np.ndarray:
    """Per request: the true domain with probability `accuracy`, else another domain at random."""
    rng = np.random.default_rng(seed)
    labels = stream.domain.copy()
    for r in np.unique(stream.request):
        at = stream.request == r
        true = str(stream.domain[at][0])
        if rng.random() >= accuracy:
            labels[at] = rng.choice([d for d in domains if d != true])
    return labels


def capacities(n_expert: int) -> list[int]:
    return [max(1, round(c * n_expert / 64)) for c in BASE_CAPACITIES]


# -- replay -----------------------------------------------------------------------------------


def replay(policy: ExpertCachePolicy, stream: Stream, labels: np.ndarray, domains: Sequence[str]) -> dict[str, Any]:
    """Runs the stream through the policy; hit rates overall and per true domain, loads per token."""
    index = {d: i for i, d in enumerate(domains)}
    dom_idx = np.array([index[str(d)] for d in stream.domain])
    hits_by_dom = np.zeros(len(domains))
    started = time.perf_counter()
    step = policy.access_token  # type: ignore[attr-defined]
    for t in range(stream.n_tokens):
        if stream.starts[t]:
            policy.on_domain(None if labels[t] is None else str(labels[t]))
        hits_by_dom[dom_idx[t]] += step(stream.experts[t]).sum()
    per_token = stream.experts.shape[1] * stream.experts.shape[2]
    acc_by_dom = np.bincount(dom_idx, minlength=len(domains)) * per_token
    loads = int(policy.loads)  # type: ignore[attr-defined]
    out: dict[str, Any] = {
        "hit_rate": float(hits_by_dom.sum() / acc_by_dom.sum()),
        "hit_rate_by_domain": {d: float(hits_by_dom[i] / acc_by_dom[i]) for d, i in index.items() if acc_by_dom[i]},
        "loads_per_token": loads / stream.n_tokens,
        "seconds": time.perf_counter() - started,
    }
    if isinstance(policy, CrossLayerPrefetch):
        s = policy.stats
        out["prefetch"] = {
            # at most this many per layer; null: no cap, the lift threshold alone decides
            "n_predict": policy.n_predict or (None if policy.min_lift > 0 else stream.experts.shape[2]),
            "min_lift": policy.min_lift,
            "precision": s.precision,
            "recall": s.recall,
            "loads_per_token": s.loads / stream.n_tokens,
            "extra_loads_per_token": s.wasted / stream.n_tokens,
        }
    return out


@dataclass
class Job:
    source: str
    policy: str
    capacity: int
    accuracy: float = 1.0
    # test | inner (knob search) | swapped (roles of the two halves exchanged); sweep and ablation are
    # test-split runs reported in their own tables
    split: str = "test"
    knobs: tuple[tuple[str, Any], ...] = ()


# Filled before the worker pool forks, so jobs carry only names (fork shares the arrays).
_CONTEXT: dict[str, dict[str, Any]] = {}


def run_job(job: Job) -> tuple[Job, dict[str, Any]]:
    ctx = _CONTEXT[job.source]
    trace: Trace = ctx["trace"]
    split = "test" if job.split in ("sweep", "ablation") else job.split
    stream: Stream = ctx["streams"][split]
    profile: RoutingProfile = ctx["profiles"][split]
    kwargs = {**profile.as_kwargs(), **ctx["knobs"], **dict(job.knobs)}
    if job.policy == "belady":
        kwargs["future"] = stream.experts
    policy = make_study_policy(job.policy, trace.n_layer, trace.n_expert, job.capacity, **kwargs)
    labels: np.ndarray = stream.domain
    if job.accuracy == 0.0:
        labels = np.full(stream.n_tokens, None, dtype=object)
    elif job.accuracy < 1.0:
        labels = noisy_labels(stream, trace.domains(), job.accuracy, seed=SEED + int(job.accuracy * 1000))
    return job, replay(policy, stream, labels, trace.domains())


def run_jobs(jobs: Iterable[Job], n_jobs: int) -> list[tuple[Job, dict[str, Any]]]:
    jobs = list(jobs)
    if n_jobs <= 1:
        return [run_job(j) for j in jobs]
    with ProcessPoolExecutor(n_jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(run_job, jobs))


# -- the study --------------------------------------------------------------------------------


def prepare(trace: Trace) -> dict[str, Any]:
    """Profiles and streams of one source: test, swapped, and the inner split for knob search."""
    profile_seqs, test_seqs = split_sequences(trace, SEED)
    inner_fit, inner_eval = split_sequences(_subset(trace, profile_seqs), SEED + 1)
    ctx: dict[str, Any] = {
        "trace": trace,
        "knobs": {},
        "profile_seqs": profile_seqs,
        "test_seqs": test_seqs,
        "streams": {
            "test": make_stream(trace, test_seqs, SEED),
            "swapped": make_stream(trace, profile_seqs, SEED),
            "inner": make_stream(trace, inner_eval, SEED),
        },
        "profiles": {
            "test": fit(trace, profile_seqs),
            "swapped": fit(trace, test_seqs),
            "inner": fit(trace, inner_fit),
        },
    }
    ctx["inner_ok"] = bool(inner_fit) and bool(inner_eval)
    return ctx


def _subset(trace: Trace, seqs: Sequence[int]) -> Trace:
    mask = np.isin(trace.seq, list(seqs))
    return Trace(
        trace.source,
        trace.experts[mask],
        trace.domain[mask],
        trace.seq[mask],
        trace.n_expert,
        trace.expert_bytes,
        trace.bytes_note,
        trace.note,
    )


def search_knobs(sources: Sequence[str], fallback: dict[str, Any], n_jobs: int) -> dict[str, dict[str, Any]]:
    """Per source, the knobs with the best inner-split hit rate: first LFRU's half-life and the hybrid's
    knobs, then, over that hybrid, the admission margin and the prefetch's minimum lift (within LRU's bytes)."""
    searched = [s for s in sources if _CONTEXT[s]["inner_ok"]]
    mid = {s: capacities(_CONTEXT[s]["trace"].n_expert)[1] for s in searched}
    jobs: list[Job] = []
    for src in searched:
        jobs.append(Job(src, "lru", mid[src], split="inner"))
        jobs += [Job(src, "lfru", mid[src], split="inner", knobs=(("half_life", h),)) for h in LFRU_HALF_LIVES]
        jobs += [Job(src, "hybrid", mid[src], split="inner", knobs=tuple(g.items())) for g in HYBRID_GRID]
    results = run_jobs(jobs, n_jobs)
    best_hybrid: dict[str, dict[str, Any]] = {}
    for src in searched:
        mine = [(j, r) for j, r in results if j.source == src and j.policy == "hybrid"]
        best_hybrid[src] = dict(max(mine, key=lambda jr: jr[1]["hit_rate"])[0].knobs)
    second: list[Job] = []
    for src in searched:
        base = tuple(best_hybrid[src].items())
        second += [
            Job(src, "hybrid_admit", mid[src], split="inner", knobs=(*base, ("admit_margin", m))) for m in ADMIT_MARGINS
        ]
        second += [
            Job(src, "hybrid_threshold_prefetch", mid[src], split="inner", knobs=(*base, ("min_lift", t)))
            for t in PREFETCH_LIFTS
        ]
    results += run_jobs(second, n_jobs)
    chosen: dict[str, dict[str, Any]] = {}
    for src in sources:
        mine = [(j, r) for j, r in results if j.source == src]
        if not mine:
            chosen[src] = {**fallback, "searched": False}
            continue

        def of(policy: str, mine: list = mine) -> list[tuple[dict[str, Any], dict[str, Any]]]:
            return [(dict(j.knobs), r) for j, r in mine if j.policy == policy]

        lru_moved = of("lru")[0][1]["loads_per_token"]
        best_lfru = max(of("lfru"), key=lambda kr: kr[1]["hit_rate"])[0]
        best_admit = max(of("hybrid_admit"), key=lambda kr: kr[1]["hit_rate"])[0]
        thresholds = of("hybrid_threshold_prefetch")
        within = [kr for kr in thresholds if kr[1]["loads_per_token"] <= lru_moved]
        # No lift within LRU's bytes: the one that moves the fewest.
        best_threshold = (
            max(within, key=lambda kr: kr[1]["hit_rate"])[0]
            if within
            else min(thresholds, key=lambda kr: kr[1]["loads_per_token"])[0]
        )
        chosen[src] = {
            "lfru_half_life": best_lfru["half_life"],
            "hybrid": best_hybrid[src],
            "hybrid_admit_margin": best_admit["admit_margin"],
            "prefetch_min_lift": best_threshold["min_lift"],
            "searched": True,
            "inner_lru": {"hit_rate": of("lru")[0][1]["hit_rate"], "loads_per_token": lru_moved},
            "inner_hit_rates": {
                "lfru": {str(k["half_life"]): r["hit_rate"] for k, r in of("lfru")},
                "hybrid": [{**k, "hit_rate": r["hit_rate"]} for k, r in of("hybrid")],
                "hybrid_admit": {str(k["admit_margin"]): r["hit_rate"] for k, r in of("hybrid_admit")},
                "hybrid_threshold_prefetch": {
                    str(k["min_lift"]): {"hit_rate": r["hit_rate"], "loads_per_token": r["loads_per_token"]}
                    for k, r in thresholds
                },
            },
        }
    return chosen


def registry_knobs() -> dict[str, Any]:
    """The knobs make_policy uses when a profile gives none (the package's constants)."""
    h = hybrid_module
    return {
        "lfru_half_life": online_module.HALF_LIFE,
        "hybrid": {"half_life": h.HALF_LIFE, "prior_weight": h.PRIOR_WEIGHT, "fill_weight": h.FILL_WEIGHT},
        "hybrid_admit_margin": h.ADMIT_MARGIN,
        "prefetch_min_lift": prefetch_module.MIN_LIFT,
    }


def knobs_for(policy: str, chosen: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    if policy == "lfru":
        return (("half_life", chosen["lfru_half_life"]),)
    if policy in ("hybrid", "hybrid_prefetch"):
        return tuple(chosen["hybrid"].items())
    if policy == "hybrid_admit":
        return (*chosen["hybrid"].items(), ("admit_margin", chosen["hybrid_admit_margin"]))
    if policy == "hybrid_threshold_prefetch":
        return (*chosen["hybrid"].items(), ("min_lift", chosen["prefetch_min_lift"]))
    return ()


def study(sources: Sequence[str], n_jobs: int, quick: bool) -> dict[str, Any]:
    fallback = registry_knobs()
    chosen = search_knobs(sources, fallback, n_jobs)
    # A source too small to search (Mixtral) uses what the main source (ESFT) chose.
    for src in sources:
        if not chosen[src]["searched"] and "esft" in chosen and chosen["esft"]["searched"]:
            chosen[src] = {**chosen["esft"], "searched": False, "from": "esft"}
            chosen[src].pop("inner_hit_rates", None)
    jobs: list[Job] = []
    for src in sources:
        trace: Trace = _CONTEXT[src]["trace"]
        caps = capacities(trace.n_expert)
        if quick:
            caps = [caps[1]]
        for cap in caps:
            for pol in POLICIES:
                jobs.append(Job(src, pol, cap, knobs=knobs_for(pol, chosen[src])))
            for acc in LABEL_ACCURACIES:
                for pol in DOMAIN_AWARE:
                    jobs.append(Job(src, pol, cap, accuracy=acc, knobs=knobs_for(pol, chosen[src])))
        mid = caps[1] if len(caps) > 1 else caps[0]
        k = trace.top_k
        for n in sorted({max(1, k // 3), max(1, 2 * k // 3)} - {k}):
            jobs.append(Job(src, "xlayer_prefetch", mid, knobs=(("n_predict", n),)))
        jobs.append(Job(src, "belady", mid, knobs=(("bypass", False),)))
        base = tuple(chosen[src]["hybrid"].items())
        for t in sorted(set(LIFT_SWEEP) - {chosen[src]["prefetch_min_lift"]}):
            jobs.append(Job(src, "hybrid_threshold_prefetch", mid, split="sweep", knobs=(*base, ("min_lift", t))))
        # Ablation: the chosen lift with the global transition table only (no per-domain tables).
        knobs = (*knobs_for("hybrid_threshold_prefetch", chosen[src]), ("domain_transitions", None))
        jobs.append(Job(src, "hybrid_threshold_prefetch", mid, split="ablation", knobs=knobs))
        if src == "esft":
            for pol in ("lru", "lfru", "static_domain", "hybrid", "xlayer_prefetch", "belady"):
                jobs.append(Job(src, pol, mid, split="swapped", knobs=knobs_for(pol, chosen[src])))
    results = run_jobs(jobs, n_jobs)
    return {"knobs": chosen, "results": results}


def report(out: dict[str, Any], sources: Sequence[str], knobs: dict[str, Any], results: list) -> None:
    for src in sources:
        ctx = _CONTEXT[src]
        trace: Trace = ctx["trace"]
        entry: dict[str, Any] = {
            "model": {"n_layer": trace.n_layer, "n_expert": trace.n_expert, "top_k": trace.top_k},
            "note": trace.note,
            "expert_bytes": trace.expert_bytes,
            "expert_bytes_note": trace.bytes_note,
            "split": {
                "profile_sequences": len(ctx["profile_seqs"]),
                "profile_tokens": int(np.isin(trace.seq, ctx["profile_seqs"]).sum()),
                "test_sequences": len(ctx["test_seqs"]),
                "test_tokens": int(ctx["streams"]["test"].n_tokens),
                "domains": trace.domains(),
            },
            "knobs": knobs[src],
            "capacities": capacities(trace.n_expert),
            "policies": defaultdict(dict),
            "noisy_domain": defaultdict(lambda: defaultdict(dict)),
            "prefetch_sweep": {},
            "belady_without_bypass": {},
            "threshold_sweep": {},
            "threshold_global_table": {},
            "swapped_split": {},
        }
        for job, r in results:
            if job.source != src:
                continue
            r = {**r, "bytes_per_token": r["loads_per_token"] * trace.expert_bytes}
            if "prefetch" in r:
                r["prefetch"]["extra_bytes_per_token"] = r["prefetch"]["extra_loads_per_token"] * trace.expert_bytes
            knob = dict(job.knobs)
            if job.split == "swapped":
                entry["swapped_split"][job.policy] = {"capacity": job.capacity, **r}
            elif job.split == "sweep":
                entry["threshold_sweep"][str(knob["min_lift"])] = {"capacity": job.capacity, **r}
            elif job.split == "ablation":
                entry["threshold_global_table"] = {"capacity": job.capacity, "min_lift": knob["min_lift"], **r}
            elif job.accuracy < 1.0:
                label = "none" if job.accuracy == 0.0 else str(job.accuracy)
                entry["noisy_domain"][job.policy][label][str(job.capacity)] = r
            elif "n_predict" in knob:
                entry["prefetch_sweep"][str(knob["n_predict"])] = {"capacity": job.capacity, **r}
            elif knob.get("bypass") is False:
                entry["belady_without_bypass"] = {"capacity": job.capacity, **r}
            else:
                entry["policies"][job.policy][str(job.capacity)] = r
        out["sources"][src] = json.loads(json.dumps(entry))


def print_tables(out: dict[str, Any]) -> None:
    for src, entry in out["sources"].items():
        caps = [str(c) for c in entry["capacities"] if str(c) in entry["policies"]["lru"]]
        n = entry["model"]["n_expert"]
        print(f"\n{src}: hit rate % (held out) at capacity per layer of {n}; experts moved per token at the middle")
        print(f"  {'policy':<16}" + "".join(f"{c:>8}" for c in caps) + f"{'moved':>9}")
        mid = caps[1] if len(caps) > 1 else caps[0]
        for pol, by_cap in entry["policies"].items():
            row = "".join(f"{100 * by_cap[c]['hit_rate']:8.1f}" for c in caps)
            print(f"  {pol:<16}{row}{by_cap[mid]['loads_per_token']:9.1f}")
        for pol, by_acc in entry["noisy_domain"].items():
            for acc, by_cap in by_acc.items():
                row = "".join(f"{100 * by_cap[c]['hit_rate']:8.1f}" for c in caps)
                print(f"  {pol + '@' + acc:<16}{row}")
        pols = entry["policies"]
        d, lru, bel = pols[DEFAULT_POLICY][mid], pols["lru"][mid], pols["belady"][mid]
        print(
            f"  default {DEFAULT_POLICY} at {mid}/{n}: {100 * (d['hit_rate'] - lru['hit_rate']):+.1f} points vs LRU,"
            f" {100 * (d['hit_rate'] - bel['hit_rate']):+.1f} vs Belady"
        )


def markdown_tables(out: dict[str, Any]) -> str:
    """The study's tables (docs/cache-policy-study.md quotes them), from a results JSON."""
    lines: list[str] = []
    for src, entry in out["sources"].items():
        caps = [str(c) for c in entry["capacities"] if str(c) in entry["policies"]["lru"]]
        mid = caps[1] if len(caps) > 1 else caps[0]
        # MB for real experts, KB for the demo model's tiny ones.
        unit, scale = ("MB", 1e6) if entry["expert_bytes"] >= 1e6 else ("KB", 1e3)
        mb = entry["expert_bytes"] / scale
        n = entry["model"]["n_expert"]
        lines += [f"### {src}", "", f"Hit rate (%), held out, at capacity C of {n} experts per layer; experts moved"]
        lines += [f"per token at C = {mid} (one expert = {mb:.3g} {unit}, {entry['expert_bytes_note']}).", ""]
        lines.append(
            "| policy | " + " | ".join(f"C={c}" for c in caps) + f" | moved/token at {mid} | MB/token at {mid} |"
        )
        lines.append("|---" * (len(caps) + 3) + "|")
        for pol, by_cap in entry["policies"].items():
            cells = " | ".join(f"{100 * by_cap[c]['hit_rate']:.1f}" for c in caps)
            moved = by_cap[mid]["loads_per_token"]
            lines.append(f"| {pol} | {cells} | {moved:.1f} | {moved * mb:,.0f} |")
        for pol, by_acc in entry["noisy_domain"].items():
            for acc, by_cap in by_acc.items():
                label = "no domain" if acc == "none" else f"domain {float(acc):.0%} right"
                cells = " | ".join(f"{100 * by_cap[c]['hit_rate']:.1f}" for c in caps)
                lines.append(f"| {pol}, {label} | {cells} | {by_cap[mid]['loads_per_token']:.1f} | |")
        lines.append("")
        doms = entry["split"]["domains"]
        lines += [f"Per domain at C = {mid} (%):", "", "| policy | " + " | ".join(doms) + " |"]
        lines.append("|---" * (len(doms) + 1) + "|")
        for pol, by_cap in entry["policies"].items():
            per = by_cap[mid]["hit_rate_by_domain"]
            lines.append(f"| {pol} | " + " | ".join(f"{100 * per.get(d, float('nan')):.1f}" for d in doms) + " |")
        lines.append("")
        main_run = entry["policies"]["xlayer_prefetch"][mid]
        sweep = {main_run["prefetch"]["n_predict"]: main_run}
        sweep.update({int(k): v for k, v in entry["prefetch_sweep"].items()})
        lines += [f"Cross-layer prefetch (over LRU) at C = {mid}:", ""]
        head = "predicted per layer | hit rate % | precision % | recall % | prefetch loads/token"
        lines.append(f"| {head} | unused (extra) loads/token | extra {unit}/token | moved/token |")
        lines.append("|---" * 8 + "|")
        for k in sorted(sweep):
            r = sweep[k]
            pf = r["prefetch"]
            lines.append(
                f"| {k} | {100 * r['hit_rate']:.1f} | {100 * pf['precision']:.1f} | {100 * pf['recall']:.1f} | "
                f"{pf['loads_per_token']:.1f} | {pf['extra_loads_per_token']:.1f} | "
                f"{pf['extra_loads_per_token'] * mb:,.0f} | {r['loads_per_token']:.1f} |"
            )
        lines.append("")
        lines += threshold_table(entry, mid, mb, unit)
        if entry["swapped_split"]:
            sw = entry["swapped_split"]
            lines += [f"Roles of the two halves swapped, C = {mid}: "]
            lines[-1] += ", ".join(f"{p} {100 * r['hit_rate']:.1f}" for p, r in sw.items()) + "."
            lines.append("")
        if entry["belady_without_bypass"]:
            b = entry["belady_without_bypass"]
            lines += [f"Belady without bypass (every miss kept) at C = {mid}: {100 * b['hit_rate']:.1f}.", ""]
    return "\n".join(lines)


def threshold_table(entry: dict[str, Any], mid: str, mb: float, unit: str) -> list[str]:
    """Threshold prefetch over the hybrid at the middle capacity, per minimum lift, next to LRU's bytes."""
    main_run = entry["policies"].get("hybrid_threshold_prefetch", {}).get(mid)
    if main_run is None:
        return []
    chosen = float(entry["knobs"]["prefetch_min_lift"])
    chance = entry["model"]["top_k"] / entry["model"]["n_expert"]
    sweep: dict[float, dict[str, Any]] = {float(k): v for k, v in entry["threshold_sweep"].items()}
    sweep[chosen] = main_run
    lru = entry["policies"]["lru"][mid]
    lines = [
        f"Threshold prefetch over the hybrid at C = {mid}: a prediction is loaded if P(b at l+1) > lift x chance "
        f"({entry['model']['top_k']}/{entry['model']['n_expert']}); lift chosen on the inner split: {chosen}.",
        "",
    ]
    head = "min lift (P >) | hit rate % | Δ vs LRU | moved/token | moved vs LRU | prefetch loads/token"
    lines.append(f"| {head} | unused loads/token | loads used % | extra {unit}/token |")
    lines.append("|---" * 9 + "|")
    rows: list[tuple[str, dict[str, Any]]] = []
    for k, r in sorted(sweep.items()):
        label = f"{k} ({k * chance:.2f})"
        rows.append((f"**{label}**" if k == chosen else label, r))
    if entry["threshold_global_table"]:
        g = entry["threshold_global_table"]
        rows.append((f"{g['min_lift']} ({g['min_lift'] * chance:.2f}), global table only", g))
    for label, r in rows:
        pf = r["prefetch"]
        used = 1 - pf["extra_loads_per_token"] / pf["loads_per_token"] if pf["loads_per_token"] else 0.0
        lines.append(
            f"| {label} | {100 * r['hit_rate']:.1f} | {100 * (r['hit_rate'] - lru['hit_rate']):+.1f} | "
            f"{r['loads_per_token']:.1f} | {r['loads_per_token'] / lru['loads_per_token']:.2f}x | "
            f"{pf['loads_per_token']:.1f} | {pf['extra_loads_per_token']:.1f} | {100 * used:.0f} | "
            f"{pf['extra_loads_per_token'] * mb:,.0f} |"
        )
    lines.append("")
    return lines


def plot(out: dict[str, Any], path: Path) -> None:
    """Top: hit rate vs capacity, one line per policy, Belady dashed. Bottom: experts moved per token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = list(out["sources"])
    fig, axes = plt.subplots(2, len(sources), figsize=(5.4 * len(sources), 8.4), squeeze=False)
    for col, src in enumerate(sources):
        entry = out["sources"][src]
        for pol, by_cap in entry["policies"].items():
            caps = sorted(by_cap, key=int)
            xs = [int(c) for c in caps]
            if pol == "belady":
                style: dict[str, Any] = {"color": "black", "linestyle": "--", "linewidth": 2}
            else:
                style = {"linewidth": 2.6 if pol == DEFAULT_POLICY else 1.2, "marker": "o", "markersize": 3}
            label = pol + (" (default)" if pol == DEFAULT_POLICY else "")
            axes[0][col].plot(xs, [100 * by_cap[c]["hit_rate"] for c in caps], label=label, **style)
            axes[1][col].plot(xs, [by_cap[c]["loads_per_token"] for c in caps], label=label, **style)
        m = entry["model"]
        axes[0][col].set_title(f"{src}: {m['n_layer']} layers, {m['n_expert']} experts, top-{m['top_k']}")
        axes[0][col].set_ylabel("hit rate, held out (%)")
        axes[1][col].set_ylabel("experts moved per token (log)")
        axes[1][col].set_yscale("log")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("capacity (experts per layer)")
            ax.set_xticks(entry["capacities"])
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "cache_policies.json")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--quick", action="store_true", help="middle capacity only")
    parser.add_argument("--no-doc-plot", action="store_true", help=f"do not copy the plot to {DOC_PLOT}")
    parser.add_argument("--tables", type=Path, metavar="JSON", help="print the markdown tables of a results file")
    args = parser.parse_args(argv)
    if args.tables:
        print(markdown_tables(json.loads(args.tables.read_text())))
        return 0
    started = time.perf_counter()
    data = routing_data()
    if not esft_npz(data).is_file():
        print(f"routing data not found at {data} (set MOE_L2_ROUTING_DATA)", file=sys.stderr)
        return 2
    traces = [load_esft(data)]
    if (data / "Mario928__speculative-moe").is_dir():
        traces.append(load_mixtral(data))
    if ensure_demo_traces(DEMO_TRACES):
        traces.append(load_demo(DEMO_TRACES))
    for trace in traces:
        _CONTEXT[trace.source] = prepare(trace)
    sources = [t.source for t in traces]
    done = study(sources, args.jobs, args.quick)
    out: dict[str, Any] = {
        "benchmark": "cache_policies",
        "default_policy": DEFAULT_POLICY,
        "method": {
            "split": "per domain, a seeded random half of the sequences (seed 0) is the profile split; the other "
            "half is measured. Knobs (LFRU half-life; hybrid half-life, prior and fill weights) are chosen on an "
            "inner split of the profile split at the middle capacity; then, over that hybrid, the admission margin "
            "(best hit rate) and the prefetch's minimum lift over chance (best hit rate among those moving no more "
            "experts per token "
            "than LRU on the inner split).",
            "order": "test requests of all domains replayed in one seeded shuffled order, token by token",
            "hit": "an activated expert that was resident when its layer ran; prefetched experts count as resident",
            "loads": "experts copied into the cache per token: every miss, plus prefetches and prior fills",
            "noisy_domain": "per request the policy gets the true domain with probability p, else another at random",
            "belady": "offline optimum with bypass for demand caching; prefetching policies are not bounded by it",
        },
        "seed": SEED,
        "data": str(data),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "jobs": args.jobs},
        "sources": {},
    }
    report(out, sources, done["knobs"], done["results"])
    esft_knobs = done["knobs"]["esft"]
    # make_policy's defaults are the knobs ESFT chose; say so if a change in data or grid moved them.
    out["registry_defaults"] = registry_knobs()
    out["registry_defaults_match_esft_search"] = all(esft_knobs[k] == v for k, v in registry_knobs().items())
    if not out["registry_defaults_match_esft_search"]:
        print(f"note: the ESFT knob search chose {esft_knobs}, make_policy defaults differ", file=sys.stderr)
    out["seconds"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    png = args.out.with_suffix(".png")
    plot(out, png)
    if not args.no_doc_plot and not args.quick:
        shutil.copyfile(png, DOC_PLOT)
    print_tables(out)
    args.out.with_suffix(".md").write_text(markdown_tables(out) + "\n")
    print(f"\nwrote {args.out} and {png} in {out['seconds']:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
