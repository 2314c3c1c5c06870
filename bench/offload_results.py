"""bench/expert_offload.py's rows: each config's figures (medians, paired ratios against b, the derived or
measured host→device bytes, the device memory it held), the engine's own lines from its log, and the rows of
the configs that did not run, with the reason."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.timing import median, paired_ratio
from offload_bytes import CACHE_COUNTERS
from offload_configs import NOT_BUILT, Config, ExpertLayout, concurrency
from offload_device import buffer_sizes, is_device_buffer
from offload_replay import keep_access_log, replay_check
from offload_servers import Server


def summarize(s: Server, base: Server, log_text: str) -> dict:
    """A measured row: its medians and, run by run, its ratios to b's (the runs took turns: each pair ran in
    the same round), the host→device bytes, and the device memory llama-server says it holds."""
    buffers = buffer_sizes(log_text)
    device = {name: sum(kinds.values()) for name, kinds in buffers.items() if is_device_buffer(name)}
    prompt_per_token = [b / n for b, n in zip(s.prompt_h2d, s.prompt_tokens, strict=True) if n]
    decode_per_token = [b / n for b, n in zip(s.decode_h2d, s.decode_steps, strict=True) if n]
    cache = None
    if s.decode_cache:
        total = {k: sum(d[k] for d in s.decode_cache) for k in CACHE_COUNTERS}
        cache = {
            "decode_hit_rate": total["hits"] / total["accesses"] if total["accesses"] else None,
            "decode_totals": total,
            "h2d_bytes": "measured: the cache's own counters (loads and bypassed copies), not derived",
        }
    return {
        "config": s.config.name,
        "what": s.config.what,
        "status": "measured",
        "base": s.config.base,
        "load_mode": s.config.load_mode,
        "policy": s.config.policy,
        "host_experts_log": host_experts_line(log_text),
        "prompt_ahead_log": prompt_ahead_line(log_text),
        "start_seconds": s.start_seconds,
        "concurrent": s.concurrent,
        "expert_cache": cache,
        "server_args": s.args,
        "env": s.env,
        "n_cpu_moe": s.n_cpu_moe,
        "host_expert_layers": s.host_layers,
        "offload_min_batch": s.min_batch,
        "device_expert_bytes": s.device_expert_bytes,
        "device_buffers_bytes": device,
        "device_memory_bytes": sum(device.values()) if device else None,
        "buffers": buffers,
        "prompt_tokens_per_s": median(s.prompt_tps),
        "decode_tokens_per_s": median(s.decode_tps),
        "prompt_ratio_vs_b": paired_ratio(s.prompt_tps, base.prompt_tps),
        "decode_ratio_vs_b": paired_ratio(s.decode_tps, base.decode_tps),
        "h2d_expert_bytes_per_token_derived": {
            "prompt": median(prompt_per_token),
            "decode": median(decode_per_token),
        },
        "runs": {
            "prompt_tokens_per_s": s.prompt_tps,
            "decode_tokens_per_s": s.decode_tps,
            "prompt_tokens": s.prompt_tokens,
            "decode_tokens": s.decode_tokens,
            "decode_steps": s.decode_steps,
            "decode_request_prompt_tokens": s.reevaluated,
            "prompt_h2d_expert_bytes_derived": s.prompt_h2d,
            "decode_h2d_expert_bytes_derived": s.decode_h2d,
            "decode_expert_cache": s.decode_cache,
        },
    }


HOST_EXPERTS_LOG = "expert cache: host experts"  # the engine's one line saying where it keeps the experts
MISSES_FROM_LOG = "expert cache: misses are copied from"  # the cache's line: pinned, or pageable and why
PROMPT_AHEAD_LOG = "a prompt's misses copied one expert tensor ahead"  # patch 0021 on
NO_PROMPT_AHEAD_LOG = "no copies one tensor ahead for prompts"  # patch 0021 off, and why


def prompt_ahead_line(log_text: str) -> str | None:
    """The engine's line saying whether a prompt's copies run one expert tensor ahead (patch 0021), and why
    not, if any."""
    found = [line.strip() for line in log_text.splitlines() if PROMPT_AHEAD_LOG in line or NO_PROMPT_AHEAD_LOG in line]
    return " | ".join(found) or None


def host_experts_line(log_text: str) -> str | None:
    """The engine's lines naming its choice of host memory for the experts (pinned or mapped) and where
    the cache's misses come from (pinned, or pageable: mapped or refused; through the ring or not),
    joined by " | ", if any."""
    found = [line.strip() for line in log_text.splitlines() if HOST_EXPERTS_LOG in line or MISSES_FROM_LOG in line]
    return " | ".join(found) or None


def concurrent_row(s: Server, log_text: str) -> dict:
    """An -np N server's row: its concurrent rounds' figures, how it ran, the engine's lines."""
    c = s.config
    row = {"config": c.name, "what": c.what, "status": "measured", "base": c.base}
    row |= {"concurrent": s.concurrent, "server_args": s.args, "env": s.env}
    row |= {"host_experts_log": host_experts_line(log_text), "start_seconds": s.start_seconds}
    return row | {"prompt_ahead_log": prompt_ahead_line(log_text)}


def config_rows(
    configs: list[Config],
    servers: dict[str, Server],
    logs: dict[str, str],
    skipped: dict[str, str],
    args: argparse.Namespace,
    layout: ExpertLayout,
    profile_note: str,
    device_expert_c: int,
) -> dict[str, dict]:
    """Every config's row, in `configs`' order: measured (a cache row with the replay check of its access
    log), too big for the device (`skipped`'s reason), or not in this binary (e without the expert cache)."""
    rows: dict[str, dict] = {}
    for c in configs:
        key = c.key
        if key in servers and concurrency(c) > 1:
            rows[key] = concurrent_row(servers[key], logs[key])
        elif key in servers:
            s = servers[key]
            rows[key] = summarize(s, servers["b"], logs[key])
            log_file = Path(s.env.get("LLAMA_ARG_MOE_CACHE_LOG", "/nonexistent"))
            if rows[key]["expert_cache"] and s.final_cache and log_file.is_file():
                check = replay_check(s, args, layout)
                if not check["equal"]:
                    check["access_log_kept"] = keep_access_log(log_file, args.out, key).name
                rows[key]["expert_cache"]["replay_check"] = check
                rows[key]["expert_cache"]["profile"] = profile_note
        elif key in skipped:
            rows[key] = {"config": c.name, "what": c.what, "status": skipped[key]}
        elif c.base == "e":
            rows[key] = {"config": c.name, "what": c.what, "status": NOT_BUILT, "device_expert_bytes": device_expert_c}
    return rows


def row_notes(rows: dict[str, dict]) -> list[str]:
    """The lines under the tables: each cache row's replay check, the engine's own lines, the -np N rounds."""
    lines = []
    for key, row in rows.items():
        check = (row.get("expert_cache") or {}).get("replay_check")
        if check:
            lines.append(
                f"{key}: {check['slots']} slots per layer; engine vs Python replay of its access log "
                f"{'EQUAL' if check['equal'] else 'DIFFERENT'}: {check['engine']} vs {check['replay']}; "
                f"profile: {row['expert_cache']['profile']}"
            )
        if row.get("host_experts_log"):
            lines.append(f"{key}: {row['host_experts_log']}")
        if row.get("prompt_ahead_log"):
            lines.append(f"{key}: {row['prompt_ahead_log']}")
        if row.get("concurrent"):
            lines.append(f"{key}: {row['concurrent']['summary']}")
    return lines
