"""CORS is the gateway's: local web pages may use it from a browser, other pages may not (checked
in a real headless Chromium), llama's own CORS headers never reach the client, and preflights are
answered by the gateway on every route."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from moe_l2_ops.supervisor import free_port
from tests.proxy.support import GatewayProc, chat_body

pytestmark = pytest.mark.llama

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome-stable", "google-chrome")
CHROMIUM_PACKAGE = "chromium"  # Debian's package, installed by CI's setup step


def chromium() -> str:
    """Chromium's path. Missing: a failure under CI (CI=true), where it must be installed, else a skip."""
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    message = f"headless Chromium is needed for the browser CORS test: apt-get install {CHROMIUM_PACKAGE}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def cors_gateway(start_gateway, llama32) -> GatewayProc:
    return start_gateway(llama32.url)


# --- headers -------------------------------------------------------------------------------------


def cors_headers(resp) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower().startswith("access-control-")}


def test_llama_cors_headers_are_not_relayed(cors_gateway):
    # llama sends an empty `access-control-allow-origin:` on every answer without an Origin
    for resp in (
        cors_gateway.client.get("/v1/models"),
        cors_gateway.client.post("/v1/chat/completions", json=chat_body()),
        cors_gateway.client.post("/v1/chat/completions", json=chat_body(stream=True)),
    ):
        assert resp.status_code == 200 and cors_headers(resp) == {}


@pytest.mark.parametrize("origin", ["https://evil.example", "http://127.0.0.2:8000", "null", "http://localhost.evil"])
def test_a_foreign_origin_is_refused(cors_gateway, origin):
    for resp in (
        cors_gateway.client.get("/v1/models", headers={"Origin": origin}),
        cors_gateway.client.post("/v1/chat/completions", json=chat_body(), headers={"Origin": origin}),
        cors_gateway.client.post("/api/chat", json={"model": "d", "messages": []}, headers={"Origin": origin}),
    ):
        # llama would reflect it with `access-control-allow-credentials: true`
        assert resp.status_code == 403 and cors_headers(resp) == {}
    preflight = cors_gateway.client.options(
        "/v1/chat/completions", headers={"Origin": origin, "Access-Control-Request-Method": "POST"}
    )
    assert preflight.status_code == 403 and cors_headers(preflight) == {}


@pytest.mark.parametrize(
    "origin", ["http://localhost:5173", "https://127.0.0.1", "http://[::1]:8080", "app://desk", "tauri://localhost"]
)
def test_a_local_origin_is_allowed(cors_gateway, origin):
    resp = cors_gateway.client.get("/v1/models", headers={"Origin": origin})
    assert resp.status_code == 200
    headers = cors_headers(resp)
    assert headers["access-control-allow-origin"] == origin
    assert "access-control-allow-credentials" not in headers
    assert "x-moe-domain" in headers["access-control-expose-headers"].lower()
    assert "origin" in resp.headers["vary"].lower()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models", "/api/chat", "/api/tags", "/healthz"])
def test_preflights_are_answered_by_the_gateway(cors_gateway, path):
    resp = cors_gateway.client.options(
        path,
        headers={
            "Origin": "http://localhost:3000",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-moe-domain, x-stainless-os",
        },
    )
    assert resp.status_code == 204 and resp.content == b""
    headers = cors_headers(resp)
    assert headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in headers["access-control-allow-methods"]
    assert headers["access-control-allow-headers"] == "authorization, content-type, x-moe-domain, x-stainless-os"
    assert "access-control-allow-credentials" not in headers
    assert "server" not in resp.headers or resp.headers["server"] != "llama.cpp"


def test_preflights_need_no_api_key_but_requests_do(start_gateway, llama32):
    gw = start_gateway(llama32.url, MOE_L2_PROXY_API_KEYS="secret")
    origin = {"Origin": "http://localhost:3000"}
    preflight = gw.client.options("/v1/chat/completions", headers={**origin, "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 204
    refused = gw.client.post("/v1/chat/completions", json=chat_body(), headers=origin)
    # the page can read why it was refused
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == origin["Origin"]
    ok = gw.client.post("/v1/chat/completions", json=chat_body(), headers={**origin, "Authorization": "Bearer secret"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == origin["Origin"]


def test_moe_l2_origins_adds_origins(start_gateway, llama32):
    gw = start_gateway(llama32.url, MOE_L2_PROXY_ORIGINS="https://*.example.com, https://chat.example.org")
    for origin in ("https://app.example.com", "https://chat.example.org", "http://localhost:1"):
        resp = gw.client.get("/v1/models", headers={"Origin": origin})
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == origin
    for origin in ("https://example.com", "http://app.example.com", "https://chat.example.org.evil"):
        assert gw.client.get("/v1/models", headers={"Origin": origin}).status_code == 403
    every = start_gateway(llama32.url, MOE_L2_PROXY_ORIGINS="*")
    resp = every.client.get("/v1/models", headers={"Origin": "https://anywhere.example"})
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "*"


# --- a real browser ------------------------------------------------------------------------------

PAGE = """<!doctype html>
<html><body><pre id="out">pending</pre>
<script>
const gateway = %(gateway)s;
async function attempt(path, init) {
  try {
    const resp = await fetch(gateway + path, init);
    return "read " + resp.status + " " + (await resp.text()).slice(0, 4000);
  } catch (err) {
    return "blocked " + err;
  }
}
async function main() {
  const json = {"Content-Type": "application/json"};
  const results = {
    chat: await attempt("/v1/chat/completions",
      {method: "POST", headers: json, body: JSON.stringify(%(chat)s)}),
    models: await attempt("/v1/models", {}),
    ollama: await attempt("/api/chat", {method: "POST", headers: json,
      body: JSON.stringify({model: "demo", stream: false, messages: [{role: "user", content: "hi"}],
                            options: {num_predict: 2}})}),
    simple: await attempt("/v1/completions", {method: "POST", headers: {"Content-Type": "text/plain"},
      body: JSON.stringify({prompt: "hi", max_tokens: 2})}),
  };
  document.getElementById("out").textContent = JSON.stringify(results);
}
main();
</script></body></html>
"""


@dataclass
class PageServer:
    local: str  # http://localhost:PORT
    foreign: str  # http://127.0.0.2:PORT
    pages: dict[str, bytes] = field(default_factory=dict)  # path -> HTML


@pytest.fixture(scope="module")
def page_server() -> Iterator[PageServer]:
    """The same test page from two origins: a local one (http://localhost:PORT) and a foreign one
    (http://127.0.0.2:PORT: a loopback address, but not one of the local origins)."""
    pages: dict[str, bytes] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path, b"")
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    servers = []
    origins: dict[str, str] = {}
    for name, bind, host in (("local", "127.0.0.1", "localhost"), ("foreign", "127.0.0.2", "127.0.0.2")):
        port = free_port()
        server = ThreadingHTTPServer((bind, port), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        origins[name] = f"http://{host}:{port}"
    yield PageServer(local=origins["local"], foreign=origins["foreign"], pages=pages)
    for server in servers:
        server.shutdown()
        server.server_close()


def browse(url: str, profile: Path) -> dict[str, str]:
    """Loads `url` in headless Chromium and returns what its script wrote into the page."""
    argv = [
        chromium(),
        "--headless",
        "--no-sandbox",  # tests may run as root
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        f"--user-data-dir={profile}",
        # the page's fetches finish within this much virtual time (it does not advance while they wait)
        "--virtual-time-budget=60000",
        "--dump-dom",
        url,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    match = re.search(r'<pre id="out">(.*?)</pre>', done.stdout, re.S)
    assert match, f"no page output from Chromium (rc {done.returncode}): {done.stdout[-2000:]} {done.stderr[-2000:]}"
    text = html.unescape(match.group(1))
    assert text != "pending", "the page's script did not finish"
    return json.loads(text)


def test_in_a_browser_only_local_pages_can_read_answers(cors_gateway, page_server, tmp_path):
    chromium()
    chat = json.dumps(chat_body("hello from a web page", max_tokens=2))
    page = (PAGE % {"gateway": json.dumps(cors_gateway.url), "chat": chat}).encode()
    page_server.pages["/index.html"] = page
    before = cors_gateway.metric("moe_l2_requests_total", route="/v1/completions", status="200")

    foreign = browse(page_server.foreign + "/index.html", tmp_path / "foreign")
    for name, outcome in foreign.items():
        assert outcome.startswith("blocked "), (name, outcome)
    # the no-preflight ("simple") POST did not even reach llama
    assert cors_gateway.metric("moe_l2_requests_total", route="/v1/completions", status="200") == before

    local = browse(page_server.local + "/index.html", tmp_path / "local")
    for name, outcome in local.items():
        assert outcome.startswith("read 200 "), (name, outcome)
    assert '"chat.completion"' in local["chat"] and '"object":"list"' in local["models"].replace(" ", "")
    assert '"done":true' in local["ollama"].replace(" ", "")
