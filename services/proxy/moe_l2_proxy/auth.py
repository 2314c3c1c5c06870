"""Optional API keys (MOE_L2_PROXY_API_KEYS): `Authorization: Bearer <key>` on every route but the probes."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from moe_l2_proxy.errors import error_response

# Liveness, readiness and scraping stay open: orchestrators and Prometheus carry no key.
OPEN_PATHS = frozenset({"/", "/healthz", "/readyz", "/metrics"})


def bearer_token(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class ApiKeyAuth:
    """Pure ASGI check, answered before the body is read; 401 in the API's own error format."""

    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        self.app = app
        self.keys = [key.encode() for key in keys]

    def allowed(self, token: str | None) -> bool:
        if token is None:
            return False
        candidate = token.encode()
        # compare against every key in constant time, so timing does not tell which prefix matched
        return any([hmac.compare_digest(candidate, key) for key in self.keys])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        if self.allowed(token):
            await self.app(scope, receive, send)
            return
        message = "missing API key (Authorization: Bearer ...)" if token is None else "invalid API key"
        response = error_response(
            scope["path"], 401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
        await response(scope, receive, send)
