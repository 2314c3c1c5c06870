"""What a request handler needs, built once in the app's lifespan and kept on `app.state.gateway`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.types import Receive

from moe_l2_proxy.domain import Decision, DomainResolver
from moe_l2_proxy.errors import GatewayError, describe_validation
from moe_l2_proxy.hints import HintSender
from moe_l2_proxy.metrics import GatewayMetrics, mark_disconnected
from moe_l2_proxy.predictor_pool import PredictorPool
from moe_l2_proxy.settings import ProxySettings
from moe_l2_proxy.upstream import LlamaUpstream

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


@dataclass
class Gateway:
    settings: ProxySettings
    metrics: GatewayMetrics
    llama: LlamaUpstream
    domains: DomainResolver
    predictors: PredictorPool | None
    hints: HintSender | None

    def record(self, decision: Decision) -> None:
        """Count the decision and tell the cache-manager which domain is coming (never waits)."""
        self.metrics.count_domain(decision.domain, decision.source)
        if self.hints is not None:
            self.hints.offer(decision.domain)


def gateway(request: Request) -> Gateway:
    return request.app.state.gateway  # type: ignore[no-any-return]


def parse_body(body: bytes, model: type[M]) -> M:
    """The JSON body as `model`; malformed JSON or a wrong shape is the client's 400."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_input=False)
        if any(err["type"] == "json_invalid" for err in errors) or not body.strip():
            raise GatewayError(400, "the request body is not valid JSON", code="invalid_json") from exc
        if any(err["type"] == "model_type" and not err["loc"] for err in errors):
            raise GatewayError(400, "the request body must be a JSON object", code="invalid_json") from exc
        raise GatewayError(400, f"invalid request: {describe_validation(errors)}", code="invalid_request") from exc


class ClientDisconnected(Exception):
    """The client left before the answer was ready; the upstream work was cancelled."""


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled (llama stops)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request.receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        watcher.cancel()
    if task.cancelled():
        mark_disconnected(request.scope)
        raise ClientDisconnected
    return task.result()
