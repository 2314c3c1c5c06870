"""CORS, owned by the gateway: which web pages a user's browser lets talk to it.

llama-server reflects any `Origin` with `access-control-allow-credentials: true`, so relaying its
headers would let every web page the user visits drive the local model. Here, as Ollama does with
OLLAMA_ORIGINS, only local pages are allowed by default (http/https on localhost, 127.0.0.1,
[::1] and 0.0.0.0 with any port, and the app://, file://, tauri://, vscode-webview:// and
vscode-file:// schemes of desktop apps); MOE_L2_PROXY_ORIGINS adds others (`*` inside an entry matches
any characters but '/', a lone `*` allows every origin).

- A request with an allowed `Origin` is served and its answer carries `access-control-allow-origin`
  (that origin, or `*` when every origin is allowed) and `vary: Origin`; no credentials are
  allowed (API keys travel in `Authorization`, which the page sets itself).
- A request with any other `Origin` is refused with 403 before it reaches a handler: a page cannot
  read the answer anyway, and a "simple" cross-site POST would otherwise still start a generation.
- Preflights (`OPTIONS` with `Access-Control-Request-Method`) are answered here, for every route,
  before authentication (browsers send them without credentials); they never reach llama.
- Every `access-control-*` header of a relayed answer is dropped, whether or not there is an Origin.
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moe_l2_proxy.errors import error_response

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]", "0.0.0.0"})
APP_SCHEMES = frozenset({"app", "file", "tauri", "vscode-webview", "vscode-file"})
ALLOWED_METHODS = b"GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"
# what a page may read besides the CORS-safelisted headers
EXPOSED_HEADERS = b"X-MoE-Domain, X-MoE-Domain-Source, Server-Timing"
PREFLIGHT_MAX_AGE = b"600"


def is_local(origin: str) -> bool:
    scheme, sep, rest = origin.partition("://")
    if not sep:
        return False
    if scheme in APP_SCHEMES:
        return True
    if scheme not in ("http", "https"):
        return False
    if rest.startswith("["):  # [::1]:port
        host, _, after = rest.partition("]")
        host += "]"
        if after and not after.startswith(":"):
            return False
        port = after[1:]
    else:
        host, _, port = rest.partition(":")
    return host in LOCAL_HOSTS and (port == "" or port.isdigit())


def _pattern(entry: str) -> re.Pattern[str]:
    return re.compile("[^/]*".join(re.escape(part) for part in entry.lower().split("*")))


class OriginPolicy:
    def __init__(self, extra: list[str]) -> None:
        self.any = "*" in extra
        self.patterns = [_pattern(entry.rstrip("/")) for entry in extra if entry != "*"]

    def allows(self, origin: str) -> bool:
        if self.any:
            return True
        origin = origin.lower()
        return is_local(origin) or any(pattern.fullmatch(origin) for pattern in self.patterns)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def _without_cors(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if not k.lower().startswith(b"access-control-")]


class Cors:
    """Pure ASGI: one header scan per request and one per answer (not per streamed token)."""

    def __init__(self, app: ASGIApp, policy: OriginPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = _header(scope, b"origin")
        if origin is None:
            await self.app(scope, receive, self._stripping(send, []))
            return
        if not self.policy.allows(origin.decode("latin-1")):
            message = "this web origin may not call the gateway (allow it with MOE_L2_PROXY_ORIGINS)"
            await error_response(scope["path"], 403, message, code="origin_not_allowed")(scope, receive, send)
            return
        allow = [(b"access-control-allow-origin", b"*" if self.policy.any else origin)]
        request_method = _header(scope, b"access-control-request-method")
        if scope["method"] == "OPTIONS" and request_method is not None:
            await self._preflight(scope, send, allow)
            return
        allow.append((b"access-control-expose-headers", EXPOSED_HEADERS))
        await self.app(scope, receive, self._stripping(send, allow))

    @staticmethod
    def _stripping(send: Send, allow: list[tuple[bytes, bytes]]) -> Send:
        async def send_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = _without_cors(list(message.get("headers", [])))
                if allow:
                    headers += allow
                    headers = _vary(headers, b"Origin")
                message = {**message, "headers": headers}
            await send(message)

        return send_cors

    @staticmethod
    async def _preflight(scope: Scope, send: Send, allow: list[tuple[bytes, bytes]]) -> None:
        headers = [
            *allow,
            (b"access-control-allow-methods", ALLOWED_METHODS),
            (b"access-control-max-age", PREFLIGHT_MAX_AGE),
            (b"vary", b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers"),
            (b"content-length", b"0"),
        ]
        requested = _header(scope, b"access-control-request-headers")
        if requested:
            # the origin is trusted: whatever headers its page wants to send (Authorization, the
            # OpenAI SDK's x-stainless-*, X-MoE-Domain, ...)
            headers.append((b"access-control-allow-headers", requested))
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _vary(headers: list[tuple[bytes, bytes]], field: bytes) -> list[tuple[bytes, bytes]]:
    for i, (name, value) in enumerate(headers):
        if name.lower() == b"vary":
            if field.lower() not in value.lower():
                headers[i] = (name, value + b", " + field)
            return headers
    headers.append((b"vary", field))
    return headers
