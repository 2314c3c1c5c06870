"""The HTTP API in-process (the app with the session's fitted hybrid predictor), bad input included."""
# ruff: noqa: RUF001 - multilingual prompts: full-width punctuation and Cyrillic are the point

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from moe_l2_contracts.schemas.predict import PredictBatchResponse, PredictResponse
from moe_l2_predictor.app import create_app
from moe_l2_predictor.settings import PredictorSettings
from tests.fuzz.schema_refs import request_validator, unresolved
from tests.metrics import sample_sum

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(hybrid, predictor_cache) -> Iterator[TestClient]:
    settings = PredictorSettings(cache_dir=predictor_cache, max_body_bytes=2 * 1024 * 1024)
    with TestClient(create_app(settings, predictor=hybrid)) as c:
        yield c


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the samples of `name` with these labels in the exposition `text` (0 when absent)."""
    return sample_sum(text, name, **labels)


def test_predict_text(client: TestClient) -> None:
    resp = client.post("/v1/predict", json={"text": "Write a haiku about a segfault"})
    assert resp.status_code == 200
    body = PredictResponse.model_validate(resp.json())
    assert body.domain == "creative_write"
    assert body.tier == "hybrid"
    assert body.lang == "en"
    assert set(body.scores) == set(client.app.state.predictor.taxonomy.names)


def test_predict_messages(client: TestClient) -> None:
    messages = [
        {"role": "system", "content": "你是一个乐于助人的助手。"},
        {"role": "user", "content": "一个圆的半径是3厘米，求它的面积。"},
    ]
    body = client.post("/v1/predict", json={"messages": messages}).json()
    assert body["domain"] == "math"
    assert body["lang"] == "zh"


def test_batch(client: TestClient) -> None:
    items = [{"text": "Translate 'cat' into French"}, {"messages": [{"role": "user", "content": "用Go写一个HTTP服务"}]}]
    resp = client.post("/v1/predict/batch", json={"items": items})
    assert resp.status_code == 200
    results = PredictBatchResponse.model_validate(resp.json()).results
    assert [r.domain for r in results] == ["translate", "chinese_tech"]
    assert client.post("/v1/predict/batch", json={"items": []}).json() == {"results": []}


def test_domains_and_health(client: TestClient) -> None:
    domains = client.get("/v1/domains").json()
    assert [d["name"] for d in domains["domains"]] == list(client.app.state.predictor.taxonomy.names)
    assert domains["fallback"] == "general_qa"
    assert all(d["examples"] >= 40 and d["description"] for d in domains["domains"])
    health = client.get("/healthz").json()
    assert health["status"] == "ok"
    assert health["tiers"] == ["keyword", "tfidf", "semantic"]
    assert health["tier_status"] == {"keyword": "ready", "tfidf": "ready", "semantic": "ready"}


def test_answers_say_which_tiers_they_came_from(client: TestClient) -> None:
    sure = client.post("/v1/predict", json={"text": "Solve the equation 3x + 5 = 20 for x"})
    assert sure.json()["tier"] == "hybrid" and sure.headers["X-MoE-Tiers"] == "keyword,tfidf"  # early exit
    vague = client.post("/v1/predict", json={"text": "Make it shorter."})
    assert vague.headers["X-MoE-Tiers"] == "keyword,tfidf,semantic"
    items = [{"text": "Solve the equation 3x + 5 = 20 for x"}, {"text": "Make it shorter."}]
    batch = client.post("/v1/predict/batch", json={"items": items})
    assert batch.headers["X-MoE-Tiers"] == "keyword,tfidf;keyword,tfidf,semantic"


def test_metrics(client: TestClient) -> None:
    before = client.get("/metrics").text
    client.post("/v1/predict", json={"text": "Solve x^2 = 16"})
    client.post("/v1/predict", json={"text": "Make it shorter."})  # vague: the semantic tier runs
    after = client.get("/metrics").text
    requests = ("moe_l2_predictor_requests_total", {"endpoint": "/v1/predict", "status": "200"})
    assert metric(after, requests[0], **requests[1]) == metric(before, requests[0], **requests[1]) + 2
    math_hybrid = {"domain": "math", "tier": "hybrid"}
    assert metric(after, "moe_l2_predictor_predictions_total", **math_hybrid) >= 1
    for tier in ("keyword", "tfidf", "semantic", "hybrid"):
        assert metric(after, "moe_l2_predictor_latency_seconds_count", tier=tier) >= 1, tier
    assert metric(after, "moe_l2_predictor_tier_runs_total", tier="keyword") >= metric(
        after, "moe_l2_predictor_tier_runs_total", tier="semantic"
    )
    assert "Solve" not in after  # no prompt text in the metrics


@pytest.mark.parametrize("text", ["", " ", "\x00\x00", "🙂" * 10, "a" * 1_000_000, "\ufffd\ufffe\uffff"])
def test_odd_texts_get_a_defined_prediction(client: TestClient, text: str) -> None:
    resp = client.post("/v1/predict", json={"text": text})
    assert resp.status_code == 200
    PredictResponse.model_validate(resp.json())


def test_empty_text_falls_back(client: TestClient) -> None:
    body = client.post("/v1/predict", json={"text": ""}).json()
    assert body["domain"] == "general_qa"
    assert body["lang"] == "unknown"


def test_binary_garbage(client: TestClient) -> None:
    rng = random.Random(1)
    garbage = bytes(rng.randrange(256) for _ in range(50_000))
    resp = client.post("/v1/predict", content=garbage, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_json"
    # the same garbage as text, inside valid JSON, is just a (strange) prompt
    resp = client.post("/v1/predict", json={"text": garbage.decode("latin-1")})
    assert resp.status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"", 400, "invalid_json"),
        (b'{"text": "hi", "colour": "red"}', 422, "invalid_request"),
        (b'{"text": 5}', 422, "invalid_request"),
        (b"{}", 422, "invalid_request"),
        (b'{"text": "a", "messages": []}', 422, "invalid_request"),
        (b'{"messages": [{"content": "no role"}]}', 422, "invalid_request"),
        (b"[1, 2]", 422, "invalid_request"),
        (b'{"text": "\\ud800"}', 400, "invalid_json"),
    ],
)
def test_bad_requests_get_a_defined_4xx(client: TestClient, body: bytes, status: int, kind: str) -> None:
    resp = client.post("/v1/predict", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["type"] == kind


def test_unknown_field_names_the_field(client: TestClient) -> None:
    detail = client.post("/v1/predict", json={"text": "hi", "colour": "red"}).json()["error"]["details"]
    assert detail[0]["loc"] == ["colour"]


def test_too_large(client: TestClient) -> None:
    big = json.dumps({"text": "x" * (3 * 1024 * 1024)})
    resp = client.post("/v1/predict", content=big, headers={"content-type": "application/json"})
    assert resp.status_code == 413
    assert resp.json()["error"]["type"] == "too_large"
    # streamed without a length: refused all the same
    resp = client.post("/v1/predict", content=iter([big.encode()]), headers={"content-type": "application/json"})
    assert resp.status_code == 413


def test_batch_limits(client: TestClient) -> None:
    resp = client.post("/v1/predict/batch", json={"items": [{"text": "x"}] * 257})
    assert resp.status_code == 422
    resp = client.post("/v1/predict/batch", json={"items": [{"text": "x", "extra": 1}]})
    assert resp.status_code == 422


def test_bad_requests_are_counted(client: TestClient) -> None:
    client.post("/v1/predict", content=b"{", headers={"content-type": "application/json"})
    text = client.get("/metrics").text
    assert metric(text, "moe_l2_predictor_requests_total", endpoint="/v1/predict", status="400") >= 1


def test_every_openapi_reference_resolves(make_predictor, predictor_cache) -> None:
    settings = PredictorSettings(cache_dir=predictor_cache, tiers="keyword")
    with TestClient(create_app(settings, predictor=make_predictor("keyword"))) as c:
        doc = c.get("/openapi.json").json()
    assert unresolved(doc) == []
    predict = request_validator(doc, "/v1/predict")
    assert predict.is_valid({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert not predict.is_valid({"text": "a", "unknown": 1})
    batch = request_validator(doc, "/v1/predict/batch")
    assert batch.is_valid({"items": [{"text": "a"}, {"messages": [{"role": "user", "content": "hi"}]}]})
    assert not batch.is_valid({"items": [{"messages": [{"content": "no role"}]}]})
