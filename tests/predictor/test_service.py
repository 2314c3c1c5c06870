"""`python -m moe_l2_predictor` as a real process, configuration by MOE_L2_* variables."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from moe_l2_ops.supervisor import ServiceSpec, Supervisor, free_port, http_ok
from moe_l2_predictor.predictor import Predictor
from moe_l2_predictor.prompt import from_text
from moe_l2_predictor.settings import PredictorSettings
from tests.metrics import sample_sum

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


def semantic_settled(base: str, timeout_s: float = 300) -> dict:
    """/healthz once the semantic tier is no longer loading (ready or failed)."""
    deadline = time.monotonic() + timeout_s
    while (health := httpx.get(f"{base}/healthz", timeout=10).json())["tier_status"]["semantic"] == "loading":
        assert time.monotonic() < deadline, f"the semantic tier still loading after {timeout_s}s: {health}"
        time.sleep(0.2)
    return health


def test_it_serves_the_cheap_tiers_while_the_semantic_tier_loads(supervisor: Supervisor, tmp_path: Path) -> None:
    # A fresh cache: the semantic tier's head is fitted in the background too, so it is still
    # loading (torch, the encoder, embedding every example: many seconds) once the cheap tiers,
    # fitted first, answer. Early exit off: once loaded, the semantic tier runs on every prompt.
    base = start(
        supervisor, tmp_path / "cache", MOE_L2_PREDICTOR_TIERS="keyword,tfidf,semantic", MOE_L2_PREDICTOR_EARLY_EXIT="1"
    )
    health = httpx.get(f"{base}/healthz").json()
    assert health["tier_status"] == {"keyword": "ready", "tfidf": "ready", "semantic": "loading"}
    assert health["tiers"] == ["keyword", "tfidf"] and health["semantic_model"] is None
    resp = httpx.post(f"{base}/v1/predict", json={"text": "write a python function that sorts a list"}, timeout=30)
    assert resp.status_code == 200
    assert (resp.json()["domain"], resp.json()["tier"]) == ("codegen", "hybrid")
    assert resp.headers["X-MoE-Tiers"] == "keyword,tfidf"
    assert metric(httpx.get(f"{base}/metrics").text, "moe_l2_predictor_tier_ready", tier="semantic") == 0

    health = semantic_settled(base)
    assert health["tier_status"] == {"keyword": "ready", "tfidf": "ready", "semantic": "ready"}, health
    assert health["tiers"] == ["keyword", "tfidf", "semantic"] and health["semantic_model"]
    assert health["unavailable"] == {}
    batch = httpx.post(
        f"{base}/v1/predict/batch",
        json={"items": [{"text": "write a python function that sorts a list"}, {"text": "Make it shorter."}]},
        timeout=30,
    )
    assert batch.json()["results"][0]["domain"] == "codegen"
    assert batch.headers["X-MoE-Tiers"] == "keyword,tfidf,semantic;keyword,tfidf,semantic"
    text = httpx.get(f"{base}/metrics").text
    assert metric(text, "moe_l2_predictor_tier_ready", tier="semantic") == 1
    assert metric(text, "moe_l2_predictor_tier_runs_total", tier="semantic") == 2
    log = supervisor.running[-1].log_path.read_text()
    assert "semantic loading in the background" in log and "semantic tier ready after" in log


def test_a_missing_semantic_model_disables_that_tier_only(tmp_path: Path, predictor_cache: Path) -> None:
    settings = PredictorSettings(cache_dir=predictor_cache, semantic_model=tmp_path / "nowhere")
    predictor = Predictor.from_settings(settings)
    assert predictor.tiers == ("keyword", "tfidf")
    assert "semantic" in predictor.describe()["unavailable"]
    # with the semantic tier alone configured, the keyword tier stands in rather than nothing
    alone = PredictorSettings(cache_dir=predictor_cache, tiers="semantic", semantic_model=tmp_path / "nowhere")
    assert Predictor.from_settings(alone).tiers == ("keyword",)


def test_the_stand_in_reads_the_full_configurations_artefacts(make_predictor, predictor_cache: Path) -> None:
    # an image's read-only cache holds only the full configuration's artefacts: the stand-in must
    # serve from them, not fit its own at every start
    full = make_predictor("keyword,tfidf,semantic")
    stand_in = Predictor.stand_in(PredictorSettings(cache_dir=predictor_cache))
    assert stand_in.tiers == ("keyword", "tfidf") and stand_in.semantic is None
    assert stand_in.artefacts.key == full.artefacts.key
    prompt = from_text("why does my program crash with a segmentation fault")
    cheap = stand_in.predict(prompt).response
    assert cheap.tier == "hybrid" and cheap.domain == "debug"
    fresh = Predictor.stand_in(PredictorSettings(cache_dir=predictor_cache / "empty"))
    assert fresh.artefacts.key != full.artefacts.key  # nothing stored: its own, fitted
    assert fresh.predict(prompt).response.scores == pytest.approx(cheap.scores, abs=1e-9)


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


def test_health_shows_names_and_digests_never_host_paths(supervisor: Supervisor, tmp_path: Path) -> None:
    doc = {
        "fallback": "chitchat",
        "domains": [
            {"name": "chitchat", "description": "small talk", "keywords": ["hello"], "examples": ["hi", "hello"]},
            {"name": "cooking", "description": "recipes", "keywords": {"recipe": 3}, "examples": ["a recipe"]},
        ],
    }
    private = tmp_path / "operator-private-dir"
    private.mkdir()
    (private / "taxonomy.yaml").write_text(yaml.safe_dump(doc))
    base = start(
        supervisor,
        tmp_path / "cache",
        MOE_L2_TAXONOMY_PATH=str(private / "taxonomy.yaml"),
        MOE_L2_PREDICTOR_TIERS="keyword,semantic",
        MOE_L2_PREDICTOR_SEMANTIC_MODEL=str(private / "no-model-here"),
    )
    health = semantic_settled(base)  # the model is looked for in the background
    text = httpx.get(f"{base}/healthz").text
    assert health["taxonomy"]["name"] == "taxonomy.yaml" and len(health["taxonomy"]["digest"]) == 16
    assert "semantic" in health["unavailable"]  # still says why the tier is off, by name
    assert "no-model-here" in health["unavailable"]["semantic"]
    assert health["tier_status"]["semantic"] == f"failed: {health['unavailable']['semantic']}"
    assert health["tiers"] == ["keyword"]  # the cheap tiers keep serving
    resp = httpx.post(f"{base}/v1/predict", json={"text": "a recipe"}, timeout=30)
    assert resp.json()["tier"] == "keyword" and resp.headers["X-MoE-Tiers"] == "keyword"
    log = supervisor.running[-1].log_path.read_text()
    assert log.count("semantic tier failed to load") == 1, log
    assert str(tmp_path) not in text and "operator-private-dir" not in text
    shipped = start(supervisor, tmp_path / "cache2", MOE_L2_PREDICTOR_TIERS="keyword")
    shipped_text = httpx.get(f"{shipped}/healthz").text
    assert httpx.get(f"{shipped}/healthz").json()["taxonomy"]["name"] == "shipped"
    assert "site-packages" not in shipped_text and "/work/" not in shipped_text and "moe_l2_domains" not in shipped_text


def test_a_client_leaving_mid_body_is_a_499_without_a_stack_trace(supervisor: Supervisor, tmp_path: Path) -> None:
    base = start(supervisor, tmp_path / "cache", MOE_L2_PREDICTOR_TIERS="keyword")
    port = int(base.rsplit(":", 1)[1])
    for _ in range(3):  # e.g. a gateway whose time budget ran out while it sent the body
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(
                b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"text": "half a bo'
            )
            time.sleep(0.2)

    def closed() -> float:
        return metric(httpx.get(f"{base}/metrics").text, "moe_l2_predictor_requests_total", status="499")

    deadline = time.monotonic() + 30
    while closed() < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    text = httpx.get(f"{base}/metrics").text
    assert closed() == 3
    assert metric(text, "moe_l2_predictor_requests_total", status="500") == 0
    assert httpx.post(f"{base}/v1/predict", json={"text": "hello"}, timeout=30).status_code == 200
    log = supervisor.running[-1].log_path.read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log and "ClientDisconnect" not in log


def metric(text: str, name: str, **labels: str) -> float:
    return sample_sum(text, name, **labels)
