"""The semantic tier, loaded while the predictor already serves.

Loading it means importing torch and sentence-transformers and reading the encoder: seconds, and
over 15 s on a loaded 2-core machine. A restart used to wait for all of it before /healthz
answered, so every restart was a gap. The service now starts with a stand-in predictor of the
cheap tiers (keyword + TF-IDF), which is ready as soon as its artefacts are read; the lifespan
starts `load_semantic_tier`, which builds the full predictor in a worker thread and swaps it into
`app.state.predictor` when it is ready. A request reads that reference once, so each answer comes
whole from one predictor or the other. If loading fails, the failure is logged once, /healthz
shows it, and the stand-in keeps serving.

Each configured tier's state (`TierStatus`, kept in app.state) is "ready", "loading" or
"failed: <reason>" (the reason without host paths).
"""

from __future__ import annotations

import logging
import time

import anyio
from starlette.datastructures import State

from moe_l2_predictor.metrics import PredictorMetrics
from moe_l2_predictor.predictor import Predictor, load_semantic_encoder, without_paths
from moe_l2_predictor.settings import PredictorSettings

log = logging.getLogger("moe_l2_predictor")

READY = "ready"
LOADING = "loading"
FAILED = "failed"


class TierStatus:
    """Each configured tier's state: ready, loading, or failed: <reason> (no host paths)."""

    def __init__(self, configured: tuple[str, ...], serving: tuple[str, ...], unavailable: dict[str, str]) -> None:
        self.states: dict[str, str] = {}
        for tier in configured:
            if tier in unavailable:
                self.states[tier] = f"{FAILED}: {without_paths(unavailable[tier])}"
            else:
                self.states[tier] = READY if tier in serving else LOADING

    def set(self, tier: str, state: str) -> None:
        self.states[tier] = state  # on the event loop, like every reader

    def failures(self) -> dict[str, str]:
        """Tier -> reason, for the tiers that failed to load."""
        prefix = f"{FAILED}: "
        return {t: s.removeprefix(prefix) for t, s in self.states.items() if s.startswith(prefix)}


def load_full_predictor(settings: PredictorSettings) -> Predictor:
    """Every configured tier, the semantic one included: raises when it cannot load."""
    encoder = load_semantic_encoder(settings)
    return Predictor.build(settings, settings.tier_list, encoder)


async def load_semantic_tier(state: State, settings: PredictorSettings) -> None:
    """Build the full predictor off the event loop, then swap it in; on failure keep the stand-in.

    The worker thread is abandoned if the app shuts down meanwhile (a thread cannot be stopped;
    its result is then dropped)."""
    started = time.monotonic()
    status: TierStatus = state.tier_status
    try:
        full = await anyio.to_thread.run_sync(load_full_predictor, settings, abandon_on_cancel=True)
    except Exception as exc:  # whatever it was, the cheap tiers keep serving; said once, here
        reason = without_paths(str(exc)) or type(exc).__name__
        log.error("semantic tier failed to load (%s); serving tiers %s", exc, ",".join(state.predictor.tiers))
        status.set("semantic", f"{FAILED}: {reason}")
        show(state.metrics, state.predictor, status)
        return
    state.predictor = full
    status.set("semantic", READY)
    show(state.metrics, full, status)
    log.info("semantic tier ready after %.1fs: tiers %s", time.monotonic() - started, ",".join(full.tiers))


def show(metrics: PredictorMetrics, predictor: Predictor, status: TierStatus) -> None:
    """The metrics that describe what serves: the info line and each tier's readiness."""
    metrics.info.clear()
    metrics.info.labels(",".join(predictor.tiers), predictor.taxonomy.digest()[:16]).set(1)
    for tier, tier_state in status.states.items():
        metrics.tier_ready.labels(tier).set(1 if tier_state == READY else 0)
