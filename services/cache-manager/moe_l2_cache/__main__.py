"""`python -m moe_l2_cache`: the cache-manager on MOE_L2_CACHE_HOST:MOE_L2_CACHE_PORT."""

from __future__ import annotations

import logging
import sys

import uvicorn
from pydantic import ValidationError

from moe_l2_cache.app import create_app
from moe_l2_cache.settings import CacheSettings


def main() -> None:
    try:
        settings = CacheSettings()
    except ValidationError as e:  # a configuration mistake: one message, not a traceback
        errors = "; ".join(f"MOE_L2_{'.'.join(map(str, err['loc'])).upper()}: {err['msg']}" for err in e.errors())
        sys.exit(f"moe_l2_cache: invalid settings: {errors}")
    level = settings.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # one line per pull and push would drown the log; errors are logged by the flywheel itself
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLevelName(level)))
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=level == "DEBUG",
    )


if __name__ == "__main__":
    main()
