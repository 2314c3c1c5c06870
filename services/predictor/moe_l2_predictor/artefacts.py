"""Fitted artefacts (TF-IDF model, semantic head, hybrid combiners): fitted once, cached on disk.

They are fitted at first start (or by `moe-l2 train-predictor`) from the taxonomy's examples plus
the optional labeled JSONL, and stored in the cache folder under a key that hashes everything
they depend on: taxonomy content, extra data, tiers, the semantic model, library versions. A new
taxonomy is a new key, so a stale model is never served; nothing is written into site-packages.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import logging
import os
import pickle
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import sklearn
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold
from sklearn.pipeline import Pipeline
from threadpoolctl import threadpool_limits

from moe_l2_domains.taxonomy import Taxonomy
from moe_l2_predictor import tier_semantic, tier_tfidf
from moe_l2_predictor.combine import Combiner, fit_combiner
from moe_l2_predictor.dataset import Labeled
from moe_l2_predictor.prompt import Prompt
from moe_l2_predictor.rules import LanguageRules
from moe_l2_predictor.tier_keyword import KeywordTier
from moe_l2_predictor.tier_semantic import Encoder
from moe_l2_predictor.weighting import columns_in_order, prompt_proba

log = logging.getLogger("moe_l2_predictor.artefacts")

FORMAT = 4  # bump when what is pickled or how it is fitted changes
FOLDS = 5


@dataclass
class Artefacts:
    key: str
    tfidf: Pipeline | None = None
    semantic_head: LogisticRegression | None = None
    combiners: dict[tuple[str, ...], Combiner] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)


def file_digest(path: Path | None) -> str:
    if path is None:
        return ""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def artefact_key(taxonomy: Taxonomy, extra: Path | None, tiers: tuple[str, ...], model: str | None) -> str:
    parts = {
        "format": FORMAT,
        "taxonomy": taxonomy.digest(),
        "extra": file_digest(extra),
        "tiers": list(tiers),
        "semantic_model": model if "semantic" in tiers else None,
        "sklearn": sklearn.__version__,
        "numpy": np.__version__,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _fold_splits(labels: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Stratified folds; fewer folds when a domain has few examples, none below two."""
    smallest = int(np.bincount(labels).min()) if len(labels) else 0
    n = min(FOLDS, smallest)
    if n < 2:
        return []
    return list(StratifiedKFold(n_splits=n, shuffle=True, random_state=0).split(np.zeros(len(labels)), labels))


class _EmbeddingTable:
    """Every segment text embedded once, so cross-validation refits only the head."""

    def __init__(self, encoder: Encoder, texts: list[str]) -> None:
        unique = list(dict.fromkeys(texts))
        self.index = {t: i for i, t in enumerate(unique)}
        self.matrix = encoder.encode(unique)

    def __call__(self, texts: list[str]) -> np.ndarray:
        return self.matrix[[self.index[t] for t in texts]]


def _out_of_fold(
    taxonomy: Taxonomy,
    prompts: list[Prompt],
    labels: np.ndarray,
    tiers: tuple[str, ...],
    table: _EmbeddingTable | None,
) -> dict[str, np.ndarray]:
    """Each fitted tier's predictions for every example from a model that did not see it."""
    k = len(taxonomy.names)
    rules = LanguageRules(taxonomy)
    mains = [p.main for p in prompts]
    splits = _fold_splits(labels)
    oof: dict[str, np.ndarray] = {}
    if not splits:
        return oof
    if "tfidf" in tiers:
        oof["tfidf"] = np.zeros((len(prompts), k))
        for train, held in splits:
            model = tier_tfidf.fit([mains[i] for i in train], labels[train].tolist())
            oof["tfidf"][held] = tier_tfidf.TfidfTier(model, rules, k).proba([prompts[i] for i in held])
    if "semantic" in tiers and table is not None:
        oof["semantic"] = np.zeros((len(prompts), k))
        for train, held in splits:
            head = tier_semantic.fit_head(table([mains[i] for i in train]), labels[train].tolist())

            def text_proba(texts: list[str], head: LogisticRegression = head) -> np.ndarray:
                return columns_in_order(head.predict_proba(table(texts)), head.classes_, k)

            oof["semantic"][held] = prompt_proba([prompts[i] for i in held], text_proba, rules)
    return oof


def _accuracy(proba: np.ndarray, labels: np.ndarray) -> float:
    return float((proba.argmax(axis=1) == labels).mean())


def fit_artefacts(
    taxonomy: Taxonomy,
    training: list[Labeled],
    tiers: tuple[str, ...],
    encoder: Encoder | None,
    key: str = "",
    calibration: list[Labeled] | None = None,
    cross_validate: bool = False,
) -> Artefacts:
    """Fit the configured tiers on `training`, then the hybrid's combiners.

    One BLAS thread: these fits are small, and more threads on a shared core only oversubscribe it
    (a 1.5 s fit took 10 s that way). `cross_validate` adds out-of-fold accuracies to the report;
    they are computed anyway when there are no calibration prompts.

    The combiners are fitted on the calibration prompts when the taxonomy has some (predictions
    of the final models on prompts none of them, nor the keyword list, was fitted on); without
    them, on out-of-fold predictions of the examples, where the keyword tier looks better than it
    is (its keywords were chosen with the examples in view).
    """
    with threadpool_limits(limits=1):
        return _fit(taxonomy, training, tiers, encoder, key, calibration or [], cross_validate)


def _fit(
    taxonomy: Taxonomy,
    training: list[Labeled],
    tiers: tuple[str, ...],
    encoder: Encoder | None,
    key: str,
    calibration: list[Labeled],
    cross_validate: bool,
) -> Artefacts:
    started = time.monotonic()
    names = taxonomy.names
    rules = LanguageRules(taxonomy)
    prompts = [item.prompt for item in training]
    labels = np.array([names.index(item.domain) for item in training])
    art = Artefacts(key=key)
    live, table = _fit_tiers(art, taxonomy, prompts, labels, tiers, encoder, rules)

    oof: dict[str, np.ndarray] = {}
    if cross_validate or not calibration:
        oof = _out_of_fold(taxonomy, prompts, labels, tiers, table)
        if "keyword" in tiers:
            oof["keyword"] = live["keyword"].proba(prompts)  # not out-of-fold: nothing to fit
    report: dict[str, Any] = {"examples": len(training), "calibration_prompts": len(calibration)}
    if oof:
        report["cv_accuracy_on_examples"] = {t: _accuracy(p, labels) for t, p in oof.items()}
    fit_labels, fit_on, langs = _combiner_inputs(names, calibration, live, oof, prompts, labels, tiers, report)
    _fit_combiners(art, tiers, fit_on, fit_labels, langs, rules, report)
    cheap = tuple(t for t in tiers if t != "semantic")
    if "semantic" in tiers and cheap in art.combiners:
        combined = rules.apply(art.combiners[cheap].combine([fit_on[t] for t in cheap]), langs)
        report["early_exit"] = _early_exit(combined, fit_labels)
    report["fit_seconds"] = round(time.monotonic() - started, 2)
    art.report = report
    return art


def _fit_tiers(
    art: Artefacts,
    taxonomy: Taxonomy,
    prompts: list[Prompt],
    labels: np.ndarray,
    tiers: tuple[str, ...],
    encoder: Encoder | None,
    rules: LanguageRules,
) -> tuple[dict[str, Any], _EmbeddingTable | None]:
    """Fits each tier on the examples (into `art`); returns the tiers ready to predict, and the
    embedding table the semantic tier filled (the cross-validation reuses it)."""
    k = len(taxonomy.names)
    mains = [p.main for p in prompts]
    live: dict[str, Any] = {}
    table: _EmbeddingTable | None = None
    if "keyword" in tiers:
        live["keyword"] = KeywordTier(taxonomy)
    if "tfidf" in tiers:
        art.tfidf = tier_tfidf.fit(mains, labels.tolist())
        live["tfidf"] = tier_tfidf.TfidfTier(art.tfidf, rules, k)
    if "semantic" in tiers:
        if encoder is None:
            raise ValueError("the semantic tier needs an encoder")
        table = _EmbeddingTable(encoder, [t for p in prompts for t, _ in p.segments])
        art.semantic_head = tier_semantic.fit_head(table(mains), labels.tolist())
        live["semantic"] = tier_semantic.SemanticTier(encoder, art.semantic_head, rules, k)
    return live, table


def _combiner_inputs(
    names: list[str],
    calibration: list[Labeled],
    live: dict[str, Any],
    oof: dict[str, np.ndarray],
    prompts: list[Prompt],
    labels: np.ndarray,
    tiers: tuple[str, ...],
    report: dict[str, Any],
) -> tuple[np.ndarray, dict[str, np.ndarray], list[str]]:
    """What the combiners are fitted on: the tiers' answers to the calibration prompts, else their
    out-of-fold answers to the examples. Returns (labels, answers per tier, languages)."""
    if calibration:
        cal_prompts = [item.prompt for item in calibration]
        report["combiners_fitted_on"] = f"{len(calibration)} calibration prompts"
        fit_labels = np.array([names.index(item.domain) for item in calibration])
        return fit_labels, {t: live[t].proba(cal_prompts) for t in tiers}, [p.lang for p in cal_prompts]
    if all(t in oof for t in tiers):
        report["combiners_fitted_on"] = "out-of-fold predictions of the examples"
        return labels, oof, [p.lang for p in prompts]
    raise ValueError("too few examples per domain to fit the hybrid: give calibration prompts or more examples")


def _fit_combiners(
    art: Artefacts,
    tiers: tuple[str, ...],
    fit_on: dict[str, np.ndarray],
    fit_labels: np.ndarray,
    langs: list[str],
    rules: LanguageRules,
    report: dict[str, Any],
) -> None:
    """A combiner for every set of two or more tiers (into `art`), with its weights and accuracy."""
    scores: dict[str, float] = {t: _accuracy(p, fit_labels) for t, p in fit_on.items()}
    for size in range(2, len(tiers) + 1):
        for combo in itertools.combinations(tiers, size):
            combiner = fit_combiner(combo, [fit_on[t] for t in combo], fit_labels)
            art.combiners[combo] = combiner
            scores["+".join(combo)] = _accuracy(
                rules.apply(combiner.combine([fit_on[t] for t in combo]), langs), fit_labels
            )
            report.setdefault("weights", {})["+".join(combo)] = dict(zip(combo, combiner.weights, strict=True))
    report["accuracy_where_combiners_were_fitted"] = scores


def _early_exit(combined: np.ndarray, labels: np.ndarray) -> dict[str, dict[str, float | None]]:
    """How often the semantic tier could be skipped at each confidence of the cheap tiers, and how
    right they are then."""
    confident = combined.max(axis=1)
    right = combined.argmax(axis=1) == labels
    return {
        str(threshold): {
            "share": float((confident >= threshold).mean()),
            "accuracy": float(right[confident >= threshold].mean()) if (confident >= threshold).any() else None,
        }
        for threshold in (0.8, 0.9, 0.95, 0.98)
    }


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load(path: Path, key: str, cross_validate: bool) -> Artefacts | None:
    """The artefacts stored at `path` if they are the ones wanted, else None (a missing, truncated or
    foreign file means: fit again)."""
    try:
        with path.open("rb") as f:
            art = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as exc:
        log.warning("ignoring unreadable artefacts %s: %s", path, exc)
        return None
    if not isinstance(art, Artefacts) or art.key != key:
        return None
    if cross_validate and "cv_accuracy_on_examples" not in art.report:
        return None
    return art


def load_stored(
    cache_dir: Path, taxonomy: Taxonomy, tiers: tuple[str, ...], model: str | None, extra: Path | None = None
) -> Artefacts | None:
    """The stored artefacts of this configuration if there are any; never fits (no lock needed).

    `model` is the semantic model's fingerprint, which can be computed without loading it: the
    service's stand-in reads the full configuration's artefacts this way (they hold the TF-IDF
    model and the keyword+TF-IDF combiner too) before the semantic model is loaded."""
    key = artefact_key(taxonomy, extra, tiers, model)
    art = _load(cache_dir / f"{key}.pkl", key, cross_validate=False)
    if art is not None:
        log.info("loaded fitted artefacts %s", cache_dir / f"{key}.pkl")
    return art


def load_or_fit(
    cache_dir: Path,
    taxonomy: Taxonomy,
    training: list[Labeled],
    tiers: tuple[str, ...],
    encoder: Encoder | None,
    extra: Path | None = None,
    refit: bool = False,
    calibration: list[Labeled] | None = None,
    cross_validate: bool = False,
) -> Artefacts:
    """The cached artefacts for this configuration, fitted (under a file lock, once) if missing.

    A folder prepared at image build time may be read-only: stored artefacts are read without the lock.
    """
    key = artefact_key(taxonomy, extra, tiers, encoder.fingerprint if encoder else None)
    path = cache_dir / f"{key}.pkl"
    if not refit and (art := _load(path, key, cross_validate)) is not None:
        log.info("loaded fitted artefacts %s", path)
        return art
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock = open(cache_dir / f"{key}.lock", "w")  # held until the end of the block below
    except OSError as exc:
        log.warning("cache folder %s is not writable (%s): fitting in memory", cache_dir, exc)
        return fit_artefacts(taxonomy, training, tiers, encoder, key, calibration, cross_validate)
    with lock:
        # Replicas starting together wait here for the first one's fit instead of repeating it.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not refit and (art := _load(path, key, cross_validate)) is not None:
            log.info("loaded fitted artefacts %s", path)
            return art
        log.info("fitting the predictor's tiers %s on %d examples (cached as %s)", ",".join(tiers), len(training), path)
        art = fit_artefacts(taxonomy, training, tiers, encoder, key, calibration, cross_validate)
        _write_atomic(path, pickle.dumps(art, protocol=pickle.HIGHEST_PROTOCOL))
        _write_atomic(cache_dir / f"{key}.json", json.dumps(art.report, indent=2).encode())
        log.info("fitted in %.1fs: %s", art.report["fit_seconds"], art.report["accuracy_where_combiners_were_fitted"])
        return art
