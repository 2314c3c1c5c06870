"""llama's place in `moe-l2 up`: `--llama-replicas N` (or MOE_L2_LLAMA_REPLICAS; default 1) replicas,
each a llama-server with its own cache-manager (issue 16).

Replica i (0-based) runs llama-server on MOE_L2_LLAMA_PORT + 100·i and its cache-manager on
MOE_L2_CACHE_PORT + 100·i with MOE_L2_LLAMA_URL pointing at that llama-server; every cache-manager
writes the same Redis tables for the same model, so each replica learns from all the traffic. The
gateway gets MOE_L2_LLAMA_URLS and MOE_L2_CACHE_URLS, the two lists paired by position.

One replica (the default) is exactly the stack as it was before replicas: services `llama` and
`cache-manager`, on their ports, with their environment, and nothing added to the gateway's (it finds
llama and the cache-manager by MOE_L2_LLAMA_URL / MOE_L2_CACHE_URL or their ports, as before). With
more, the services are `llama-1..N` and `cache-manager-1..N`, and the cache-managers hold the hot set
of the traffic their replica serves (MOE_L2_CACHE_HOT_SET_SCOPE=traffic) rather than of one domain.
For N > 1 the replicas started here are what the gateway routes over, whatever MOE_L2_LLAMA_URLS
the calling shell exported.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from moe_l2_ops.python_service import python_service
from moe_l2_ops.stack_settings import StackSettings
from moe_l2_ops.supervisor import ServiceSpec

REPLICAS_ENV = "MOE_L2_LLAMA_REPLICAS"
# where the cache-manager writes the hit curve of the model's routing (moe_l2_cache.hit_curve)
HIT_CURVE_PATH_ENV = "MOE_L2_CACHE_HIT_CURVE_PATH"
MAX_REPLICAS = 16
PORT_STEP = 100
LLAMA_URLS_ENV = "MOE_L2_LLAMA_URLS"
CACHE_URLS_ENV = "MOE_L2_CACHE_URLS"
# the cache-manager's hot-set scope for a replica that serves only part of the domains
HOT_SET_SCOPE_ENV = "MOE_L2_CACHE_HOT_SET_SCOPE"


def parse_replica_count(raw: str | int, source: str = "--llama-replicas") -> int:
    """The number of llama replicas, 1..MAX_REPLICAS; ValueError naming `source` otherwise."""
    try:
        count = int(str(raw).strip())
    except ValueError as exc:
        raise ValueError(f"{source}={raw!r} is not a whole number (1 to {MAX_REPLICAS})") from exc
    if not 1 <= count <= MAX_REPLICAS:
        raise ValueError(f"{source}={count}: the number of llama replicas must be between 1 and {MAX_REPLICAS}")
    return count


def default_replica_count() -> int:
    """MOE_L2_LLAMA_REPLICAS, else 1; ValueError when it is set to something else than 1..16."""
    raw = os.environ.get(REPLICAS_ENV, "").strip()
    return parse_replica_count(raw, REPLICAS_ENV) if raw else 1


@dataclass(frozen=True)
class Replica:
    """Replica `index` (0-based) of `count`: its llama-server and its cache-manager."""

    index: int
    count: int
    llama_port: int
    cache_port: int

    @property
    def single(self) -> bool:
        return self.count == 1

    @property
    def llama_name(self) -> str:
        return "llama" if self.single else f"llama-{self.index + 1}"

    @property
    def cache_name(self) -> str:
        return "cache-manager" if self.single else f"cache-manager-{self.index + 1}"

    @property
    def llama_url(self) -> str:
        return f"http://127.0.0.1:{self.llama_port}"

    @property
    def cache_url(self) -> str:
        return f"http://127.0.0.1:{self.cache_port}"


def replicas(settings: StackSettings, count: int) -> list[Replica]:
    count = parse_replica_count(count)
    for base, what in ((settings.llama_port, "MOE_L2_LLAMA_PORT"), (settings.cache_port, "MOE_L2_CACHE_PORT")):
        if base + PORT_STEP * (count - 1) > 65535:
            raise ValueError(f"{count} llama replicas need ports up to {base + PORT_STEP * (count - 1)}: lower {what}")
    return [
        Replica(i, count, settings.llama_port + PORT_STEP * i, settings.cache_port + PORT_STEP * i)
        for i in range(count)
    ]


def flywheel_hit_curve(settings: StackSettings, model: Path) -> Path:
    """The hit curve file of the stack's cache-manager for `model`: MOE_L2_CACHE_HIT_CURVE_PATH when the user
    set it, else the state folder's (StackSettings.hit_curve_file)."""
    given = os.environ.get(HIT_CURVE_PATH_ENV, "").strip()
    return Path(given) if given else settings.hit_curve_file(model)


def learned_hit_curve(settings: StackSettings, model: Path) -> Path | None:
    """The cache-manager's hit curve of `model`'s routing when it has written one that reads as a curve, else
    None (llama-server then reads the shipped default). A file that does not parse is said once and skipped:
    llama-server would refuse to start on it."""
    from moe_l2_placement.hit_curve import HitCurveError, read_hit_curve

    path = flywheel_hit_curve(settings, model)
    if not path.is_file():
        return None
    try:
        read_hit_curve(path)
    except (HitCurveError, OSError) as exc:
        _warn_bad_hit_curve(str(exc))
        return None
    return path


@cache
def _warn_bad_hit_curve(problem: str) -> None:
    """Once: `up` builds llama's spec twice (the port check, then the start)."""
    print(
        f"warning: the cache-manager's hit curve is not used ({problem}); llama reads the shipped one",
        file=sys.stderr,
    )


def llama_spec(settings: StackSettings, replica: Replica, model: Path, binary: Path, admin_token: str) -> ServiceSpec:
    from moe_l2_llama.settings import LlamaSettings
    from moe_l2_ops.llama_service import llama_service_spec

    overrides: dict[str, object] = {}
    if admin_token:
        overrides["admin_token"] = admin_token
    if not replica.single:
        overrides["port"] = replica.llama_port
    llama = LlamaSettings(**overrides)  # type: ignore[arg-type]
    # MOE_L2_LLAMA_HIT_CURVE unset: the curve calibrated on the engine's measured hit rate, once the
    # cache-manager wrote one
    if llama.hit_curve is None and (learned := learned_hit_curve(settings, model)) is not None:
        llama = llama.model_copy(update={"hit_curve": learned})
    return llama_service_spec(
        replica.llama_name, binary, model, llama, url_path="/v1", start_timeout_s=settings.start_timeout_s
    )


def cache_manager_spec(settings: StackSettings, replica: Replica, model: Path) -> ServiceSpec:
    env = {
        "MOE_L2_MODEL_PATH": str(model),
        "MOE_L2_REDIS_URL": f"redis://{settings.redis_host}:{settings.redis_port}/0",
        "MOE_L2_LLAMA_URL": replica.llama_url,
    }
    if not replica.single:
        env["MOE_L2_CACHE_PORT"] = str(replica.cache_port)
        env[HOT_SET_SCOPE_ENV] = "traffic"
    if replica.index == 0:  # every replica's cache-manager reads the same tables: one writes the curve
        env[HIT_CURVE_PATH_ENV] = str(flywheel_hit_curve(settings, model))
    # the gateway serves without it: no hints, no hot sets, until it is back
    return python_service(replica.cache_name, "moe_l2_cache", replica.cache_port, env, required=False)


def llama_replica_services(
    settings: StackSettings, model: Path, binary: Path, admin_token: str = "", count: int = 1
) -> list[ServiceSpec]:
    """llama-server and its cache-manager, replica after replica (each cache-manager after its llama)."""
    specs = []
    for replica in replicas(settings, count):
        specs.append(llama_spec(settings, replica, model, binary, admin_token))
        specs.append(cache_manager_spec(settings, replica, model))
    return specs


def gateway_env(settings: StackSettings, count: int) -> dict[str, str]:
    """What the gateway is told about the replicas: nothing for one (as before replicas), else
    MOE_L2_LLAMA_URLS and MOE_L2_CACHE_URLS, paired by position."""
    reps = replicas(settings, count)
    if len(reps) == 1:
        return {}
    return {
        LLAMA_URLS_ENV: ",".join(r.llama_url for r in reps),
        CACHE_URLS_ENV: ",".join(r.cache_url for r in reps),
    }
