"""`python -m moe_l2_proxy`: the gateway on MOE_L2_PROXY_HOST:MOE_L2_PROXY_PORT."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from types import FrameType

import uvicorn
from pydantic import ValidationError

from moe_l2_proxy.app import create_app
from moe_l2_proxy.connections import ConnectionLimits, guarded_protocol
from moe_l2_proxy.drain import Drain
from moe_l2_proxy.settings import ProxySettings

# uvicorn's own graceful shutdown, after the drain: only what the drain's explicit endings left
# (a response that was neither a stream nor unanswered); then it cancels them and exits
AFTER_DRAIN_S = 3
# after the drain, with the listening socket closed: how long the connections already accepted get to
# read their request and send its 503 (a client on loopback needs milliseconds; a slow network more)
LINGER_S = 1.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM/SIGINT drains (drain.py) before uvicorn's own shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)  # not started yet, or already shutting down: uvicorn's way
            return
        # a signal handler: runs between two bytecodes of the loop's thread, so only schedule here
        self._loop.call_soon_threadsafe(self._begin_drain, sig)

    def _begin_drain(self, sig: int) -> None:
        if self._draining is None:
            self._draining = asyncio.ensure_future(self._drain_then_exit(sig))
        else:
            self.drain.begin()  # a second signal: the grace ends now

    async def _drain_then_exit(self, sig: int) -> None:
        try:
            await self.drain.run()
            await self._close_then_linger()
        finally:
            super().handle_exit(sig, None)

    async def _close_then_linger(self) -> None:
        """Stop listening first, then give the connections already open a moment before they close.

        Exiting straight after the drain closed connections that had just been accepted, with their
        request on the way: the client read a reset (the soak's short version counted 3 to 7 such
        ReadErrors a run among requests sent during the drain, bench/faults.py). Closing an idle
        keep-alive connection at once does the same to a client that is sending on it right then (1 a
        run). So: a connection opened from here on is refused (a clean "unreachable": nothing was
        accepted); one already open that sends a request within the linger gets its 503 with
        `Connection: close`, and the client closes it; uvicorn's shutdown closes what is left after.
        """
        for server in self.servers:
            server.close()
        await asyncio.sleep(LINGER_S)


def main() -> None:
    try:
        settings = ProxySettings()
    except ValidationError as e:  # a configuration mistake: one message, not a traceback
        errors = "; ".join(describe(err) for err in e.errors())
        sys.exit(f"moe_l2_proxy: invalid settings: {errors}")
    level = settings.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if problem := settings.open_exposure():  # allowed only with MOE_L2_ALLOW_OPEN=1 (settings refuse it otherwise)
        logging.getLogger("moe_l2_proxy").warning(
            "MOE_L2_ALLOW_OPEN=1: %s without API keys: anyone there may use it", problem
        )
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=settings.access_log,
        server_header=False,
        # uvloop when installed (uvicorn[standard]): less per-request overhead
        loop="auto",
        # uvicorn's httptools protocol, with read timeouts and a connection limit (connections.py)
        http=guarded_protocol(ConnectionLimits.from_settings(settings), app.state.metrics),
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=AFTER_DRAIN_S,
    )
    server = DrainingServer(config, app.state.drain)
    server.run()
    if not server.started:
        sys.exit(3)  # uvicorn.run's exit status when startup failed


def describe(err: object) -> str:
    assert isinstance(err, dict)
    where = ".".join(map(str, err["loc"]))
    message = str(err["msg"]).removeprefix("Value error, ")
    return f"MOE_L2_PROXY_{where.upper()}: {message}" if where else message


if __name__ == "__main__":
    main()
