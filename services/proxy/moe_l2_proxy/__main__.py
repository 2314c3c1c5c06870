"""`python -m moe_l2_proxy`: the gateway on MOE_L2_PROXY_HOST:MOE_L2_PROXY_PORT."""

from __future__ import annotations

import logging
import sys

import uvicorn
from pydantic import ValidationError

from moe_l2_proxy.app import create_app
from moe_l2_proxy.connections import ConnectionLimits, guarded_protocol
from moe_l2_proxy.settings import ProxySettings


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
    uvicorn.run(
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
        timeout_graceful_shutdown=10,
    )


def describe(err: object) -> str:
    assert isinstance(err, dict)
    where = ".".join(map(str, err["loc"]))
    message = str(err["msg"]).removeprefix("Value error, ")
    return f"MOE_L2_PROXY_{where.upper()}: {message}" if where else message


if __name__ == "__main__":
    main()
