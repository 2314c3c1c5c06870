"""The generation routes are declared once (generation_routes.py); the dispatcher, FastAPI's router
and the published API are made from that table, and what the dispatcher leaves to FastAPI (other
methods, a trailing slash) answers as it does for any route.

In process, with llama unreachable: routing needs no llama, and a request the /v1 passthrough takes
shows as its 503 (upstream_unavailable).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import BaseRoute

from moe_l2_ops.supervisor import free_port
from moe_l2_proxy import ollama_api, openai_api, ops_api
from moe_l2_proxy.app import create_app
from moe_l2_proxy.dispatch import GenerationDispatch
from moe_l2_proxy.generation_routes import GENERATION_ROUTES
from moe_l2_proxy.openapi import build_document
from moe_l2_proxy.settings import ProxySettings

PATHS = [route.path for route in GENERATION_ROUTES]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = ProxySettings(llama_url=f"http://127.0.0.1:{free_port()}", predictor_urls="", cache_url="")
    with TestClient(create_app(settings), follow_redirects=False) as test_client:
        yield test_client


def fastapi_routes(client: TestClient) -> list[BaseRoute]:
    return list(client.app.routes)  # type: ignore[attr-defined]


def dispatcher(client: TestClient) -> GenerationDispatch:
    layer = client.app.middleware_stack  # type: ignore[attr-defined]
    while not isinstance(layer, GenerationDispatch):
        layer = layer.app
    return layer


def test_the_dispatcher_answers_exactly_the_table(client):
    assert dict(dispatcher(client).routes) == {route.path: route.handler for route in GENERATION_ROUTES}


def test_fastapi_has_each_generation_route_once_from_the_table(client):
    routes = [r for r in fastapi_routes(client) if isinstance(r, APIRoute) and r.path in PATHS]
    assert [(r.path, r.methods, r.endpoint) for r in routes] == [
        (route.path, {"POST"}, route.handler) for route in GENERATION_ROUTES
    ]
    # and not again by the API modules' own routers
    for router in (openai_api.router, ollama_api.router, ops_api.router):
        assert [r.path for r in router.routes if getattr(r, "path", None) in PATHS] == []


def test_the_published_operations_come_from_the_table():
    doc = build_document(["codegen"], "test")
    for route in GENERATION_ROUTES:
        operation = doc["paths"][route.path]["post"]
        assert operation["summary"] == route.summary
        schema = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert schema == f"#/components/schemas/{route.api}.{route.request.__name__}"


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
def test_other_methods_on_ollama_generation_routes_are_405_in_ollamas_format(client, path, method):
    resp = client.request(method, path)
    assert resp.status_code == 405
    assert resp.headers["allow"] == "POST"
    if method != "HEAD":
        assert resp.json() == {"error": "Method Not Allowed"}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_other_methods_on_openai_generation_routes_answer_as_any_v1_path(client, path):
    # the passthrough's methods go on to llama (unreachable here), as for any other /v1 path
    for method in ("GET", "PUT", "DELETE", "PATCH", "OPTIONS"):
        resp = client.request(method, path)
        assert resp.status_code == 503, method
        assert resp.json()["error"]["code"] == "upstream_unavailable"
    # not one of the passthrough's methods: this route's 405 (the route is ahead of the passthrough)
    head = client.head(path)
    assert head.status_code == 405 and head.headers["allow"] == "POST"
    slash = client.post(path + "/", content=b"{}")  # another /v1 path: passed through
    assert slash.status_code == 503


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
def test_a_trailing_slash_is_redirected_to_the_route(client, path):
    resp = client.post(path + "/", content=b"{}")
    assert resp.status_code == 307
    assert resp.headers["location"].endswith(path)
