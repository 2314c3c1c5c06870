"""Models the cache-manager cannot manage (missing, truncated, not GGUF, dense) and upstreams that are down:
the service still runs, says why, and accepts hints (the app in process, its lifespan included)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from moe_l2_cache.app import create_app
from moe_l2_cache.settings import CacheSettings
from moe_l2_contracts.admin import ADMIN_TOKEN_HEADER
from moe_l2_ops.supervisor import free_port

from ..conftest import ADMIN_HEADERS
from .gguf_models import build_dense, build_mixtral


def truncated(tmp: Path) -> Path:
    good = build_mixtral(tmp).path
    bad = tmp / "truncated.gguf"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    return bad


def not_gguf(tmp: Path) -> Path:
    path = tmp / "model.gguf"
    path.write_text("<html>404 Not Found</html>\n")
    return path


CASES: dict[str, tuple[Callable[[Path], Path | None], str]] = {
    "unset": (lambda tmp: None, "MOE_L2_MODEL_PATH is not set"),
    "missing": (lambda tmp: tmp / "nope.gguf", "does not exist"),
    "truncated": (truncated, "truncated"),
    "not-gguf": (not_gguf, "not a GGUF file"),
    "dense": (lambda tmp: build_dense(tmp).path, "dense model"),
}


def settings(model: Path | None, **kw: object) -> CacheSettings:
    down = f"127.0.0.1:{free_port()}"  # nothing listens there
    return CacheSettings(
        model_path=model, redis_url=f"redis://{down}/0", llama_url=f"http://{down}", pull_interval_s=0, **kw
    )


@pytest.mark.parametrize("case", list(CASES))
def test_pass_through_mode_says_why_and_accepts_hints(tmp_path: Path, case: str) -> None:
    make, fragment = CASES[case]
    with TestClient(create_app(settings(make(tmp_path)))) as client:
        assert client.get("/healthz").json() == {"status": "ok", "mode": "pass-through"}
        stats = client.get("/v1/stats").json()
        assert stats["mode"] == "pass-through" and fragment in stats["reason"]
        assert stats["pool"] is None and stats["flywheel"] is None
        hint = client.post("/v1/hint", json={"domain": "math"})
        assert hint.status_code == 200
        assert hint.json()["accepted"] is True and hint.json()["switched"] is False
        assert hint.json()["reason"].startswith("pass-through: ")
        assert client.get("/v1/stats").json()["hints"]["hints"] == 1
        for path in ("/v1/index", "/v1/hotset/math"):
            resp = client.get(path)
            assert resp.status_code == 409 and fragment in resp.json()["error"]["message"]
        assert client.post("/v1/pull").status_code == 401  # admin calls first need the token
        assert client.post("/v1/pull", headers=ADMIN_HEADERS).status_code == 409
        assert "moe_l2_cache_passthrough 1.0" in client.get("/metrics").text


def test_bad_hint_is_rejected(tmp_path: Path) -> None:
    with TestClient(create_app(settings(None))) as client:
        assert client.post("/v1/hint", json={"domain": "bad domain!"}).status_code == 422
        assert client.post("/v1/hint", json={"model": "m"}).status_code == 422


def test_real_model_with_redis_and_llama_down_still_serves(demo_model: Path) -> None:
    with TestClient(create_app(settings(demo_model, admin_token="t"))) as client:
        assert client.get("/healthz").json() == {"status": "ok", "mode": "active"}
        pull = client.post("/v1/pull", headers={ADMIN_TOKEN_HEADER: "t"}).json()
        assert pull["ok"] is False and "llama unreachable" in pull["error"]
        hint = client.post("/v1/hint", json={"domain": "math"}).json()
        assert hint["switched"] and "Redis unreachable" in hint["reason"]
        assert client.get("/v1/hotset/math").status_code == 503
        stats = client.get("/v1/stats").json()
        assert stats["mode"] == "active" and stats["flywheel"]["pull_errors"] == 1
        assert stats["pool"]["budget_bytes"] == 8 << 30
        assert client.get("/v1/index").json()["n_expert"] == 32
        metrics = client.get("/metrics").text
        assert "moe_l2_cache_flywheel_pull_errors_total 1.0" in metrics
        assert 'moe_l2_cache_active_domain{domain="math"} 1.0' in metrics
