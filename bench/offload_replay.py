"""The expert cache's profile and its check: the tables fitted on the trace's sequences no request replays,
pushed to e before its runs, and the Python policy's replay of e's access log against e's own counters (equal
for a correct engine; a log that differs comes back compressed beside the JSON)."""

from __future__ import annotations

import argparse
import lzma
from pathlib import Path

import httpx
import numpy as np
from harness.servers import BenchError
from offload_configs import ExpertLayout
from offload_servers import Server

from moe_l2_contracts.admin import ADMIN_TOKEN_HEADER


def push_profile(url: str, body: dict, token: str) -> None:
    """One of held_out_profile's bodies into a cache server, before its runs."""
    resp = httpx.post(f"{url}/moe/cache/profile", json=body, headers={ADMIN_TOKEN_HEADER: token}, timeout=60)
    if resp.status_code != 200:
        raise BenchError(f"POST /moe/cache/profile: {resp.status_code} {resp.text[:300]}")


def held_out_profile(
    trace_file: Path, n_requests: int, n_expert: int, seq_tags: list[str] | None, exclude: frozenset[int] = frozenset()
) -> tuple[list[dict], object, str]:
    """The tables of the trace's sequences that no request of this run replays (request r replays
    sequence r; `exclude`: those the -np N servers replay): the transitions of them all as the profile
    of no domain and, with `seq_tags` (each sequence's domain), each domain's prior and transitions.
    (POST bodies, decoded tables for the replay, a note.)"""
    from moe_l2_cache.policy.profile import fit_profile
    from moe_l2_cache.policy.replay import DomainTables
    from moe_l2_contracts.schemas.llama import ExpertCacheProfile, decode_f32
    from moe_l2_llama.route_trace import read_route_trace

    trace = read_route_trace(trace_file)
    if trace.n_seq <= n_requests:
        raise BenchError(f"the trace has {trace.n_seq} sequences, the run replays {n_requests}: none left to fit on")
    fit = [q for q in range(n_requests, trace.n_seq) if q not in exclude]
    ids = np.concatenate([trace.sequence(q) for q in fit])
    lengths = np.diff(trace.offsets)[fit]
    labels = np.repeat([seq_tags[q] for q in fit], lengths) if seq_tags else np.full(len(ids), "all")
    fitted = fit_profile(ids, list(labels), n_expert)
    bodies = [ExpertCacheProfile.from_tables(None, transitions=fitted.transitions)]
    if seq_tags:
        for tag in sorted(fitted.domain_freq):
            freq, trans = fitted.domain_freq[tag], fitted.domain_transitions[tag]
            bodies.append(ExpertCacheProfile.from_tables(tag, freq=freq, transitions=trans))
    freq_shape, trans_shape = (trace.n_layer, n_expert), (trace.n_layer - 1, n_expert, n_expert)
    tables = {
        b.domain: DomainTables(freq=decode_f32(b.freq, freq_shape), transitions=decode_f32(b.transitions, trans_shape))
        for b in bodies
    }
    note = (
        f"tables fitted on the trace's sequences {n_requests}..{trace.n_seq - 1}"
        + (f" less the {len(exclude)} the -np servers replay" if exclude else "")
        + f" ({len(ids)} tokens), none of which this run replays; "
        + (
            "requests tagged with their sequence's ESFT task: per-domain priors and transitions"
            if seq_tags
            else "requests untagged (no domain prior)"
        )
    )
    return [b.model_dump() for b in bodies], tables, note


def keep_access_log(log_file: Path, out: Path, key: str) -> Path:
    """An access log whose replay differs from the engine's counters, xz-compressed next to the JSON
    (`<json stem>-<key>-access.log.xz`), so that what comes back from a GPU machine holds what it takes
    to find the difference (the CUDA runs of 2026-12-04 differed by a hit and a few prefetches, and
    their logs stayed on the machine)."""
    kept = out.parent / f"{out.stem}-{key}-access.log.xz"
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_bytes(lzma.compress(log_file.read_bytes()))
    return kept


def replay_check(s: Server, args: argparse.Namespace, layout: ExpertLayout) -> dict:
    """The Python policy's replay of e's access log, with the same profile, against e's counters."""
    from moe_l2_cache.policy.replay import read_access_log, replay_accesses

    engine = s.final_cache
    replay = replay_accesses(
        read_access_log(Path(s.env["LLAMA_ARG_MOE_CACHE_LOG"])),
        s.config.policy or "default",
        len(layout.expert_bytes),
        layout.n_expert,
        engine["slots"],
        layout.n_expert_used,
        args.profile_tables,
    )
    pairs = {
        "accesses": (replay.accesses, engine.get("accesses_total")),
        "hits": (replay.hits, engine.get("hits_total")),
        "loads": (replay.loads, engine.get("loads_total")),
        "prefetch": (replay.prefetch, engine.get("prefetch_total")),
        "prefetch_used": (replay.prefetch_used, engine.get("prefetch_used_total")),
    }
    return {
        "slots": engine["slots"],
        "replay": {k: r for k, (r, _) in pairs.items()},
        "engine": {k: e for k, (_, e) in pairs.items()},
        "equal": all(r == e for r, e in pairs.values()),
        "hit_rate_all_accesses": replay.hit_rate,
    }
