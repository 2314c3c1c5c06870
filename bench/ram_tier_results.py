"""bench/ram_tier.py's figures: each config's medians and maxima at a budget, the ratios against stock, the
check that greedy decoding gave every config the same text, and the table."""

from __future__ import annotations

import os
import platform

from harness.output import fmt_num, meminfo_bytes
from harness.timing import median
from ram_tier_inputs import ModelBytes
from ram_tier_runs import ConfigRun
from ram_tier_services import CONFIGS, DEFAULT_CONFIGS


def machine() -> dict:
    return {
        "mem_total_bytes": meminfo_bytes("MemTotal"),
        "mem_available_bytes_at_start": meminfo_bytes("MemAvailable"),
        "swap_total_bytes": meminfo_bytes("SwapTotal"),
        "cpu_count": os.cpu_count(),
        "kernel": platform.release(),
        "platform": platform.platform(),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; 0 / 0 is 1.0 (neither faulted nor read: no difference), x / 0 is undefined (None)."""
    if a is None or b is None:
        return None
    if b == 0:
        return 1.0 if a == 0 else None
    return a / b


def summarize_config(runs: list[ConfigRun]) -> dict:
    samples = [s for r in runs for s in r.samples]
    block = [x for s in samples if (x := s.block_read_bytes_per_token) is not None]
    budget = runs[0].budget_bytes if runs else 0
    max_res = max((r.max_resident_bytes for r in runs), default=0)
    return {
        "decode_tokens_per_s": median([s.decode_tps for s in samples]),
        "prompt_tokens_per_s": median([s.prompt_tps for s in samples]),
        "majflt_per_token": median([s.majflt_per_token for s in samples]),
        "read_bytes_per_token": median([s.read_bytes_per_token for s in samples]),
        "block_read_bytes_per_token": median(block),
        "max_model_resident_bytes": max_res,
        "max_rss_file_bytes": max((r.max_rss_file_bytes for r in runs), default=0),
        "max_rss_anon_bytes": max((r.max_rss_anon_bytes for r in runs), default=0),
        "budget_bytes": budget,
        "resident_within_budget": max_res <= budget,
        "residency_samples": sum(r.residency_samples for r in runs),
        "requests": len(samples),
    }


def greedy_check(runs: list[ConfigRun]) -> tuple[bool, list[dict]]:
    """Every request index's text must be the same in every run (config, round, budget)."""
    texts: dict[int, dict[str, str]] = {}
    for r in runs:
        for s in r.samples:
            texts.setdefault(s.request, {})[f"{s.config}/b{s.budget_pct:g}/r{s.round}"] = s.text
    mismatches = [
        {"request": i, "texts": by_run} for i, by_run in sorted(texts.items()) if len(set(by_run.values())) > 1
    ]
    both = {s.config for r in runs for s in r.samples} >= {"stock", "moe-l2"}
    return both and not mismatches, mismatches


def ratios(x: dict, stock: dict) -> dict[str, float | None]:
    keys = ("decode_tokens_per_s", "majflt_per_token", "read_bytes_per_token", "block_read_bytes_per_token")
    return {k: ratio(x[k], stock[k]) for k in keys}


def summarize(
    runs: list[ConfigRun], budgets: list[float], mb: ModelBytes, configs: tuple[str, ...] = DEFAULT_CONFIGS
) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for pct in budgets:
        at = [r for r in runs if r.budget_pct == pct]
        per = {c: summarize_config([r for r in at if r.config == c]) for c in configs}
        identical, mismatches = greedy_check(at)
        out[f"{pct:g}"] = {
            "budget_pct_of_expert_bytes": pct,
            "budget_bytes": mb.budget(pct),
            "configs": per,
            "ratios_moe_l2_vs_stock": ratios(per["moe-l2"], per["stock"]),
            "greedy_identical": identical,
            "greedy_mismatches": mismatches,
        }
        if "willneed" in per:
            out[f"{pct:g}"]["ratios_willneed_vs_stock"] = ratios(per["willneed"], per["stock"])
    return out


def table(pct: str, b: dict) -> str:
    lines = [
        f"budget {pct}% of the expert bytes = {b['budget_bytes'] / 2**30:.2f} GiB (with the non-expert bytes)",
        "",
        "| config | decode tok/s | majflt/token | read MB/token (proc) | read MB/token (block dev) "
        "| max model resident GiB | max RssFile GiB | resident <= budget |",
        "|" + " --- |" * 8,
    ]
    for c in (c for c in CONFIGS if c in b["configs"]):
        x = b["configs"][c]
        lines.append(
            f"| {c} | {fmt_num(x['decode_tokens_per_s'], '.2f')} | {fmt_num(x['majflt_per_token'], '.1f')} "
            f"| {fmt_num(x['read_bytes_per_token'] and x['read_bytes_per_token'] / 1e6, '.3f')} "
            f"| {fmt_num(x['block_read_bytes_per_token'] and x['block_read_bytes_per_token'] / 1e6, '.3f')} "
            f"| {x['max_model_resident_bytes'] / 2**30:.3f} | {x['max_rss_file_bytes'] / 2**30:.3f} "
            f"| {'pass' if x['resident_within_budget'] else 'FAIL'} |"
        )
    for c in ("willneed", "moe_l2"):
        if (r := b.get(f"ratios_{c}_vs_stock")) is None:
            continue
        x = {k: "-" if v is None else f"{v:.2f}x" for k, v in r.items()}
        lines.append(
            f"| {c.replace('_', '-')} / stock | {x['decode_tokens_per_s']} | {x['majflt_per_token']} "
            f"| {x['read_bytes_per_token']} | {x['block_read_bytes_per_token']} | | | |"
        )
    lines.append(
        f"\ngreedy output identical (stock vs moe-l2, every prompt): {'yes' if b['greedy_identical'] else 'NO'}"
    )
    return "\n".join(lines)
