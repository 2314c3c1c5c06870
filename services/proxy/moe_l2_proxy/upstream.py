"""Requests to llama-server through httpx's interfaces (made in the app's lifespan), header hygiene,
transport errors as gateway errors.

The relayed requests go to the transport through httpx's transport interface
(`handle_async_request(httpx.Request) -> httpx.Response`, the response's stream, `aread`, `aclose`);
the gateway's own requests (health, metrics, model list) through the pooled client on the same
transport. Either transport fits under both (app.py `llama_transport`), and the errors are the same
httpx exceptions with both. Why the hot path skips the client: see `LlamaUpstream.send`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import lru_cache

import httpx

from moe_l2_contracts.admin import ADMIN_TOKEN_HEADER
from moe_l2_proxy.errors import GatewayError
from moe_l2_proxy.metrics import GatewayMetrics
from moe_l2_proxy.settings import ProxySettings

log = logging.getLogger("moe_l2_proxy.upstream")

DOMAIN_HEADER = "x-moe-domain"

# Never forwarded towards llama: hop-by-hop headers (the gateway answers `Expect: 100-continue`
# itself and frames the body; what a header named in `Connection:` says is for the gateway alone),
# what is recomputed, the client's own credentials (llama gets MOE_L2_PROXY_LLAMA_API_KEY or nothing),
# the services' admin token and the domain tag (the gateway sets it).
_REQUEST_DROP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
        "host",
        "content-length",
        "authorization",
        ADMIN_TOKEN_HEADER.lower(),
        DOMAIN_HEADER,
    }
)
# Never relayed back: hop-by-hop headers, the length of a body the gateway may reframe, and the
# server's own `date`/`server` (uvicorn sets them).
_RESPONSE_DROP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "trailer", "upgrade", "date", "server"}
)


def response_headers(upstream: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_DROP}


@lru_cache(maxsize=256)
def upstream_url(base: str, target: str) -> httpx.URL:
    # httpx parses a URL string in Python, ~20 µs a request here; the targets are few (the generation
    # routes, the Ollama translation's) and repeat, and an httpx.URL is immutable, so one parse each
    return httpx.URL(base + target)


class LlamaUpstream:
    def __init__(
        self,
        url: str,
        settings: ProxySettings,
        metrics: GatewayMetrics,
        client: httpx.AsyncClient,
        transport: httpx.AsyncBaseTransport,
    ) -> None:
        """One llama replica at `url`. `transport` is the one under `client` (the client closes it);
        both are shared by every replica (their connection pools are per address)."""
        self.url = url.rstrip("/")
        self.metrics = metrics
        self.authorization = llama_authorization(settings)
        self.client = client
        self.transport = transport
        # what the client would attach to each request it builds: the same explicit timeouts
        self.timeout = client.timeout.as_dict()

    def forward_headers(self, client_headers: Iterable[tuple[str, str]], domain: str | None) -> dict[str, str]:
        return forward_headers(client_headers, domain, self.authorization)

    def own_headers(self, domain: str | None = None) -> dict[str, str]:
        """Headers of a request the gateway makes itself (Ollama translation, probes)."""
        return self.forward_headers((("content-type", "application/json"),), domain)

    async def send(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str],
        content: bytes | None = None,
        stream: bool = False,
    ) -> httpx.Response:
        """One request to llama; with stream=True the caller must close the response. `path` is the
        request target (path and query), already percent-encoded."""
        # An httpx.Request of its own, not client.build_request: the client's default headers (its
        # user agent, Accept-Encoding) are not the client's to add to a forwarded request, and its
        # cookies are none of llama's business. Handed to the transport, not to client.send: the
        # client's auth, redirect, cookie and event-hook layers do nothing for a forwarded request
        # and cost ~65 µs of CPU per request here, and its stream wrapper one more generator per
        # relayed piece (gateway CPU per request 0.57 -> 0.77 ms through client.send,
        # bench/gateway_overhead.py, docs/proxy.md "Measured").
        try:
            url = upstream_url(self.url, path)
        except httpx.InvalidURL as exc:  # a target uvicorn took but httpx will not send (e.g. over 64 KiB)
            raise GatewayError(400, f"the request target cannot be forwarded: {exc}", code="invalid_request") from exc
        # The header bytes as the client sent them: Starlette decoded them as latin-1, and httpx would
        # encode str values as ASCII, failing a request that carries a UTF-8 value.
        raw = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
        request = httpx.Request(method, url, headers=raw, content=content, extensions={"timeout": self.timeout})
        try:
            # No retry here: once llama may have started on a request, sending it again could run a
            # generation twice. The fast transport itself resends only what a dead idle connection never took.
            response = await self.transport.handle_async_request(request)
            response.request = request
            if not stream:
                try:
                    await response.aread()
                finally:
                    await response.aclose()
            return response
        except httpx.HTTPError as exc:
            raise self.transport_error(exc) from exc

    def transport_error(self, exc: httpx.HTTPError) -> GatewayError:
        return transport_failure(self.metrics, exc)

    async def get(self, path: str, timeout_s: float) -> httpx.Response:
        """A GET of the gateway's own (health, metrics); httpx's errors as they are."""
        return await self.client.get(self.url + path, headers=self.own_headers(), timeout=timeout_s)

    async def get_json(self, path: str, timeout_s: float = 5.0) -> dict:
        """GET a JSON document from llama (model list, props, hot set), as a gateway error if it fails."""
        try:
            resp = await self.get(path, timeout_s)
        except httpx.HTTPError as exc:
            raise self.transport_error(exc) from exc
        if resp.status_code != 200:
            self.metrics.upstream_errors.labels("llama", "status").inc()
            raise GatewayError(502, f"llama-server answered {resp.status_code} to GET {path}", code="upstream_status")
        try:
            data = resp.json()
        except ValueError as exc:
            raise GatewayError(502, f"llama-server sent invalid JSON for GET {path}", code="upstream_invalid") from exc
        return data if isinstance(data, dict) else {"data": data}


def llama_authorization(settings: ProxySettings) -> str | None:
    return f"Bearer {settings.llama_api_key}" if settings.llama_api_key else None


def forward_headers(
    client_headers: Iterable[tuple[str, str]], domain: str | None, authorization: str | None
) -> dict[str, str]:
    """The client's headers as llama gets them: hop-by-hop and private ones dropped, llama's own
    credentials and the domain tag set."""
    headers = {}
    named: list[str] = []
    for k, v in client_headers:
        lower = k.lower()
        if lower in _REQUEST_DROP:
            if lower == "connection":
                named.append(v)
            continue
        headers[k] = v
    if named:
        # `Connection: foo` makes `foo` hop-by-hop too: meant for the gateway, not for llama
        hop = {token.strip().lower() for value in named for token in value.split(",")}
        headers = {k: v for k, v in headers.items() if k.lower() not in hop}
    if authorization:
        headers["authorization"] = authorization
    if domain:
        headers[DOMAIN_HEADER] = domain
    return headers


def transport_failure(metrics: GatewayMetrics, exc: httpx.HTTPError) -> GatewayError:
    """A transport failure talking to llama as the gateway error the client gets (counted, logged)."""
    kind, status, message = classify(exc)
    metrics.upstream_errors.labels("llama", kind).inc()
    log.warning("llama %s: %s", kind, type(exc).__name__)
    return GatewayError(status, message, code=f"upstream_{kind}")


def classify(exc: httpx.HTTPError) -> tuple[str, int, str]:
    """(metric kind, status, message) for a transport failure."""
    if isinstance(exc, httpx.PoolTimeout):
        return "pool_timeout", 503, "the gateway has too many requests in flight to llama-server; retry later"
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return "unavailable", 503, "llama-server is unavailable (connection failed); retry later"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout", 504, "llama-server did not answer in time"
    return "protocol", 502, f"llama-server connection failed: {type(exc).__name__}"
