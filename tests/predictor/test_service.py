"""`python -m moe_l2_predictor` as a real process, configuration by MOE_L2_* variables."""

from __future__ import annotations

import re
import socket
import sys
import time
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
    text = httpx.get(f"{base}/healthz").text
    health = httpx.get(f"{base}/healthz").json()
    assert health["taxonomy"]["name"] == "taxonomy.yaml" and len(health["taxonomy"]["digest"]) == 16
    assert "semantic" in health["unavailable"]  # still says why the tier is off, by name
    assert "no-model-here" in health["unavailable"]["semantic"]
    assert str(tmp_path) not in text and "operator-private-dir" not in text
    shipped = start(supervisor, tmp_path / "cache2", MOE_L2_PREDICTOR_TIERS="keyword")
    shipped_text = httpx.get(f"{shipped}/healthz").text
    assert httpx.get(f"{shipped}/healthz").json()["taxonomy"]["name"] == "shipped"
    assert "site-packages" not in shipped_text and "/work/" not in shipped_text and "moe_l2_common" not in shipped_text


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
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
