"""The predictor: runs the configured tiers on prompts and returns one calibrated answer each.

With several tiers the hybrid combines them (see combine.py). When the semantic tier is on, the
cheap tiers go first: if their combination is already confident (>= `early_exit`), the
semantic model is skipped for that prompt, which keeps the usual latency at the cheap tiers'.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moe_l2_contracts.schemas.predict import PredictResponse
from moe_l2_domains.taxonomy import Taxonomy, load_default_taxonomy, load_taxonomy
from moe_l2_predictor.artefacts import Artefacts, load_or_fit, load_stored
from moe_l2_predictor.dataset import calibration_set, training_set
from moe_l2_predictor.prompt import Prompt
from moe_l2_predictor.rules import LanguageRules
from moe_l2_predictor.settings import PredictorSettings
from moe_l2_predictor.tier_keyword import KeywordTier
from moe_l2_predictor.tier_semantic import (
    Encoder,
    SemanticTier,
    SemanticUnavailable,
    fingerprint_of,
    load_encoder,
)
from moe_l2_predictor.tier_tfidf import TfidfTier

log = logging.getLogger("moe_l2_predictor")

Timings = dict[str, float]  # tier -> seconds spent per prompt

# An absolute path inside a message (a model folder, a taxonomy file): /healthz is for clients,
# who are shown names and digests, never where things are on the host.
_HOST_PATH = re.compile(r"(?<![\w.~:/])/[^\s'\"`,;:()\[\]{}]+")


# What a semantic model that cannot be used raises: package or folder missing, unreadable files.
SEMANTIC_LOAD_ERRORS = (SemanticUnavailable, OSError)


def without_paths(message: str) -> str:
    """The message with every absolute path replaced by its last component."""
    return _HOST_PATH.sub(lambda m: Path(m.group(0).rstrip("/")).name or "/", message)


def stand_in_tiers(tiers: tuple[str, ...]) -> tuple[str, ...]:
    """The tiers that answer while the semantic tier is not (yet) usable: the configured cheap
    ones, or the keyword tier alone when only the semantic tier was configured (it needs no fit,
    and an answer beats none)."""
    return tuple(t for t in tiers if t != "semantic") or ("keyword",)


def load_semantic_encoder(settings: PredictorSettings) -> Encoder:
    """The semantic model (seconds: it imports torch and sentence-transformers), on
    `settings.threads` torch threads."""
    encoder = load_encoder(settings.semantic_model)
    encoder.set_threads(settings.threads)
    return encoder


@dataclass
class Outcome:
    response: PredictResponse
    tiers_run: tuple[str, ...]
    timings: Timings = field(default_factory=dict)


class Predictor:
    def __init__(
        self,
        taxonomy: Taxonomy,
        tiers: tuple[str, ...],
        artefacts: Artefacts | None = None,
        encoder: Encoder | None = None,
        early_exit: float = 0.9,
        unavailable: dict[str, str] | None = None,
        taxonomy_name: str | None = None,
    ) -> None:
        self.taxonomy = taxonomy
        # a name for /healthz: "shipped", or the replacement's file name (its path stays in the log)
        self.taxonomy_name = taxonomy_name or Path(taxonomy.source).name
        self.names = taxonomy.names
        self.k = len(self.names)
        self.tiers = tiers
        self.early_exit = early_exit
        self.unavailable = unavailable or {}
        self.rules = LanguageRules(taxonomy)
        self.artefacts = artefacts or Artefacts(key="")
        self.keyword = KeywordTier(taxonomy)
        self.tfidf = TfidfTier(self.artefacts.tfidf, self.rules, self.k) if self.artefacts.tfidf is not None else None
        self.semantic = (
            SemanticTier(encoder, self.artefacts.semantic_head, self.rules, self.k)
            if encoder is not None and self.artefacts.semantic_head is not None
            else None
        )
        missing = [t for t in tiers if t != "keyword" and getattr(self, t) is None]
        if missing:
            raise ValueError(f"tiers {missing} have no fitted model")
        self.cheap = tuple(t for t in tiers if t != "semantic")
        if len(tiers) > 1 and tiers not in self.artefacts.combiners:
            raise ValueError(f"no hybrid combiner fitted for {'+'.join(tiers)}")

    @classmethod
    def from_settings(cls, settings: PredictorSettings, refit: bool = False, cross_validate: bool = False) -> Predictor:
        """Every configured tier, loaded now (the CLI's way; the service loads the semantic tier
        in the background instead, see semantic_loader.py). A semantic model that cannot load
        disables that tier, logged and shown in /healthz: serving without it beats not serving."""
        tiers = settings.tier_list
        if "semantic" not in tiers:
            return cls.build(settings, tiers, refit=refit, cross_validate=cross_validate)
        try:
            encoder = load_semantic_encoder(settings)
        except SEMANTIC_LOAD_ERRORS as exc:
            log.error("semantic tier disabled: %s", exc)
            cheap = stand_in_tiers(tiers)
            unavailable = {"semantic": str(exc)}
            return cls.build(settings, cheap, unavailable=unavailable, refit=refit, cross_validate=cross_validate)
        return cls.build(settings, tiers, encoder, refit=refit, cross_validate=cross_validate)

    @classmethod
    def build(
        cls,
        settings: PredictorSettings,
        tiers: tuple[str, ...],
        encoder: Encoder | None = None,
        unavailable: dict[str, str] | None = None,
        refit: bool = False,
        cross_validate: bool = False,
    ) -> Predictor:
        """A predictor of `tiers` (the semantic one needs `encoder`): the taxonomy, then the
        cached artefacts of exactly these tiers (fitted if missing)."""
        taxonomy = load_taxonomy(settings.taxonomy_path) if settings.taxonomy_path else load_default_taxonomy()
        artefacts = None
        if set(tiers) - {"keyword"}:
            training = training_set(taxonomy, settings.data_path)
            artefacts = load_or_fit(
                settings.cache_dir,
                taxonomy,
                training,
                tiers,
                encoder,
                extra=settings.data_path,
                refit=refit,
                calibration=calibration_set(taxonomy),
                cross_validate=cross_validate,
            )
        name = settings.taxonomy_path.name if settings.taxonomy_path else "shipped"
        return cls(taxonomy, tiers, artefacts, encoder, settings.early_exit, unavailable, taxonomy_name=name)

    @classmethod
    def stand_in(cls, settings: PredictorSettings) -> Predictor:
        """The cheap tiers of the configuration (see `stand_in_tiers`), ready in the time it takes
        to read their artefacts: those of the full configuration when they are stored (an image's
        read-only folder holds only those), else their own, fitted if missing (seconds)."""
        tiers = stand_in_tiers(settings.tier_list)
        if tiers == ("keyword",):
            return cls.build(settings, tiers)
        taxonomy = load_taxonomy(settings.taxonomy_path) if settings.taxonomy_path else load_default_taxonomy()
        try:
            model = fingerprint_of(settings.semantic_model)
        except SEMANTIC_LOAD_ERRORS:
            model = None  # the background load will say why; the cheap tiers' own artefacts serve
        full = None
        if model is not None:
            full = load_stored(settings.cache_dir, taxonomy, settings.tier_list, model, settings.data_path)
        if full is None:
            return cls.build(settings, tiers)
        name = settings.taxonomy_path.name if settings.taxonomy_path else "shipped"
        return cls(taxonomy, tiers, full, None, settings.early_exit, taxonomy_name=name)

    @property
    def tier_label(self) -> str:
        return self.tiers[0] if len(self.tiers) == 1 else "hybrid"

    def _response(self, proba: np.ndarray, lang: str) -> PredictResponse:
        best = int(proba.argmax())
        return PredictResponse(
            domain=self.names[best],
            confidence=float(min(1.0, max(0.0, proba[best]))),
            lang=lang,
            tier=self.tier_label,  # type: ignore[arg-type]
            scores={name: round(float(p), 6) for name, p in zip(self.names, proba, strict=True)},
        )

    def predict(self, prompt: Prompt) -> Outcome:
        return self.predict_many([prompt])[0]

    def predict_many(self, prompts: Sequence[Prompt]) -> list[Outcome]:
        """Predictions for a batch: each tier runs once over all prompts that need it."""
        n = len(prompts)
        if n == 0:
            return []
        langs = [p.lang for p in prompts]
        timings: Timings = {}
        if self.tiers == ("keyword",):
            started = time.perf_counter()
            preds = [self.keyword.predict(p) for p in prompts]
            timings["keyword"] = (time.perf_counter() - started) / n
            return [
                Outcome(
                    PredictResponse(
                        domain=kp.domain, confidence=kp.confidence, lang=kp.lang, tier="keyword", scores=kp.scores
                    ),
                    ("keyword",),
                    timings,
                )
                for kp in preds
            ]
        probas: dict[str, np.ndarray] = {}
        for name in self.cheap:
            started = time.perf_counter()
            probas[name] = getattr(self, name).proba(prompts)
            timings[name] = (time.perf_counter() - started) / n
        final = np.zeros((n, self.k))
        ran = [self.cheap] * n
        need = np.arange(n)
        if len(self.cheap) > 1:
            cheap = self.rules.apply(
                self.artefacts.combiners[self.cheap].combine([probas[t] for t in self.cheap]), langs
            )
            final[:] = cheap
            if "semantic" in self.tiers:
                need = np.flatnonzero(cheap.max(axis=1) < self.early_exit)
        elif len(self.cheap) == 1 and "semantic" not in self.tiers:
            final[:] = probas[self.cheap[0]]
        if "semantic" in self.tiers and len(need):
            started = time.perf_counter()
            semantic = self.semantic.proba([prompts[i] for i in need])  # type: ignore[union-attr]
            timings["semantic"] = (time.perf_counter() - started) / len(need)
            if len(self.tiers) == 1:
                final[need] = semantic
            else:
                parts = [probas[t][need] if t != "semantic" else semantic for t in self.tiers]
                combined = self.artefacts.combiners[self.tiers].combine(parts)
                final[need] = self.rules.apply(combined, [langs[i] for i in need])
            for i in need:
                ran[i] = self.tiers
        return [Outcome(self._response(final[i], langs[i]), ran[i], timings) for i in range(n)]

    def describe(self) -> dict[str, object]:
        """What /healthz shows: names and digests, no host path."""
        return {
            "tiers": list(self.tiers),
            "unavailable": {tier: without_paths(reason) for tier, reason in self.unavailable.items()},
            "taxonomy": {"name": self.taxonomy_name, "digest": self.taxonomy.digest()[:16]},
            "semantic_model": self.semantic.encoder.fingerprint if self.semantic is not None else None,
            "artefacts": self.artefacts.key or None,
            "early_exit": self.early_exit if "semantic" in self.tiers and len(self.tiers) > 1 else None,
        }
