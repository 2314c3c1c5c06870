"""The cache-manager's HTTP service: hints in, stats, hot sets and the expert index out.

Everything the service owns lives in one `Service` (service.py) on `app.state.service`, built in the lifespan.
A model that cannot be indexed (missing, unreadable, dense) does not stop the service: it runs in
pass-through mode, where hints are accepted and ignored and /v1/stats says why.

Errors answer `{"detail": ...}` and never repeat what the client sent: a validation error says
which field is wrong and why, not the value.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Annotated, Any, Literal

import httpx
from fastapi import Body, Depends, FastAPI, Header, HTTPException, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from redis.asyncio import Redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_l2_cache.buffer import CountBuffer
from moe_l2_cache.claim import UNINDEXED_MODEL, LlamaClaim, claim_llama, exit_on_lost_claim, new_owner
from moe_l2_cache.engine_cache import EngineCacheFeeder
from moe_l2_cache.flywheel import Flywheel
from moe_l2_cache.gpu import GpuCollector
from moe_l2_cache.hints import HintController, PassThroughHints
from moe_l2_cache.hit_curve import HitCurveWriter
from moe_l2_cache.hotset import router_map_text
from moe_l2_cache.metrics import ServiceCollector
from moe_l2_cache.ram_tier import ModelReplaced, RamTier, RamTierError, plan_ram
from moe_l2_cache.redis_keys import GLOBAL_DOMAIN, RedisKeys
from moe_l2_cache.residency import ExpertPool, PoolError
from moe_l2_cache.service import Service
from moe_l2_cache.settings import CacheSettings
from moe_l2_cache.traffic import TrafficHintController
from moe_l2_contracts.admin import ADMIN_TOKEN_HEADER, AdminTokenError, token_matches
from moe_l2_contracts.domains import is_reserved
from moe_l2_contracts.schemas.cache import (
    ExpertRange,
    ExpertRanges,
    HotSetResponse,
    IndexSummary,
    PullResponse,
    StatsResponse,
)
from moe_l2_contracts.schemas.errors import ServiceError, error_body
from moe_l2_contracts.schemas.hint import HintRequest, HintResponse
from moe_l2_gguf.index import ExpertIndex, GGUFIndexError, load_index
from moe_l2_placement.hit_curve import DEFAULT_HIT_CURVE, HitCurveError, read_hit_curve

log = logging.getLogger("moe_l2_cache")


def _load_index(settings: CacheSettings) -> tuple[ExpertIndex | None, str]:
    if settings.model_path is None:
        return None, "MOE_L2_MODEL_PATH is not set: no model to index"
    try:
        return load_index(settings.model_path), ""
    except GGUFIndexError as e:
        return None, str(e)


def _admin_token(settings: CacheSettings) -> tuple[str, str]:
    try:
        token = settings.configured_admin_token()
    except AdminTokenError as e:
        log.error("admin calls refused: %s", e)
        return "", str(e)
    if not token:
        return "", "no admin token is configured (MOE_L2_ADMIN_TOKEN or MOE_L2_ADMIN_TOKEN_FILE)"
    return token, ""


def _redis(settings: CacheSettings) -> Redis:
    return Redis.from_url(
        settings.redis_url,
        decode_responses=True,
        socket_timeout=settings.redis_timeout_s,
        socket_connect_timeout=settings.redis_timeout_s,
        retry=Retry(NoBackoff(), 0),  # the buffer is the retry: a call fails fast and counts wait there
    )


async def _claim(settings: CacheSettings, index: ExpertIndex | None) -> LlamaClaim:
    """MOE_L2_CACHE_CLAIM_LLAMA: one llama replica of MOE_L2_LLAMA_URL's host, ours alone (claim.py).
    Waits while Redis is unreachable or every replica is held; ClaimError when the host never resolves."""
    redis = _redis(settings)
    try:
        return await claim_llama(
            redis,
            RedisKeys(index.model_id if index is not None else UNINDEXED_MODEL),
            settings.llama_url,
            owner=new_owner(),
            ttl_s=settings.claim_ttl_s,
            resolve_timeout_s=settings.claim_resolve_timeout_s,
        )
    except BaseException:
        await redis.aclose()
        raise


async def build_service(settings: CacheSettings) -> Service:
    domains = settings.accepted_domains()
    token, token_problem = _admin_token(settings)
    admin_headers = {ADMIN_TOKEN_HEADER: token} if token else {}
    index, reason = await asyncio.to_thread(_load_index, settings)
    # The claim comes before anything uses llama_url: from here on, settings.llama_url is the replica.
    claim, tasks = None, []
    if settings.claim_llama:
        claim = await _claim(settings, index)
        settings = settings.model_copy(update={"llama_url": claim.url})
        tasks.append(asyncio.create_task(claim.run_renewer(exit_on_lost_claim)))
    llama = httpx.AsyncClient(base_url=settings.llama_url, timeout=httpx.Timeout(settings.llama_timeout_s, connect=2.0))
    if index is None:
        log.warning("pass-through mode: %s", reason)
        return Service(
            settings,
            llama,
            PassThroughHints(reason),
            domains,
            token,
            token_problem,
            reason=reason,
            claim=claim,
            tasks=tasks,
        )

    log.info(
        "indexed %s: %d MoE layers x %d experts (top-%d), %d bytes per expert, model id %s",
        index.path, len(index.layers), index.n_expert, index.n_expert_used, index.max_expert_bytes, index.model_id,
    )  # fmt: skip
    if settings.ram_budget is not None:
        plan = plan_ram(index, settings.ram_budget, settings.ram_headroom_bytes)  # RamTierError: refused
        settings = settings.model_copy(update={"pool_bytes": plan.pool_bytes})
    redis = _redis(settings)
    keys = RedisKeys(index.model_id)
    pool, pool_problem, tier = await _build_pool(settings, index)
    flywheel = Flywheel(
        index,
        keys,
        redis,
        llama,
        CountBuffer(settings.buffer_max_cells),
        hotset_bytes=settings.hotset_budget(),
        decay=settings.decay,
        decay_tokens=settings.decay_tokens,
        accepted=domains,
        pool=pool,
        admin_headers=admin_headers,
    )
    hints: HintController
    if settings.hot_set_scope == "traffic":
        hints = TrafficHintController(
            flywheel, llama, redis, keys, dwell_s=settings.dwell_s, pool=pool, half_life_s=settings.traffic_half_life_s
        )
    else:
        hints = HintController(flywheel, llama, redis, keys, dwell_s=settings.dwell_s, pool=pool)
    return Service(
        settings,
        llama,
        hints,
        domains,
        token,
        token_problem,
        index=index,
        redis=redis,
        keys=keys,
        pool=pool,
        pool_problem=pool_problem,
        ram_tier=tier,
        flywheel=flywheel,
        engine_cache=EngineCacheFeeder(
            flywheel,
            llama,
            admin_headers,
            settings.engine_profile_interval_s,
            transitions_min_tokens=settings.engine_transitions_min_tokens,
        ),
        hit_curve=_hit_curve_writer(settings, llama, index),
        claim=claim,
        tasks=tasks,
    )


def _hit_curve_writer(settings: CacheSettings, llama: httpx.AsyncClient, index: ExpertIndex) -> HitCurveWriter | None:
    """MOE_L2_CACHE_HIT_CURVE_PATH: the shipped curve through llama's measured hit rate, for its next start."""
    if settings.hit_curve_path is None:
        return None
    try:
        prior = read_hit_curve(DEFAULT_HIT_CURVE)
    except (HitCurveError, OSError) as e:  # a broken install: the service runs, llama reads what it has
        log.error("hit curve: not written, the shipped curve cannot be read (%s)", e)
        return None
    return HitCurveWriter(
        llama,
        settings.hit_curve_path,
        min_accesses=settings.hit_curve_min_accesses,
        interval_s=settings.hit_curve_interval_s,
        timeout=httpx.Timeout(settings.llama_timeout_s, connect=2.0),
        prior=prior,
        n_expert=index.n_expert,
        model=index.name or index.path.name,
    )


async def _build_pool(
    settings: CacheSettings, index: ExpertIndex, generation: int = 0
) -> tuple[ExpertPool | None, str | None, RamTier | None]:
    """The expert pool and, with MOE_L2_RAM_BUDGET, the RAM tier over it; a pool that cannot be made is a
    problem to report (the service still runs), a budget too small is RamTierError."""
    try:
        # Under the RAM tier the experts are held by its passes, not locked: pinning a hot set locks
        # gigabytes, which mlock reads from disk under the pool's lock, and the passes (which need that
        # lock) stalled for seconds while llama's misses piled up past the budget (measured: +0.3 GiB).
        lock_experts = settings.pool_lock and settings.ram_budget is None
        pool = await asyncio.to_thread(ExpertPool, index, settings.pool_bytes, settings.policy, lock=lock_experts)
        if not lock_experts and settings.pool_lock:
            pool.lock_problem = "experts are held by the RAM tier (MOE_L2_RAM_BUDGET), not locked"
    except PoolError as e:
        log.warning("expert pool disabled: %s", e)
        return None, str(e), None
    if settings.ram_budget is None:
        return pool, None, None
    plan = plan_ram(index, settings.ram_budget, settings.ram_headroom_bytes)
    tier = await asyncio.to_thread(RamTier, index, pool, plan, lock=settings.pool_lock, generation=generation)
    log.info(
        "RAM tier: budget %d bytes = %d in pages always kept (%d non-expert bytes and the experts' shared "
        "boundaries) + %d experts held + %d headroom for misses",
        plan.budget_bytes, plan.kept_bytes, plan.non_expert_bytes, plan.pool_bytes, plan.headroom_bytes,
    )  # fmt: skip
    return pool, None, tier


async def run_ram_tier(service: Service) -> None:
    """Sweep every MOE_L2_CACHE_RAM_SWEEP_S; a replaced model file rebuilds the pool. Never ends by itself."""
    failing: str | None = None
    took = 0.0
    while True:
        # at most half a core however large the model: a pass may take longer than the interval
        await asyncio.sleep(max(service.settings.ram_sweep_s, took))
        tier = service.ram_tier
        if tier is None:
            await asyncio.sleep(1.0)  # the pool is off (another model in the file); nothing to keep
            continue
        started = time.monotonic()
        try:
            await asyncio.to_thread(tier.step)
            took = time.monotonic() - started
            failing = None
        except ModelReplaced as e:
            log.warning("RAM tier: %s; rebuilding the expert pool on the new file", e)
            await rebuild_pool(service)
        except OSError as e:  # mincore or madvise refused: say it once, keep trying
            if str(e) != failing:
                failing = str(e)
                log.warning("RAM tier: sweep failed: %s", e)


async def rebuild_pool(service: Service) -> None:
    """The model file was replaced: index it again and build a new pool and tier on it. The same model
    (same id) keeps its tables; another model turns the pool off until the cache-manager restarts,
    because its routing tables and llama's counts are keyed by the model id."""
    old_pool, old_tier, old_index = service.pool, service.ram_tier, service.index
    index, reason = await asyncio.to_thread(_load_index, service.settings)
    if index is None:
        service.pool_problem = f"the model file changed and cannot be indexed now ({reason}); retrying"
        await asyncio.sleep(1.0)
        return
    # detached before closed: a stats call or hint in between sees no pool rather than a closed one
    service.pool, service.ram_tier = None, None
    service.pool_problem = f"{index.path} was replaced; rebuilding the expert pool on it"
    if isinstance(service.hints, HintController):
        service.hints.pool = None
    if service.flywheel is not None:
        service.flywheel.pool = None
    if old_tier is not None:
        await asyncio.to_thread(old_tier.close)
    if old_pool is not None:
        await asyncio.to_thread(old_pool.close)
    if old_index is not None and index.model_id != old_index.model_id:
        service.pool_problem = (
            f"{index.path} now holds another model (id {index.model_id}, was {old_index.model_id}); restart the "
            "cache-manager to serve it"
        )
        log.error("RAM tier: %s", service.pool_problem)
    else:
        try:
            generation = old_tier.generation + 1 if old_tier is not None else 1
            pool, problem, tier = await _build_pool(service.settings, index, generation)
        except RamTierError as e:
            pool, problem, tier = None, str(e), None
        service.index, service.pool, service.pool_problem, service.ram_tier = index, pool, problem, tier
        log.info("RAM tier: the expert pool is rebuilt on the new %s", index.path)
    if service.flywheel is not None:
        await service.flywheel.use_pool(service.pool)
    if isinstance(service.hints, HintController):  # the active domain's hot set is pinned again
        service.hints.pool = service.pool
        await service.hints.restore()


async def _start(service: Service) -> None:
    if service.flywheel is None or service.redis is None or service.keys is None or service.index is None:
        return
    index = service.index
    # Each step on its own: whatever Redis holds, the service starts (unusable entries are skipped and
    # counted, keys of the wrong type moved aside first), and Redis down only delays the tables.
    try:
        await service.flywheel.audit_if_due()
    except RedisError as e:
        log.warning("Redis unreachable at start (%s); counts will be buffered until it answers", e)
    try:
        await service.redis.hset(
            service.keys.meta,
            mapping={
                "arch": index.arch,
                "name": index.name,
                "path": str(index.path),
                "n_layer": index.n_layer,
                "n_expert": index.n_expert,
                "n_expert_used": index.n_expert_used,
            },
        )
        await service.flywheel.load_tables()
    except RedisError as e:
        log.warning("routing tables not loaded at start (%s); they are read when Redis answers", e)
    if isinstance(service.hints, HintController):
        await service.hints.restore()
        service.tasks.append(asyncio.create_task(service.hints.run_pinner()))
    if service.settings.pull_interval_s > 0:
        service.tasks.append(asyncio.create_task(service.flywheel.run(service.settings.pull_interval_s)))
    if service.engine_cache is not None and service.settings.engine_profile_interval_s > 0:
        service.tasks.append(asyncio.create_task(service.engine_cache.run()))
    if service.hit_curve is not None:
        service.tasks.append(asyncio.create_task(service.hit_curve.run()))
    if service.ram_tier is not None:
        service.tasks.append(asyncio.create_task(run_ram_tier(service)))


async def _stop(service: Service) -> None:
    for task in service.tasks:
        task.cancel()
    for task in service.tasks:
        with suppress(asyncio.CancelledError):
            await task
    if service.flywheel is not None:
        await service.flywheel.flush()  # best effort: what Redis does not take now is lost
    if service.hit_curve is not None:
        try:  # llama's counts since the last round, for its next start
            await service.hit_curve.write_if_due()
        except Exception:  # a bug here must not keep the rest from closing
            log.exception("hit curve: the last write failed")
    await service.llama.aclose()
    if service.redis is not None:
        await service.redis.aclose()
    if service.ram_tier is not None:
        await asyncio.to_thread(service.ram_tier.close)
    if service.pool is not None:
        await asyncio.to_thread(service.pool.close)
    if service.claim is not None:  # last: the replica is free once we no longer talk to it
        try:
            if await service.claim.release():
                log.info("llama claim %s released", service.claim.key)
        except RedisError as e:
            log.warning("llama claim %s not released (%s); it expires by itself", service.claim.key, e)
        await service.claim.redis.aclose()


def create_app(settings: CacheSettings | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = await build_service(settings or CacheSettings())
        registry = CollectorRegistry()
        registry.register(ServiceCollector(service))
        # GPU memory and utilisation through NVML; exports nothing where there is no NVIDIA driver
        registry.register(GpuCollector())
        app.state.service = service
        app.state.registry = registry
        await _start(service)
        try:
            yield
        finally:
            await _stop(service)

    # Every error is a ServiceError (the handlers in _routes); the document says so, in place of
    # FastAPI's own HTTPValidationError for 422.
    errors: dict[int | str, dict[str, Any]] = {
        422: {"model": ServiceError, "description": "the request does not match the schema (where and why)"},
        "4XX": {"model": ServiceError, "description": "a refused request"},
        "5XX": {"model": ServiceError, "description": "Redis or llama unreachable"},
    }
    app = FastAPI(title="moe-l2 cache-manager", lifespan=lifespan, responses=errors)
    _routes(app)
    return app


def _service(request: Request) -> Service:
    return request.app.state.service  # type: ignore[no-any-return]


ServiceDep = Annotated[Service, Depends(_service)]


def _admin(
    service: ServiceDep,
    token: Annotated[str | None, Header(alias=ADMIN_TOKEN_HEADER, description="the admin token")] = None,
) -> None:
    """Admin calls change state (a pull resets llama's counters): the token, or 401. Never echoes it."""
    if not service.admin_token:
        raise HTTPException(status_code=401, detail=f"admin calls are disabled: {service.admin_problem}")
    if not token_matches(token, service.admin_token):
        raise HTTPException(
            status_code=401,
            detail=f"admin call: the {ADMIN_TOKEN_HEADER} header is missing or wrong (the token is MOE_L2_ADMIN_TOKEN "
            "or in MOE_L2_ADMIN_TOKEN_FILE; `moe-l2 up` keeps it in <state dir>/admin-token)",
        )


_ADMIN_ERRORS: dict[int | str, dict[str, object]] = {
    401: {"description": f"no admin token configured, or {ADMIN_TOKEN_HEADER} missing or wrong"}
}


def _check_domain(service: Service, domain: str) -> None:
    """Only accepted domains become tables: anything else is a 400 listing them (without the input)."""
    if domain in service.domains:
        return
    what = (
        "a reserved name (names starting with '_' are the services' own)"
        if is_reserved(domain)
        else "not a known domain"
    )
    raise HTTPException(
        status_code=400, detail=f"domain is {what}; valid domains: {', '.join(sorted(service.domains))}"
    )


def _active(service: Service) -> tuple[ExpertIndex, Flywheel]:
    if service.index is None or service.flywheel is None:
        raise HTTPException(status_code=409, detail=f"pass-through mode: {service.reason}")
    return service.index, service.flywheel


def _routes(app: FastAPI) -> None:
    @app.get("/healthz")
    async def healthz(service: ServiceDep) -> dict[str, str]:
        return {"status": "ok", "mode": "pass-through" if service.index is None else "active"}

    @app.post(
        "/v1/hint",
        response_model=HintResponse,
        responses={400: {"description": "a reserved or unknown domain; the answer lists the valid ones"}},
    )
    async def hint(
        body: Annotated[
            HintRequest,
            Body(openapi_examples={"math": {"value": {"domain": "math"}}}),
        ],
        service: ServiceDep,
    ) -> HintResponse:
        _check_domain(service, body.domain)
        return await service.hints.hint(body.domain)

    @app.get("/v1/stats", response_model=StatsResponse)
    async def stats(service: ServiceDep) -> StatsResponse:
        pool = await asyncio.to_thread(service.pool.stats) if service.pool is not None else None
        reason = service.reason or (f"expert pool disabled: {service.pool_problem}" if service.pool_problem else "")
        return StatsResponse(
            mode="pass-through" if service.index is None else "active",
            reason=reason,
            model_id=service.index.model_id if service.index else None,
            model_path=str(service.settings.model_path) if service.settings.model_path else None,
            pool=pool,
            ram_tier=await asyncio.to_thread(service.ram_tier.stats) if service.ram_tier is not None else None,
            flywheel=service.flywheel.stats() if service.flywheel else None,
            hints=service.hints.stats(),
            llama_url=service.settings.llama_url,
        )

    @app.get("/v1/hotset/{domain}", response_model=HotSetResponse)
    async def hotset(
        domain: Annotated[str, Path(examples=["math", GLOBAL_DOMAIN], description="a known domain, or _global")],
        service: ServiceDep,
        format: Literal["json", "text"] = "json",
        fresh: bool = False,
    ) -> HotSetResponse | PlainTextResponse:
        _, flywheel = _active(service)
        if domain != GLOBAL_DOMAIN and domain not in service.domains:
            raise HTTPException(status_code=404, detail="not a known domain: no hot set")
        try:
            hot = await flywheel.hot_set(domain, fresh=fresh)
        except RedisError as e:
            raise HTTPException(status_code=503, detail=f"Redis unreachable: {e}") from e
        if hot is None:
            raise HTTPException(status_code=404, detail="no routing counts for this domain yet")
        if format == "text":
            return PlainTextResponse(router_map_text({int(k): v for k, v in hot.layers.items()}))
        return hot

    @app.get("/v1/hotsets", response_model=dict[str, HotSetResponse])
    async def hotsets(service: ServiceDep) -> dict[str, HotSetResponse]:
        """Every domain's hot set: the router maps as JSON."""
        _, flywheel = _active(service)
        try:
            out = {}
            for domain in sorted(await flywheel.known_domains()):
                if (hot := await flywheel.hot_set(domain)) is not None:
                    out[domain] = hot
            return out
        except RedisError as e:
            raise HTTPException(status_code=503, detail=f"Redis unreachable: {e}") from e

    @app.get("/v1/index", response_model=IndexSummary)
    async def index_summary(service: ServiceDep) -> IndexSummary:
        index, _ = _active(service)
        return index.summary()

    @app.get("/v1/index/{layer}/{expert}", response_model=ExpertRanges)
    async def expert_ranges(
        layer: Annotated[int, Path(examples=[0])], expert: Annotated[int, Path(examples=[1])], service: ServiceDep
    ) -> ExpertRanges:
        index, _ = _active(service)
        try:
            ranges = index.expert_ranges(layer, expert)
        except IndexError as e:
            raise HTTPException(status_code=404, detail=str(e)) from e
        return ExpertRanges(
            layer=layer,
            expert=expert,
            ranges=[ExpertRange(file=str(r.path), offset=r.offset, length=r.length) for r in ranges],
        )

    @app.post("/v1/pull", response_model=PullResponse, dependencies=[Depends(_admin)], responses=_ADMIN_ERRORS)
    async def pull(service: ServiceDep) -> PullResponse:
        """Pull llama's routing counts now (the flywheel also pulls every MOE_L2_CACHE_PULL_INTERVAL_S)."""
        _, flywheel = _active(service)
        return await flywheel.pull()

    @app.post("/v1/pool/evict", dependencies=[Depends(_admin)], responses=_ADMIN_ERRORS)
    async def evict(service: ServiceDep) -> dict[str, int]:
        if service.pool is None:
            raise HTTPException(status_code=409, detail=service.pool_problem or f"pass-through mode: {service.reason}")
        return {"released_bytes": await asyncio.to_thread(service.pool.evict_all)}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        # mincore over the pool's experts is a few syscalls per expert: off the event loop
        body = await asyncio.to_thread(generate_latest, request.app.state.registry)
        return Response(content=body, media_type=CONTENT_TYPE_LATEST)

    # Every error in the internal services' one envelope (schemas/errors.py), not FastAPI's {"detail"}.
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI's default handler sends each error's `input` back: a body with a secret in it
        # would be echoed. Where and why only.
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()
        ]
        return JSONResponse(error_body(422, "the request does not match the schema", details=errors), status_code=422)

    @app.exception_handler(RedisError)
    async def redis_down(request: Request, exc: RedisError) -> Response:
        return JSONResponse(error_body(503, f"Redis unreachable: {exc}"), status_code=503)
