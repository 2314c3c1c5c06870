"""bench/expert_offload.py's Markdown tables: the configs' rows, and the project's rows against the best stock row
at equal device memory (versus_best_stock: the figures the JSON's `versus_best_stock` holds). Pure functions of
the rows, no server."""

from __future__ import annotations

from collections.abc import Mapping

from harness.output import fmt_num


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def fmt_mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def table(rows: dict[str, dict]) -> str:
    """The results as a Markdown table; host→device bytes are derived, as the header says."""
    head = (
        "| config | placement | device experts MB | device mem MB (llama) | prompt tok/s | vs b | decode tok/s "
        "| vs b | H2D expert MB/token prompt (derived) | H2D expert MB/token decode (derived) | cache hit rate |"
    )
    lines = [head, "|" + " --- |" * 11]
    for key, r in rows.items():
        if r.get("concurrent") is not None or (r["status"] == "measured" and "decode_tokens_per_s" not in r):
            continue  # an -np N row: its own line under the table
        if r["status"] != "measured":
            lines.append(
                f"| {key} {r['config']} | {r['what']} | {fmt_mb(r.get('device_expert_bytes'))} | - "
                f"| {r['status']} | - | - | - | - | - | - |"
            )
            continue
        h2d = r["h2d_expert_bytes_per_token_derived"]
        n = "" if r["n_cpu_moe"] is None else f" (N={r['n_cpu_moe']})"
        lines.append(
            f"| {key} {r['config']} | {r['what'].split(':')[0]}{n} "
            f"| {fmt_mb(r['device_expert_bytes'])} | {fmt_mb(r['device_memory_bytes'])} "
            f"| {fmt_num(r['prompt_tokens_per_s'], '.1f')} | {fmt_num(r['prompt_ratio_vs_b'], '.2f')} "
            f"| {fmt_num(r['decode_tokens_per_s'], '.2f')} | {fmt_num(r['decode_ratio_vs_b'], '.2f')} "
            f"| {fmt_mb(h2d['prompt'])} | {fmt_mb(h2d['decode'])} "
            f"| {fmt_pct((r.get('expert_cache') or {}).get('decode_hit_rate'))} |"
        )
    return "\n".join(lines)


def versus_best_stock(rows: Mapping[str, dict]) -> dict[str, dict]:
    """Each of the project's rows (the expert cache, e and its variants) against the best stock row at
    no more device expert bytes: the fastest of b, c, d and their pinned variants, decode and prompt
    each on its own (the best decode and the best prompt may be different rows), as the median of each
    side's runs. Stock rows that hold more device memory than the cache (a, c at a larger budget) are
    not its competitors at equal device memory."""
    measured = {k: r for k, r in rows.items() if r.get("status") == "measured" and r.get("decode_tokens_per_s")}
    out: dict[str, dict] = {}
    for key, row in measured.items():
        if row.get("base") != "e":
            continue
        budget = row["device_expert_bytes"]
        stock = {k: r for k, r in measured.items() if r.get("base") in ("b", "c", "d")}
        fair = {k: r for k, r in stock.items() if r["device_expert_bytes"] <= budget}
        entry: dict = {"device_expert_bytes": budget, "stock_rows": sorted(fair)}
        for what in ("decode", "prompt"):
            metric = f"{what}_tokens_per_s"
            scored = {k: r[metric] for k, r in fair.items() if r.get(metric)}
            if not scored or not row.get(metric):
                entry[what] = None
                continue
            best = max(scored, key=lambda k: scored[k])
            entry[what] = {
                "best_stock": best,
                "best_stock_tokens_per_s": scored[best],
                "tokens_per_s": row[metric],
                "ratio": row[metric] / scored[best],
            }
        out[key] = entry
    return out


def versus_table(versus: Mapping[str, dict]) -> str:
    """The project's rows against the best stock row at equal device memory, ratios side by side."""
    lines = [
        "| row | device experts MB | decode tok/s | best stock decode | ratio "
        "| prompt tok/s | best stock prompt | ratio |",
        "|" + " --- |" * 8,
    ]
    for key, v in versus.items():
        cells = [key, fmt_mb(v["device_expert_bytes"])]
        for what in ("decode", "prompt"):
            w = v.get(what)
            if w is None:
                cells += ["-", "-", "-"]
            else:
                cells += [
                    f"{w['tokens_per_s']:.1f}",
                    f"{w['best_stock']} {w['best_stock_tokens_per_s']:.1f}",
                    f"**{w['ratio']:.2f}**",
                ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
