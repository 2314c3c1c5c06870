"""`python -m moe_l2_cache`: the cache-manager on MOE_L2_CACHE_HOST:MOE_L2_CACHE_PORT."""

from __future__ import annotations

import logging
import sys

import uvicorn
from pydantic import ValidationError

from moe_l2_cache.app import create_app
from moe_l2_cache.ram_tier import RamTierError, plan_ram, ram_tier_replicas_problem
from moe_l2_cache.settings import CacheSettings
from moe_l2_gguf.index import GGUFIndexError, load_index


def ram_budget_problem(settings: CacheSettings) -> str | None:
    """MOE_L2_RAM_BUDGET with llama replicas, or too small for the model: refused before the service starts,
    in one line."""
    if problem := ram_tier_replicas_problem(settings.ram_budget, settings.llama_replicas):
        return problem
    if settings.ram_budget is None or settings.model_path is None:
        return None
    try:
        plan_ram(load_index(settings.model_path), settings.ram_budget, settings.ram_headroom_bytes)
    except RamTierError as e:
        return str(e)
    except GGUFIndexError:  # the service says why, and runs pass-through
        return None
    return None


def main() -> None:
    try:
        settings = CacheSettings()
    except ValidationError as e:  # a configuration mistake: one message, not a traceback
        errors = "; ".join(f"MOE_L2_{'.'.join(map(str, err['loc'])).upper()}: {err['msg']}" for err in e.errors())
        sys.exit(f"moe_l2_cache: invalid settings: {errors}")
    if problem := ram_budget_problem(settings):
        sys.exit(f"moe_l2_cache: {problem}")
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
