"""What a request handler needs, built once in the app's lifespan and kept on `app.state.gateway`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive

from moe_l2_proxy.domain import Decision, DomainResolver
from moe_l2_proxy.errors import GatewayError, describe_validation
from moe_l2_proxy.metrics import GatewayMetrics, mark_disconnected
from moe_l2_proxy.predictor_pool import PredictorPool
from moe_l2_proxy.replicas import LlamaPool
from moe_l2_proxy.settings import ProxySettings

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


@dataclass
class Gateway:
    settings: ProxySettings
    metrics: GatewayMetrics
    llamas: LlamaPool
    domains: DomainResolver
    predictors: PredictorPool | None

    def record(self, decision: Decision) -> None:
        """Count the decision (the chosen replica's cache-manager hears of it when the request is sent)."""
        self.metrics.count_domain(decision.domain, decision.source)


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


def client_left(request: Request) -> Response:
    """The answer to a client that has gone (never sent): counted as 499, not an error to log."""
    mark_disconnected(request.scope)
    return Response(status_code=499)


async def on_client_disconnect(request: Request, exc: Exception) -> Response:
    """FastAPI's handler for Starlette's ClientDisconnect, raised when the client leaves while its
    body is read: an ordinary event, not a server error with a stack trace."""
    assert isinstance(exc, ClientDisconnect)
    return client_left(request)


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class DisconnectWatch:
    """Cancels the current task if the client disconnects while it runs (llama then stops).

    The work stays in the task that needs its result, and one watcher task reads `receive`: cheaper,
    once per request, than running the work as its own task and waiting on both."""

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.left = False
        self._active = False
        self._task: asyncio.Task[object] | None = None
        self._watcher: asyncio.Task[None] | None = None

    def __enter__(self) -> DisconnectWatch:
        self._task = asyncio.current_task()
        self._active = True
        self._watcher = asyncio.ensure_future(_disconnect(self.receive))
        self._watcher.add_done_callback(self._on_disconnect)
        return self

    def _on_disconnect(self, watcher: asyncio.Task[None]) -> None:
        # `_active`: a disconnect noticed just as the work ended must not cancel what follows it
        if self._active and not watcher.cancelled() and watcher.exception() is None:
            self.left = True
            assert self._task is not None
            self._task.cancel()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        self._active = False
        assert self._watcher is not None
        self._watcher.cancel()
        if kind is not None and issubclass(kind, asyncio.CancelledError) and self.left:
            uncancel = getattr(self._task, "uncancel", None)  # Python >= 3.11 counts cancellations
            if uncancel is not None:
                uncancel()
            return True  # swallowed: the caller looks at `left`
        return False


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled (llama stops)."""
    with DisconnectWatch(request.receive) as watch:
        return await work
    assert watch.left
    mark_disconnected(request.scope)
    raise ClientDisconnected
