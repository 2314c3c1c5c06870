"""The predictor replicas: round-robin balancing, failover within the time budget, cooldown of a failing one.

Each configured URL is expanded to one endpoint per address its host name resolves to
(discovery.py), re-resolved in the background; a request never waits on DNS.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
from pydantic import ValidationError

from moe_l2_contracts.schemas.predict import PredictRequest, PredictResponse
from moe_l2_proxy.discovery import Endpoint, Resolver, expand, has_host_name, resolve_all
from moe_l2_proxy.metrics import GatewayMetrics

log = logging.getLogger("moe_l2_proxy.predictor")


class PredictorPool:
    def __init__(
        self,
        urls: list[str],
        client: httpx.AsyncClient,
        metrics: GatewayMetrics,
        cooldown_s: float = 5.0,
        dns_refresh_s: float = 10.0,
        resolver: Resolver = resolve_all,
    ) -> None:
        self.urls = urls
        self.client = client
        self.metrics = metrics
        self.cooldown_s = cooldown_s
        self.dns_refresh_s = dns_refresh_s
        self.resolver = resolver
        self.endpoints: list[Endpoint] = [Endpoint(u.rstrip("/")) for u in urls]
        self.cooling_until: dict[str, float] = {}
        self._next = 0
        self._refresher: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        endpoints: list[Endpoint] = []
        for url in self.urls:
            for endpoint in await expand(url, self.resolver):
                if endpoint not in endpoints:
                    endpoints.append(endpoint)
        if endpoints != self.endpoints:
            log.info("predictor endpoints: %s", ", ".join(e.url for e in endpoints) or "none")
        self.endpoints = endpoints

    async def start(self) -> None:
        await self.refresh()
        if has_host_name(self.urls):
            self._refresher = asyncio.create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.dns_refresh_s)
            try:
                await self.refresh()
            except Exception:  # a DNS hiccup must not end the refresher
                log.exception("refreshing predictor endpoints failed")

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            self._refresher = None

    def candidates(self) -> list[Endpoint]:
        """Endpoints not cooling down, starting with the next in round-robin order."""
        n = len(self.endpoints)
        if not n:
            return []
        start = self._next % n
        self._next = start + 1
        now = time.monotonic()
        ordered = self.endpoints[start:] + self.endpoints[:start]
        return [e for e in ordered if self.cooling_until.get(e.url, 0.0) <= now]

    def cool_down(self, endpoint: Endpoint, reason: str) -> None:
        self.cooling_until[endpoint.url] = time.monotonic() + self.cooldown_s
        self.metrics.predictor_failures.labels(endpoint.url, reason).inc()

    async def predict(self, request: PredictRequest, budget_s: float) -> PredictResponse | None:
        """The first answer of a healthy replica within the budget, else None (the caller falls back)."""
        candidates = self.candidates()
        if not candidates or budget_s <= 0:
            return None
        body = request.model_dump_json(exclude_none=True).encode()
        trying: list[Endpoint] = []
        try:
            return await asyncio.wait_for(self._first_answer(candidates, body, trying), budget_s)
        except TimeoutError:
            if trying:
                # the replica being asked let the budget pass: skip it for a while
                self.cool_down(trying[-1], "timeout")
            return None

    async def _first_answer(
        self, candidates: list[Endpoint], body: bytes, trying: list[Endpoint]
    ) -> PredictResponse | None:
        for endpoint in candidates:
            trying.append(endpoint)
            answer = await self._ask(endpoint, body)
            if answer is not None:
                return answer
        return None

    async def _ask(self, endpoint: Endpoint, body: bytes) -> PredictResponse | None:
        headers = {"content-type": "application/json"}
        if endpoint.host_header:
            headers["host"] = endpoint.host_header
        t0 = time.perf_counter()
        try:
            resp = await self.client.post(f"{endpoint.url}/v1/predict", content=body, headers=headers)
        except httpx.HTTPError as exc:
            self.cool_down(endpoint, "unreachable" if isinstance(exc, httpx.ConnectError) else "transport")
            return None
        finally:
            self.metrics.predictor_seconds.labels(endpoint.url).observe(time.perf_counter() - t0)
        if resp.status_code != 200:
            self.cool_down(endpoint, f"status_{resp.status_code // 100}xx")
            return None
        try:
            return PredictResponse.model_validate_json(resp.content)
        except ValidationError:
            self.cool_down(endpoint, "invalid")
            return None

    def describe(self) -> list[dict[str, object]]:
        now = time.monotonic()
        return [
            {
                "url": e.url,
                "host": e.host_header,
                "cooldown_s": round(max(0.0, self.cooling_until.get(e.url, 0.0) - now), 2),
            }
            for e in self.endpoints
        ]
