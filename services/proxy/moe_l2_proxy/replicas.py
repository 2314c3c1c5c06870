"""The llama replicas: which one serves a request (routing.py), failover before the client sees a
byte, rest and return of a failing replica, and each replica's cache-manager.

Each entry of MOE_L2_LLAMA_URLS is expanded to one replica per address of its host name
(discovery.py), re-resolved in the background: `docker compose up --scale llama=N` and a
Kubernetes headless Service need one name. A replica that disappears from DNS takes no new
request; the requests it has finish (draining).

A request is retried on the next replica when the one it went to failed before answering: the
connection was refused or broke before llama's response head (streams) or before the end of the
answer (blocking requests, which the gateway reads whole before it sends anything), or llama
answered 503 (still loading its model). Running a generation again elsewhere costs compute, never
correctness: it has no side effects, and the client sees one answer. A timeout is not retried (the
generation may just be long). The failed replica rests: no requests for MOE_L2_PROXY_LLAMA_COOLDOWN_S,
then until its /health answers 200 (asked every MOE_L2_PROXY_LLAMA_PROBE_INTERVAL_S), so a restarted
llama takes traffic again (and its domains come back to it) as soon as it has loaded its model.
When every replica rests, requests still try them all, in the order they would return.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from moe_l2_proxy.discovery import Endpoint, Resolver, expand, has_host_name, resolve_all
from moe_l2_proxy.errors import GatewayError
from moe_l2_proxy.hints import HintSender
from moe_l2_proxy.limits import Admission
from moe_l2_proxy.metrics import GatewayMetrics
from moe_l2_proxy.routing import routing_policy
from moe_l2_proxy.settings import ProxySettings
from moe_l2_proxy.upstream import LlamaUpstream, forward_headers, llama_authorization, transport_failure

log = logging.getLogger("moe_l2_proxy.replicas")

# GatewayError codes of failures that happened before llama could have answered anything
RETRYABLE = frozenset({"upstream_unavailable", "upstream_protocol"})
HOST_PLACEHOLDER = "{host}"

Send = Callable[[LlamaUpstream], Awaitable[httpx.Response]]


@dataclass(eq=False)
class LlamaReplica:
    key: str  # host:port as dialled: the `replica` label, and the replica's name on the hash ring
    upstream: LlamaUpstream
    hints: HintSender | None
    in_flight: int = 0
    requests: int = 0
    resting: bool = False
    resting_until: float = 0.0  # monotonic; after it, /health decides
    domains: dict[str, int] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.upstream.url


class Lease:
    """A request's hold on a replica: counted in flight until released (once, whatever happens)."""

    def __init__(self, pool: LlamaPool, replica: LlamaReplica) -> None:
        self.pool = pool
        self.replica = replica
        self.released = False
        self.admitted = False  # holds a place of the pool's Admission, given back on release
        replica.in_flight += 1
        pool.metrics.labelled(pool.metrics.replica_in_flight, replica.key).inc()

    async def held_by_stream(self, upstream: httpx.Response, stream: bool) -> bool:
        """True when `upstream` is a stream to relay (whose close releases the lease); any other
        answer is read whole here and the replica released at once."""
        if stream and upstream.status_code == 200:
            return True
        try:
            if stream:
                await upstream.aread()
                await upstream.aclose()
        finally:
            self.release()
        return False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.replica.in_flight -= 1
            self.pool.metrics.labelled(self.pool.metrics.replica_in_flight, self.replica.key).dec()
            if self.admitted:
                self.pool.admission.release()


def replica_key(url: str) -> str:
    parts = urlsplit(url)
    return parts.netloc.rpartition("@")[2] or url


def cache_url_for(template: str | None, endpoint: Endpoint) -> str | None:
    if template is None:
        return None
    host = urlsplit(endpoint.url).hostname or ""
    return template.replace(HOST_PLACEHOLDER, f"[{host}]" if ":" in host else host)


class LlamaPool:
    def __init__(
        self,
        settings: ProxySettings,
        metrics: GatewayMetrics,
        client: httpx.AsyncClient,
        transport: httpx.AsyncBaseTransport,
        hint_client: httpx.AsyncClient | None,
        domains: Iterable[str],
        resolver: Resolver = resolve_all,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.client = client
        self.transport = transport
        self.hint_client = hint_client
        self.resolver = resolver
        self.urls = settings.llama_url_list
        discover = settings.cache_pairing == "discover"
        self.cache_templates = [None] * len(self.urls) if discover else settings.cache_url_templates()
        self.authorization = llama_authorization(settings)
        self.policy = routing_policy(settings.routing, domains, settings.routing_epsilon)
        self.admission = Admission(settings.llama_max_connections, settings.max_waiting, settings.wait_timeout_s)
        self.replicas: list[LlamaReplica] = []
        self._senders: dict[str, HintSender] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # -- membership ------------------------------------------------------------------------------------

    async def refresh(self) -> None:
        await self._refresh_replicas()
        if self.settings.cache_pairing == "discover":
            await self._discover_cache_managers()

    async def _refresh_replicas(self) -> None:
        known = {r.key: r for r in self.replicas}
        replicas: list[LlamaReplica] = []
        for url, template in zip(self.urls, self.cache_templates, strict=True):
            for endpoint in await expand(url, self.resolver, "llama"):
                key = replica_key(endpoint.url)
                if any(r.key == key for r in replicas):
                    continue
                replica = known.get(key) or self._replica(key, endpoint, cache_url_for(template, endpoint))
                replicas.append(replica)
        if [r.key for r in replicas] != [r.key for r in self.replicas]:
            log.info("llama replicas: %s", ", ".join(r.url for r in replicas) or "none")
        self.replicas = replicas

    async def _discover_cache_managers(self) -> None:
        """Each replica's hints to the cache-manager that says it serves that replica (GET /v1/stats
        `llama_url`): with `--scale cache-manager=N`, each one claims a llama replica of its own."""
        serving: dict[str, str] = {}
        for url in self.settings.cache_url_list:
            for endpoint in await expand(url, self.resolver, "cache-manager"):
                llama = await self._served_by(endpoint.url)
                if llama is None:
                    continue
                # a cache-manager that claims no replica names llama as configured (a host name)
                for served in await expand(llama, self.resolver, "llama"):
                    serving.setdefault(replica_key(served.url), endpoint.url)
        for replica in self.replicas:
            cache_url = serving.get(replica.key)
            if (replica.hints.url if replica.hints else None) != (f"{cache_url}/v1/hint" if cache_url else None):
                log.info("llama replica %s: cache-manager %s", replica.url, cache_url or "none")
                replica.hints = self._sender(cache_url)

    async def _served_by(self, cache_url: str) -> str | None:
        if self.hint_client is None:
            return None
        try:
            resp = await self.hint_client.get(f"{cache_url}/v1/stats")
            llama = resp.json().get("llama_url") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return llama if isinstance(llama, str) else None

    def _replica(self, key: str, endpoint: Endpoint, cache_url: str | None) -> LlamaReplica:
        upstream = LlamaUpstream(endpoint.url, self.settings, self.metrics, self.client, self.transport)
        self.metrics.labelled(self.metrics.replica_healthy, key).set(1)
        self.metrics.labelled(self.metrics.replica_in_flight, key).set(0)
        return LlamaReplica(key, upstream, self._sender(cache_url))

    def _sender(self, cache_url: str | None) -> HintSender | None:
        if not cache_url or self.hint_client is None:
            return None
        sender = self._senders.get(cache_url)
        if sender is None:
            sender = self._senders[cache_url] = HintSender(
                cache_url, self.hint_client, self.metrics, self.settings.hint_queue_size
            )
            sender.start()
        return sender

    async def start(self) -> None:
        await self.refresh()
        if has_host_name(self.urls) or self.settings.cache_pairing == "discover":
            self._tasks.append(asyncio.create_task(self._refresh_forever()))
        self._tasks.append(asyncio.create_task(self._probe_forever()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for sender in self._senders.values():
            await sender.stop()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.llama_dns_refresh_s)
            try:
                await self.refresh()
            except Exception:  # a DNS hiccup must not end the refresher
                log.exception("refreshing llama replicas failed")

    # -- rest and return -------------------------------------------------------------------------------

    def rest(self, replica: LlamaReplica, reason: str) -> None:
        self.metrics.labelled(self.metrics.replica_failures, replica.key, reason).inc()
        replica.resting_until = time.monotonic() + self.settings.llama_cooldown_s
        if not replica.resting:
            replica.resting = True
            self.metrics.labelled(self.metrics.replica_healthy, replica.key).set(0)
            log.warning("llama replica %s out of rotation (%s)", replica.url, reason)

    def back(self, replica: LlamaReplica) -> None:
        if replica.resting:
            replica.resting = False
            self.metrics.labelled(self.metrics.replica_healthy, replica.key).set(1)
            log.info("llama replica %s back in rotation", replica.url)

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.llama_probe_interval_s)
            now = time.monotonic()
            due = [r for r in self.replicas if r.resting and r.resting_until <= now]
            if due:
                await asyncio.gather(*(self._probe(r) for r in due))

    async def _probe(self, replica: LlamaReplica) -> None:
        try:
            resp = await replica.upstream.get("/health", timeout_s=2.0)
        except httpx.HTTPError:
            return
        if resp.status_code == 200:
            self.back(replica)

    # -- routing ---------------------------------------------------------------------------------------

    def choose(self, domain: str | None) -> list[LlamaReplica]:
        """The replicas to try, in order: the policy's choice first, resting ones last."""
        if not self.replicas:
            raise GatewayError(
                503, "no llama replica is configured: set MOE_L2_LLAMA_URLS (or MOE_L2_LLAMA_URL)", code="no_replicas"
            )
        ready = [r for r in self.replicas if not r.resting]
        resting = sorted((r for r in self.replicas if r.resting), key=lambda r: r.resting_until)
        ordered, outcome = self.policy.order(domain, ready or resting)
        if ready:
            ordered += resting
        self.metrics.labelled(self.metrics.routing_decisions, self.policy.name, outcome).inc()
        return ordered

    def lease(self, replica: LlamaReplica, domain: str | None, hint: bool) -> Lease:
        label = self.metrics.domain_label(domain) if domain else "none"
        self.metrics.labelled(self.metrics.replica_requests, replica.key, label).inc()
        replica.requests += 1
        replica.domains[label] = replica.domains.get(label, 0) + 1
        if hint and domain and replica.hints is not None:
            replica.hints.offer(domain)
        return Lease(self, replica)

    async def send(self, domain: str | None, send: Send, *, hint: bool = True) -> tuple[Lease, httpx.Response]:
        """llama's answer from the first replica that gives one, and the lease the caller releases
        once the answer is done (a stream: when it closes). `hint`: tell that replica's cache-manager
        which domain is coming."""
        order = self.choose(domain)
        await self.admission.acquire()
        try:
            lease, response = await self._try_replicas(order, domain, send, hint)
        except BaseException:
            self.admission.release()
            raise
        lease.admitted = True
        return lease, response

    async def _try_replicas(
        self, order: list[LlamaReplica], domain: str | None, send: Send, hint: bool
    ) -> tuple[Lease, httpx.Response]:
        failures: list[GatewayError] = []
        for attempt, replica in enumerate(order):
            if attempt:
                self.metrics.labelled(self.metrics.routing_decisions, self.policy.name, "retry").inc()
            lease = self.lease(replica, domain, hint)
            try:
                response = await send(replica.upstream)
            except GatewayError as exc:
                lease.release()
                if exc.code not in RETRYABLE:
                    raise
                self.rest(replica, exc.code.removeprefix("upstream_"))
                failures.append(exc)
                continue
            except BaseException:
                lease.release()
                raise
            if response.status_code == 503 and attempt + 1 < len(order):
                # llama loading its model or stopping: another replica may answer now
                await response.aclose()
                lease.release()
                self.rest(replica, "status_503")
                failures.append(GatewayError(503, f"llama replica {replica.url} answered 503", code="upstream_status"))
                continue
            if attempt or replica.resting:
                self.back(replica)
            return lease, response
        raise self.exhausted(failures)

    def exhausted(self, failures: list[GatewayError]) -> GatewayError:
        if len(failures) == 1:
            return failures[0]  # one replica: its own error, as a single llama gives it
        last = failures[-1]
        return GatewayError(
            503,
            f"all {len(failures)} llama replicas failed; the last: {last.message}",
            code="upstream_unavailable",
        )

    def forward_headers(self, client_headers: Iterable[tuple[str, str]], domain: str | None) -> dict[str, str]:
        return forward_headers(client_headers, domain, self.authorization)

    def own_headers(self, domain: str | None = None) -> dict[str, str]:
        """Headers of a request the gateway makes itself (the Ollama translation)."""
        return self.forward_headers((("content-type", "application/json"),), domain)

    def transport_error(self, exc: httpx.HTTPError) -> GatewayError:
        return transport_failure(self.metrics, exc)

    async def get_json(self, path: str, timeout_s: float = 5.0) -> dict:
        """A JSON document from the first replica that gives it (model list, props)."""
        failure: GatewayError | None = None
        for replica in self.choose(None):
            try:
                return await replica.upstream.get_json(path, timeout_s)
            except GatewayError as exc:
                failure = exc
        assert failure is not None
        raise failure

    # -- what /moe/stats shows -------------------------------------------------------------------------

    def hints_queued(self) -> int:
        return sum(sender.queue.qsize() for sender in self._senders.values())

    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [
            {
                "replica": r.key,
                "url": r.url,
                "healthy": not r.resting,
                "cooldown_s": round(max(0.0, r.resting_until - now), 2) if r.resting else 0.0,
                "in_flight": r.in_flight,
                "requests": r.requests,
                "domains": dict(sorted(r.domains.items())),
                "cache_url": r.hints.url.removesuffix("/v1/hint") if r.hints is not None else None,
            }
            for r in self.replicas
        ]
