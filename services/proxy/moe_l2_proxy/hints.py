"""Hints to the cache-manager (`POST /v1/hint {model, domain}`), fire-and-forget.

A request only puts its domain into a bounded queue (never waits); one background worker sends
them. When the cache-manager is slow or down the queue fills and further hints are dropped and
counted: a hint is an optimisation, a late one is worthless, and requests must not feel it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx

from moe_l2_contracts.schemas.hint import HintRequest
from moe_l2_proxy.metrics import GatewayMetrics

log = logging.getLogger("moe_l2_proxy.hints")


class HintSender:
    def __init__(
        self,
        cache_url: str,
        client: httpx.AsyncClient,
        metrics: GatewayMetrics,
        queue_size: int,
    ) -> None:
        self.url = f"{cache_url.rstrip('/')}/v1/hint"
        self.client = client
        self.metrics = metrics
        self.queue: asyncio.Queue[str] = asyncio.Queue(maxsize=queue_size)
        self._worker: asyncio.Task[None] | None = None

    def offer(self, domain: str) -> None:
        """Queue a hint without waiting; dropped (and counted) when the queue is full."""
        try:
            self.queue.put_nowait(domain)
        except asyncio.QueueFull:
            self.metrics.hints_dropped.inc()

    def start(self) -> None:
        self._worker = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None

    async def _run(self) -> None:
        while True:
            domain = await self.queue.get()
            try:
                await self.send(domain)
            except Exception:  # the worker must outlive any single failure
                log.exception("sending a hint failed")

    async def send(self, domain: str) -> None:
        hint = HintRequest(domain=domain)
        try:
            resp = await self.client.post(self.url, content=hint.model_dump_json(), headers=_JSON)
        except httpx.HTTPError as exc:
            self.metrics.hints.labels("failed").inc()
            log.debug("hint not delivered: %s", type(exc).__name__)
            return
        self.metrics.hints.labels("sent" if resp.status_code < 400 else "rejected").inc()


_JSON = {"content-type": "application/json"}
