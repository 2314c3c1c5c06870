"""`python -m moe_l2_predictor`: the predictor on MOE_L2_PREDICTOR_HOST:MOE_L2_PREDICTOR_PORT."""

from __future__ import annotations

import logging
import sys

import uvicorn

from moe_l2_predictor.app import create_app
from moe_l2_predictor.settings import PredictorSettings


def main() -> int:
    settings = PredictorSettings()
    level = settings.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,  # paths only, but they add nothing to the metrics; never prompt text
        timeout_graceful_shutdown=5,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
