"""Entries the cache-manager cannot use, skipped and counted rather than trusted.

Redis keeps whatever it was given, across restarts: one bad entry that stopped the service would
stop it at every start. So every read of Redis, and every routing snapshot from llama, checks what
it gets; what does not fit is skipped, counted per kind (`/v1/stats` flywheel.skipped and
`moe_l2_cache_skipped_entries_total{kind}`) and logged once per kind, never once per key per pull.

Kinds:
  domain          a reserved, malformed or unknown domain in Redis (domain set member, routing or
                  hot-set key, tokens field, the remembered active domain)
  routing_key     a routing hash of a layer the model has no experts in, or with no layer at all
  routing_field   a routing hash field that is not an expert of the model or whose count is not
                  a finite, non-negative number
  transitions_key   a transitions hash of a layer pair the model does not route both of, or of no layer
  transitions_field a transitions hash field that is not "a:b" of two experts of the model, or whose
                  count is not a finite, non-negative number
  tokens_field    a tokens count that is not a non-negative integer
  hotset          a stored hot set that does not parse or does not fit the model
  wrong_type      a key of the wrong Redis type (moved aside to moe:{model}:quarantine:...)
  unknown_key     a key under the model's prefix that the service does not know (left alone)
  snapshot_domain a domain of llama's routing snapshot that is not accepted (its counts are dropped)
  snapshot_cell   a layer or expert of llama's routing snapshot that the model does not have (or
                  transitions of the wrong size or of a layer pair without routed experts)

Redis entries are counted once each (the same garbage read at every pull is one entry), up to
MAX_TRACKED distinct entries; past that each read counts. Snapshot entries count each time.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

MAX_TRACKED = 100_000


class SkipCounter:
    def __init__(self, max_tracked: int = MAX_TRACKED) -> None:
        self.max_tracked = max_tracked
        self.counts: dict[str, int] = {}
        self._seen: set[tuple[str, str]] = set()
        self._logged: set[str] = set()

    def skip(self, kind: str, entry: str | None, why: str) -> None:
        """Count one skipped entry of `kind`; `entry` names it (None: count every occurrence)."""
        if entry is not None:
            ident = (kind, entry)
            if ident in self._seen:
                return
            if len(self._seen) < self.max_tracked:
                self._seen.add(ident)
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if kind not in self._logged:
            self._logged.add(kind)
            # repr and a cap: entries come from Redis or llama and may hold anything
            shown = repr(entry)[:120] if entry is not None else ""
            log.warning(
                "skipped %s %s: %s (further %s entries are counted in moe_l2_cache_skipped_entries_total, not logged)",
                kind, shown, why, kind,
            )  # fmt: skip
