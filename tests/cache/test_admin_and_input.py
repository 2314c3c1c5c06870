"""The cache-manager's admin calls need the admin token, hints take only known domains, and no error
repeats what the client sent (issue #11, items 3, 9 and 11). The service runs as a real process on a
real Redis; llama is unreachable, which is one of its legitimate states (a pull reports it, 200)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from moe_l2_cache.app import create_app
from moe_l2_cache.settings import CacheSettings
from moe_l2_contracts.admin import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE_ENV, ADMIN_TOKEN_HEADER
from moe_l2_contracts.domains import DEFAULT_DOMAINS, UNTAGGED
from moe_l2_contracts.schemas.errors import ServiceError
from moe_l2_ops.supervisor import free_port

from ..conftest import ADMIN_HEADERS, ADMIN_TOKEN
from .conftest import CacheManager, RedisServer

ADMIN_CALLS = ("/v1/pull", "/v1/pool/evict")
SECRET = "SECRET-d0c3b1a9e8f7"


@pytest.fixture
def start(
    demo_model: Path, redis_server: RedisServer, start_cache_manager: Callable[..., CacheManager]
) -> Callable[..., CacheManager]:
    def start(**env: str) -> CacheManager:
        return start_cache_manager(
            MOE_L2_MODEL_PATH=str(demo_model),
            MOE_L2_LLAMA_URL=f"http://127.0.0.1:{free_port()}",  # nothing listens there
            MOE_L2_REDIS_URL=redis_server.url,
            MOE_L2_CACHE_PULL_INTERVAL_S="0",
            MOE_L2_CACHE_POOL_BYTES=str(1 << 20),
            **env,
        )

    return start


def test_admin_calls_need_the_token(start: Callable[..., CacheManager]) -> None:
    manager = start()  # MOE_L2_ADMIN_TOKEN comes from the test session's environment
    for path in ADMIN_CALLS:
        missing = manager.client.post(path)
        assert missing.status_code == 401, (path, missing.text)
        assert ADMIN_TOKEN_HEADER in missing.json()["error"]["message"]
        wrong = manager.client.post(path, headers={ADMIN_TOKEN_HEADER: SECRET})
        assert wrong.status_code == 401 and SECRET not in wrong.text, (path, wrong.text)
        # the token of the Authorization header is not the admin token's place
        bearer = manager.client.post(path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert bearer.status_code == 401
        right = manager.client.post(path, headers=ADMIN_HEADERS)
        assert right.status_code == 200, (path, right.text)
    pull = manager.client.post("/v1/pull", headers=ADMIN_HEADERS).json()
    assert pull["ok"] is False and "llama unreachable" in pull["error"]
    # reads stay open
    assert manager.client.get("/v1/stats").status_code == 200


def test_no_token_configured_refuses_every_admin_call(start: Callable[..., CacheManager], tmp_path: Path) -> None:
    manager = start(**{ADMIN_TOKEN_ENV: ""})
    for path in ADMIN_CALLS:
        for headers in ({}, ADMIN_HEADERS, {ADMIN_TOKEN_HEADER: ""}):
            resp = manager.client.post(path, headers=headers)
            assert resp.status_code == 401, (path, headers, resp.text)
            assert "no admin token is configured" in resp.json()["error"]["message"]
    manager.stop()

    # the token from a file (as compose mounts it), and an unreadable file refuses everything
    token_file = tmp_path / "admin-token"
    token_file.write_text("token-from-a-file\n")
    from_file = start(**{ADMIN_TOKEN_ENV: "", ADMIN_TOKEN_FILE_ENV: str(token_file)})
    assert from_file.client.post("/v1/pull", headers={ADMIN_TOKEN_HEADER: "token-from-a-file"}).status_code == 200
    assert from_file.client.post("/v1/pull", headers=ADMIN_HEADERS).status_code == 401
    from_file.stop()
    missing = start(**{ADMIN_TOKEN_ENV: "", ADMIN_TOKEN_FILE_ENV: str(tmp_path / "nope")})
    resp = missing.client.post("/v1/pull", headers={ADMIN_TOKEN_HEADER: "anything"})
    assert resp.status_code == 401 and "cannot read the admin token file" in resp.json()["error"]["message"]


def test_the_token_is_sent_on_llamas_admin_calls(demo_model: Path) -> None:
    down = f"127.0.0.1:{free_port()}"
    settings = CacheSettings(
        model_path=demo_model, redis_url=f"redis://{down}/0", llama_url=f"http://{down}", pull_interval_s=0
    )
    with TestClient(create_app(settings)) as client:
        flywheel = client.app.state.service.flywheel  # type: ignore[attr-defined]
        # the flywheel's reset pulls and the hints' hot-set posts carry these (test_flywheel / test_hints
        # check that they do, against a llama that refuses calls without them)
        assert flywheel.admin_headers == {ADMIN_TOKEN_HEADER: os.environ[ADMIN_TOKEN_ENV]}


def test_hints_take_only_known_domains(start: Callable[..., CacheManager]) -> None:
    manager = start(MOE_L2_EXTRA_DOMAINS="legal")
    for domain in (*DEFAULT_DOMAINS, "legal", UNTAGGED):
        resp = manager.client.post("/v1/hint", json={"domain": domain})
        assert resp.status_code == 200, (domain, resp.text)
    for domain, why in (("_global", "reserved"), ("_x", "reserved"), ("nosuchdomain", "not a known domain")):
        resp = manager.client.post("/v1/hint", json={"domain": domain})
        assert resp.status_code == 400, (domain, resp.text)
        detail = resp.json()["error"]["message"]
        assert why in detail and "valid domains: " in detail
        assert set(detail.split("valid domains: ")[1].split(", ")) == {*DEFAULT_DOMAINS, "legal", UNTAGGED}
        assert domain not in detail
    stats = manager.stats()
    assert stats["hints"]["hints"] == len(DEFAULT_DOMAINS) + 2
    assert manager.client.get("/v1/hotset/nosuchdomain").status_code == 404


def test_validation_errors_say_where_and_why_not_what(start: Callable[..., CacheManager]) -> None:
    manager = start()
    c = manager.client
    cases = [
        c.post("/v1/hint", json={"domain": f"{SECRET} has spaces", "model": SECRET}),
        c.post("/v1/hint", json={"domain": SECRET * 10}),
        c.post("/v1/hint", json={"domain": {"nested": SECRET}}),
        c.post("/v1/hint", json=[SECRET]),
        c.post("/v1/hint", content=f'{{"domain": "{SECRET}', headers={"Content-Type": "application/json"}),
        c.get("/v1/hotset/math", params={"format": SECRET}),
        c.get("/v1/hotset/math", params={"fresh": SECRET}),
        c.get(f"/v1/index/{SECRET}/1"),
        c.get(f"/v1/index/1/{SECRET}"),
    ]
    for resp in cases:
        assert resp.status_code == 422, (resp.request.url, resp.text)
        assert SECRET not in resp.text, (resp.request.url, resp.text)
        error = ServiceError.model_validate(resp.json()).model_dump()["error"]
        assert error["type"] == "invalid_request"
        errors = error["details"]
        assert errors and all(set(e) == {"loc", "msg", "type"} for e in errors)
    first = cases[0].json()["error"]["details"]
    assert [e["loc"] for e in first] == [["body", "domain"]] and "pattern" in first[0]["msg"]
    assert cases[5].json()["error"]["details"][0]["loc"] == ["query", "format"]
    # a reserved or unknown domain is a 400 that does not repeat it either
    resp = c.post("/v1/hint", json={"domain": f"_{SECRET}"})
    assert resp.status_code == 400 and SECRET not in resp.text
    # nothing that came in is echoed by the 401 either (test_admin_calls_need_the_token), nor a 404
    resp = c.get(f"/v1/hotset/{SECRET}")
    assert resp.status_code == 404 and SECRET not in resp.text
    # the internal services' one error envelope, for every status
    assert ServiceError.model_validate(resp.json()).error.type == "not_found"
    for body in (b"\xff\xfe", b"{}", b'{"domain": null}', b'{"domain": 5}', b"", b"null"):
        resp = c.post("/v1/hint", content=body, headers={"Content-Type": "application/json"})
        assert 400 <= resp.status_code < 500, (body, resp.text)
