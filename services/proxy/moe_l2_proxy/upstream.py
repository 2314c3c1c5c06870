"""The connection to llama-server: one pooled httpx client, header hygiene, transport errors as gateway errors."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import httpx

from moe_l2_contracts.admin import ADMIN_TOKEN_HEADER
from moe_l2_proxy.errors import GatewayError
from moe_l2_proxy.http1_transport import Http1Transport, request_message
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


class LlamaUpstream:
    def __init__(self, settings: ProxySettings, metrics: GatewayMetrics) -> None:
        self.url = settings.llama_url.rstrip("/")
        self.metrics = metrics
        self.authorization = f"Bearer {settings.llama_api_key}" if settings.llama_api_key else None
        self.transport = Http1Transport(
            max_connections=settings.llama_max_connections,
            max_keepalive=min(settings.llama_max_connections, 128),
            keepalive_expiry=4.0,  # under llama-server's keep-alive timeout (5 s), so it never closes first
            on_retry=lambda: metrics.upstream_errors.labels("llama", "retried").inc(),
        )
        self.client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(
                connect=settings.llama_connect_timeout_s,
                read=settings.llama_read_timeout_s,
                write=60.0,
                # waiting for a free connection: only when more requests are in flight than the limit
                pool=30.0,
            ),
            # the per-token relay path: httptools instead of httpcore/h11/anyio (see http1_transport)
            transport=self.transport,
        )
        self._timeouts = self.client.timeout.as_dict()
        url = httpx.URL(self.url)
        self._scheme = url.scheme
        self._origin = (url.host, url.port or 80)
        self._prefix = url.raw_path.decode("ascii").rstrip("/")

    def forward_headers(self, client_headers: Iterable[tuple[str, str]], domain: str | None) -> dict[str, str]:
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
        if self.authorization:
            headers["authorization"] = self.authorization
        if domain:
            headers[DOMAIN_HEADER] = domain
        return headers

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
        try:
            if self._scheme != "http":
                raise httpx.UnsupportedProtocol(f"MOE_L2_LLAMA_URL must be http://, not {self._scheme}://")
            # The message is built here, not as an httpx.Request through client.send: URL parsing, header
            # normalisation and the client's auth, redirect and cookie layers are most of the gateway's
            # own CPU per request, and have nothing to do for llama.
            host, port = self._origin
            message = request_message(method, host, port, self._prefix + path, headers, content)
            # No retry here: once llama may have started on a request, sending it again could run a
            # generation twice. The transport itself resends only what a dead idle connection never took.
            response = await self.transport.exchange(self._origin, method, message, self._timeouts)
            if not stream:
                try:
                    await response.aread()
                except BaseException:
                    await response.aclose()
                    raise
            return response
        except httpx.HTTPError as exc:
            raise self.transport_error(exc) from exc

    def transport_error(self, exc: httpx.HTTPError) -> GatewayError:
        kind, status, message = classify(exc)
        self.metrics.upstream_errors.labels("llama", kind).inc()
        log.warning("llama %s: %s", kind, type(exc).__name__)
        return GatewayError(status, message, code=f"upstream_{kind}")

    async def get_json(self, path: str, timeout_s: float = 5.0) -> dict:
        """GET a JSON document from llama (model list, props, hot set), as a gateway error if it fails."""
        try:
            resp = await self.client.get(path, headers=self.own_headers(), timeout=timeout_s)
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

    async def aclose(self) -> None:
        await self.client.aclose()


def classify(exc: httpx.HTTPError) -> tuple[str, int, str]:
    """(metric kind, status, message) for a transport failure."""
    if isinstance(exc, httpx.PoolTimeout):
        return "pool_timeout", 503, "the gateway has too many requests in flight to llama-server; retry later"
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return "unavailable", 503, "llama-server is unavailable (connection failed); retry later"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout", 504, "llama-server did not answer in time"
    return "protocol", 502, f"llama-server connection failed: {type(exc).__name__}"
