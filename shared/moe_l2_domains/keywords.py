"""The keyword tier: scored keyword matching over the taxonomy, no dependencies, microseconds.

The predictor runs it as its first tier and the gateway as its fallback when the predictor is
slow or down, so it lives here and needs only the standard library (plus the taxonomy loader).

Matching:
- Latin/Cyrillic/Greek text is tokenized (lower-cased, NFKC-normalized) and keywords match
  whole tokens or whole token sequences ("write a function"), so `class` never fires inside
  `classic` and `sum` never inside `summary`. Plural endings `s`/`es` are forgiven.
- CJK, kana and Hangul keywords match as substrings (those scripts have no word boundaries).
- Optional per-domain regex patterns, searched in the original text (case-sensitive unless the
  pattern says `(?i)`), e.g. arithmetic like `3x + 5 = 20` or `KeyError`.
Each distinct keyword counts once with its weight. Language rules from the taxonomy are then
applied: a domain restricted to some languages scores nothing outside them, and inside them it
takes over the evidence of the domains it absorbs (chinese_tech absorbs codegen and debug in zh).
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass

from moe_l2_domains.lang import detect_lang
from moe_l2_domains.taxonomy import Taxonomy, load_configured_taxonomy

# What is scanned of one text: long inputs keep their head (the instruction, usually) and tail
# (the question after a pasted document).
HEAD_CHARS = 4000
TAIL_CHARS = 1000

# The fallback domain's implicit score: a single weak keyword (weight >= 1) beats it.
FALLBACK_PRIOR = 0.5
# confidence = sqrt(share of the evidence) * evidence / (evidence + EVIDENCE_HALF), and
# NO_EVIDENCE_CONFIDENCE when nothing matched: the form and constants minimise the log loss of the
# confidence on the shipped taxonomy's calibration prompts (not the examples the keywords were
# chosen with), where the fallback guess is right about 45% of the time.
EVIDENCE_HALF = 0.25
NO_EVIDENCE_CONFIDENCE = 0.35

_TOKEN = re.compile(r"[0-9a-z_\u00c0-\u024f\u0370-\u03ff\u0400-\u04ff]+(?:['.][0-9a-z_\u00c0-\u024f]+)*[+#]*")
_UNSPACED = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")


@dataclass(frozen=True)
class KeywordPrediction:
    domain: str
    confidence: float
    scores: dict[str, float]  # per-domain share of the evidence (sums to 1)
    lang: str


def clip_text(text: str, head: int = HEAD_CHARS, tail: int = TAIL_CHARS) -> str:
    """Head and tail of a long text, so one huge paste costs what a normal prompt does."""
    if len(text) <= head + tail:
        return text
    return f"{text[:head]}\n{text[-tail:]}"


def normalize(text: str) -> str:
    """Lower case; full-width forms folded (NFKC) for non-ASCII text."""
    if not text.isascii():
        text = unicodedata.normalize("NFKC", text)
    return text.lower()


def tokenize(text: str) -> list[str]:
    """Word tokens of normalized text (`node.js`, `c++`, `don't` stay whole)."""
    return _TOKEN.findall(text)


class KeywordClassifier:
    """Scores each domain by the weighted keywords and patterns of the taxonomy found in a text."""

    def __init__(self, taxonomy: Taxonomy | None = None) -> None:
        self.taxonomy = taxonomy if taxonomy is not None else load_configured_taxonomy()
        self.names = self.taxonomy.names
        self._fallback = self.names.index(self.taxonomy.fallback)
        # token (or "tok tok ...", or a plural of one) -> (the keyword, [(domain index, weight)])
        self._unigrams: dict[str, tuple[str, list[tuple[int, float]]]] = {}
        self._ngrams: dict[str, tuple[str, list[tuple[int, float]]]] = {}
        self._ngram_first: set[str] = set()
        self._max_ngram = 1
        # first character -> [(keyword, [(domain index, weight)])] for CJK keywords
        self._unspaced: dict[str, list[tuple[str, list[tuple[int, float]]]]] = {}
        self._unspaced_first: re.Pattern[str] | None = None
        self._patterns: list[tuple[re.Pattern[str], int, float]] = []
        self._compile()
        self._absorb: dict[str, list[tuple[int, tuple[int, ...]]]] = {}
        self._restricted: list[tuple[int, frozenset[str]]] = []
        for i, d in enumerate(self.taxonomy.domains):
            if d.languages:
                self._restricted.append((i, frozenset(d.languages)))
                for lang in d.languages:
                    self._absorb.setdefault(lang, []).append((i, tuple(self.names.index(a) for a in d.absorbs)))

    def _compile(self) -> None:
        unspaced: dict[str, list[tuple[int, float]]] = {}
        unigrams: dict[str, list[tuple[int, float]]] = {}
        ngrams: dict[str, list[tuple[int, float]]] = {}
        for i, d in enumerate(self.taxonomy.domains):
            for term, weight in d.keywords.items():
                norm = normalize(term).strip()
                if _UNSPACED.search(norm):
                    unspaced.setdefault(norm, []).append((i, weight))
                    continue
                tokens = tokenize(norm)
                if len(tokens) == 1:
                    unigrams.setdefault(tokens[0], []).append((i, weight))
                elif tokens:
                    ngrams.setdefault(" ".join(tokens), []).append((i, weight))
                    self._ngram_first.add(tokens[0])
                    self._max_ngram = max(self._max_ngram, len(tokens))
            for pattern, weight in d.patterns.items():
                self._patterns.append((re.compile(pattern), i, weight))
        # Plural forms ("functions", "classes", "stack traces") map to their keyword, unless they are
        # keywords themselves; matching then costs one lookup per token.
        for table, plain in ((self._unigrams, unigrams), (self._ngrams, ngrams)):
            table.update({term: (term, hits) for term, hits in plain.items()})
            for term, hits in plain.items():
                if len(term) >= 3:
                    table.setdefault(f"{term}s", (term, hits))
                    table.setdefault(f"{term}es", (term, hits))
        for term, hits in unspaced.items():
            self._unspaced.setdefault(term[0], []).append((term, hits))
        for entries in self._unspaced.values():
            entries.sort(key=lambda e: -len(e[0]))
        if self._unspaced:
            self._unspaced_first = re.compile("[" + "".join(re.escape(c) for c in self._unspaced) + "]")

    def _matches(self, original: str) -> dict[str, list[tuple[int, float]]]:
        """Every distinct keyword (in normalized text) and pattern (in the original) found, with its hits."""
        text = normalize(original)
        found: dict[str, list[tuple[int, float]]] = {}
        tokens = tokenize(text)
        unigrams, ngrams, first, longest = self._unigrams, self._ngrams, self._ngram_first, self._max_ngram
        count = len(tokens)
        for i, tok in enumerate(tokens):
            entry = unigrams.get(tok)
            if entry is not None:
                found[entry[0]] = entry[1]
            if tok in first:
                for n in range(2, min(longest, count - i) + 1):
                    entry = ngrams.get(" ".join(tokens[i : i + n]))
                    if entry is not None:
                        found[entry[0]] = entry[1]
        if self._unspaced_first is not None and not text.isascii():
            index = self._unspaced
            # Only positions holding the first character of some CJK keyword are looked at.
            for match in self._unspaced_first.finditer(text):
                at = match.start()
                for term, hits in index[match.group()]:
                    if term not in found and text.startswith(term, at):
                        found[term] = hits
        for pattern, domain, weight in self._patterns:
            if pattern.search(original):
                found[f"/{pattern.pattern}/"] = [(domain, weight)]
        return found

    def raw_scores(self, text: str, lang: str | None = None) -> tuple[list[float], str]:
        """Summed keyword weights per domain (taxonomy order) after the language rules, and the language."""
        text = clip_text(text)
        if lang is None:
            lang = detect_lang(text)
        scores = [0.0] * len(self.names)
        for hits in self._matches(text).values():
            for domain, weight in hits:
                scores[domain] += weight
        return self.apply_language_rules(scores, lang), lang

    def apply_language_rules(self, scores: list[float], lang: str) -> list[float]:
        """Absorption (in place) for the language's domains, then zero for domains not applying to it."""
        for target, absorbed in self._absorb.get(lang, ()):
            for a in absorbed:
                scores[target] += scores[a]
                scores[a] = 0.0
        for i, langs in self._restricted:
            if lang not in langs:
                scores[i] = 0.0
        return scores

    def decide(self, raw: list[float], lang: str) -> KeywordPrediction:
        """Turn raw per-domain evidence into a prediction with a confidence in [0, 1]."""
        evidence = sum(raw)
        total = evidence + FALLBACK_PRIOR
        scores = dict(zip(self.names, [s / total for s in raw], strict=True))
        scores[self.names[self._fallback]] += FALLBACK_PRIOR / total
        best = max(scores, key=scores.__getitem__)
        if evidence:
            confidence = math.sqrt(scores[best]) * evidence / (evidence + EVIDENCE_HALF)
        else:
            confidence = NO_EVIDENCE_CONFIDENCE
        return KeywordPrediction(domain=best, confidence=min(1.0, confidence), scores=scores, lang=lang)

    def predict(self, text: str) -> KeywordPrediction:
        raw, lang = self.raw_scores(text)
        return self.decide(raw, lang)

    def predict_weighted(self, segments: Iterable[tuple[str, float]], lang: str | None = None) -> KeywordPrediction:
        """One prediction for several texts of different weight (a chat: last user turn, context)."""
        total = [0.0] * len(self.names)
        segments = list(segments)
        if lang is None:
            lang = detect_lang(clip_text(segments[0][0])) if segments else "unknown"
        for text, weight in segments:
            raw, _ = self.raw_scores(text, lang)
            for i, value in enumerate(raw):
                total[i] += weight * value
        return self.decide(total, lang)
