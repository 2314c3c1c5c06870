"""Fixtures of the predictor tests: predictors fitted once per session into a temporary cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_l2_domains.keywords import KeywordClassifier
from moe_l2_domains.taxonomy import Taxonomy, load_default_taxonomy
from moe_l2_predictor.predictor import Predictor
from moe_l2_predictor.settings import PredictorSettings

REPO = Path(__file__).resolve().parents[2]
HELDOUT = REPO / "bench" / "data" / "predictor_heldout.jsonl"


@pytest.fixture(scope="session")
def taxonomy() -> Taxonomy:
    return load_default_taxonomy()


@pytest.fixture(scope="session")
def keywords(taxonomy: Taxonomy) -> KeywordClassifier:
    return KeywordClassifier(taxonomy)


@pytest.fixture(scope="session")
def predictor_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("predictor-cache")


@pytest.fixture(scope="session")
def make_predictor(predictor_cache: Path):
    """Factory: a Predictor with the given tiers (fitted once per tier set and session)."""
    built: dict[str, Predictor] = {}

    def make(tiers: str) -> Predictor:
        if tiers not in built:
            built[tiers] = Predictor.from_settings(PredictorSettings(tiers=tiers, cache_dir=predictor_cache))
        return built[tiers]

    return make


@pytest.fixture(scope="session")
def hybrid(make_predictor) -> Predictor:
    return make_predictor("keyword,tfidf,semantic")
