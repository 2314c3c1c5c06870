"""Tier 2: TF-IDF over word and character n-grams + a linear classifier (scikit-learn).

Character n-grams (within word boundaries) carry Chinese, which has no spaces, and typos; word
uni- and bigrams carry phrases like "stack trace". scikit-learn fits the model; predictions use
`CompiledTfidf`, the same arithmetic without scikit-learn's per-call validation and sparse-matrix
machinery, which costs milliseconds for a single prompt where the arithmetic costs microseconds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import FeatureUnion, Pipeline

from moe_l2_predictor.prompt import Prompt
from moe_l2_predictor.rules import LanguageRules
from moe_l2_predictor.weighting import columns_in_order, prompt_proba

C = 10.0


def new_pipeline() -> Pipeline:
    features = FeatureUnion(
        [
            (
                "words",
                TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1, token_pattern=r"(?u)\b\w[\w+#.]*"),
            ),
            ("chars", TfidfVectorizer(analyzer="char_wb", ngram_range=(1, 4), sublinear_tf=True, min_df=1)),
        ]
    )
    classifier = LogisticRegression(C=C, max_iter=5000, class_weight="balanced")
    return Pipeline([("features", features), ("classifier", classifier)])


def fit(texts: list[str], labels: list[int]) -> Pipeline:
    return new_pipeline().fit(texts, labels)


class CompiledTfidf:
    """predict_proba of a fitted pipeline: per vectorizer, term counts -> (sublinear) tf * idf ->
    L2 norm, dotted with the classifier's weights of those terms; softmax of the sum."""

    def __init__(self, pipeline: Pipeline) -> None:
        classifier: LogisticRegression = pipeline.named_steps["classifier"]
        features: FeatureUnion = pipeline.named_steps["features"]
        coef = classifier.coef_
        self.intercept = classifier.intercept_.astype(np.float64)
        self.binary = coef.shape[0] == 1  # two classes: one weight row, a logistic instead of a softmax
        self.parts: list[tuple[Callable[[str], list[str]], dict[str, int], np.ndarray, np.ndarray, bool]] = []
        offset = 0
        for _, vectorizer in features.transformer_list:
            vocab: dict[str, int] = vectorizer.vocabulary_
            width = len(vocab)
            # The weights of each term, transposed so one term's row is contiguous.
            weights = np.ascontiguousarray(coef[:, offset : offset + width].T, dtype=np.float64)
            idf = vectorizer.idf_.astype(np.float64)
            self.parts.append((vectorizer.build_analyzer(), vocab, idf, weights, bool(vectorizer.sublinear_tf)))
            offset += width

    def decision(self, text: str) -> np.ndarray:
        z = self.intercept.copy()
        for analyze, vocab, idf, weights, sublinear in self.parts:
            hits = [(col, n) for term, n in Counter(analyze(text)).items() if (col := vocab.get(term)) is not None]
            if not hits:
                continue
            pairs = np.array(hits, dtype=np.intp)
            cols = pairs[:, 0]
            tf = pairs[:, 1].astype(np.float64)
            if sublinear:
                tf = 1.0 + np.log(tf)
            values = tf * idf[cols]
            values /= math.sqrt(float(values @ values))
            z += values @ weights[cols]
        return z

    def predict_proba(self, texts: list[str]) -> np.ndarray:
        z = np.array([self.decision(t) for t in texts])
        if self.binary:
            p1 = 1.0 / (1.0 + np.exp(-z[:, 0]))
            return np.column_stack([1.0 - p1, p1])
        z -= z.max(axis=1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)


class TfidfTier:
    name = "tfidf"

    def __init__(self, pipeline: Pipeline, rules: LanguageRules, k: int) -> None:
        self.pipeline = pipeline
        self.compiled = CompiledTfidf(pipeline)
        self.rules = rules
        self.k = k

    def text_proba(self, texts: list[str]) -> np.ndarray:
        return columns_in_order(self.compiled.predict_proba(texts), self.pipeline.classes_, self.k)

    def proba(self, prompts: Sequence[Prompt]) -> np.ndarray:
        return prompt_proba(prompts, self.text_proba, self.rules)
