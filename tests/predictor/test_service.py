"""`python -m moe_l2_predictor` as a real process, configuration by MOE_L2_* variables."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from moe_l2_common.supervisor import ServiceSpec, Supervisor, free_port, http_ok
from moe_l2_predictor.predictor import Predictor
from moe_l2_predictor.settings import PredictorSettings

pytestmark = pytest.mark.slow

SECRET = "zebra-unicorn-7731 write a function"


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    sup = Supervisor(tmp_path / "logs")
    yield sup
    sup.stop()


def start(supervisor: Supervisor, cache: Path, **env: str) -> str:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    supervisor.start(
        ServiceSpec(
            name=f"predictor-{port}",
            argv=[sys.executable, "-m", "moe_l2_predictor"],
            env={
                "MOE_L2_PREDICTOR_PORT": str(port),
                "MOE_L2_PREDICTOR_CACHE_DIR": str(cache),
                "MOE_L2_PREDICTOR_TIERS": "keyword,tfidf",
                **env,
            },
            health=http_ok(f"{base}/healthz"),
            url=base,
            start_timeout_s=300,
        )
    )
    return base


def test_the_service_runs_and_never_logs_prompts(supervisor: Supervisor, predictor_cache: Path) -> None:
    base = start(supervisor, predictor_cache)
    resp = httpx.post(f"{base}/v1/predict", json={"text": SECRET}, timeout=30)
    assert resp.status_code == 200
    assert resp.json()["domain"] == "codegen"
    assert httpx.get(f"{base}/healthz").json()["tiers"] == ["keyword", "tfidf"]
    assert "moe_l2_predictor_requests_total" in httpx.get(f"{base}/metrics").text
    running = supervisor.running[-1]
    supervisor.stop()
    assert running.proc.returncode is not None
    log = running.log_path.read_text()
    assert "predictor ready" in log
    assert "zebra-unicorn" not in log


def test_a_replacement_taxonomy(supervisor: Supervisor, tmp_path: Path) -> None:
    doc = {
        "fallback": "chitchat",
        "domains": [
            {"name": "chitchat", "description": "small talk", "keywords": ["hello"], "examples": ["hi", "hello there"]},
            {
                "name": "cooking",
                "description": "recipes",
                "keywords": {"recipe": 3, "bake": 2},
                "examples": ["a recipe for bread", "how long to bake a cake", "cook rice"],
            },
        ],
    }
    path = tmp_path / "taxonomy.yaml"
    path.write_text(yaml.safe_dump(doc))
    base = start(supervisor, tmp_path / "cache", MOE_L2_TAXONOMY_PATH=str(path))
    assert [d["name"] for d in httpx.get(f"{base}/v1/domains").json()["domains"]] == ["chitchat", "cooking"]
    body = httpx.post(f"{base}/v1/predict", json={"text": "a recipe to bake bread"}, timeout=30).json()
    assert body["domain"] == "cooking"
    assert set(body["scores"]) == {"chitchat", "cooking"}


def test_a_missing_semantic_model_disables_that_tier_only(tmp_path: Path, predictor_cache: Path) -> None:
    settings = PredictorSettings(cache_dir=predictor_cache, semantic_model=tmp_path / "nowhere")
    predictor = Predictor.from_settings(settings)
    assert predictor.tiers == ("keyword", "tfidf")
    assert "semantic" in predictor.describe()["unavailable"]


def test_unknown_tiers_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown tiers"):
        PredictorSettings(tiers="keyword,magic")
    assert PredictorSettings(tiers="semantic, keyword,keyword").tier_list == ("keyword", "semantic")


def test_artefacts_are_cached_by_content(tmp_path: Path) -> None:
    settings = PredictorSettings(cache_dir=tmp_path, tiers="keyword,tfidf")
    first = Predictor.from_settings(settings)
    stored = sorted(p.name for p in tmp_path.glob("*.pkl"))
    assert stored == [f"{first.artefacts.key}.pkl"]
    again = Predictor.from_settings(settings)
    assert again.artefacts.key == first.artefacts.key
    assert sorted(p.name for p in tmp_path.glob("*.pkl")) == stored  # loaded, not refitted
    # a corrupt file is refitted, not fatal
    (tmp_path / stored[0]).write_bytes(b"not a pickle")
    assert Predictor.from_settings(settings).artefacts.key == first.artefacts.key
