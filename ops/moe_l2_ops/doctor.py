"""`moe-l2 doctor`: pass / warn / fail lines for what moe-l2 needs; exit status 1 on any failure.

Python and packages, the patched llama-server binary, the model, GPU and driver (NVML), the memlock
limit against the pool budget, /dev/shm, free disk, Redis, the health of each running service,
llama's expert cache, the restarts `moe-l2 up` made, and the admin token: present, private (mode
0600), required by the services' admin calls and accepted by them.

Before the stack is started (no live `moe-l2 up` in its state file and no service answering) the
checks of Redis, each service, the expert cache and the admin calls could only fail for that one
reason, so they give way to a single `stack` line saying it is not running, a warning: doctor run
before `moe-l2 up` answers whether this machine is ready to run the stack, and a stack not started
yet is no fault of the machine (so `moe-l2 doctor && moe-l2 up` works). Once anything runs (`moe-l2
up`, compose, a service started by hand), every check runs and a service that does not answer fails.

`--model M` adds a `placement` line and, below the checks, what the placement cost model
(moe_l2_placement, docs/placement-model.md) predicts for M on this machine: what stays on the device, the
expert cache, the host's experts, decode tok/s and its bounding term, or why it predicts none (no GPU: the
model's constants are measured on a GPU machine). A warning, never a failure: a CPU machine serves too.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

import httpx

from moe_l2_contracts.services import LLAMA
from moe_l2_ops.stats import OpsSettings, format_bytes

if TYPE_CHECKING:
    from moe_l2_llama.serving_plan import ServingPlan

Status = Literal["pass", "warn", "fail"]
GiB = 1 << 30
# The hot-set patch's series: a binary that exports them was built with the project's patches.
PATCH_MARKERS = (b"moe_hot_hits_total", b"/moe/hot-set")
PACKAGES = ("moe-l2", "fastapi", "uvicorn", "httpx", "pydantic", "pydantic-settings", "prometheus-client", "redis")
OPTIONAL_PACKAGES = ("nvidia-ml-py", "torch", "sentence-transformers")


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    # what --json adds to this check's object (the placement's forecast); left out of the others' objects
    data: dict[str, object] | None = field(default=None, compare=False)

    def as_json(self) -> dict[str, object]:
        return {k: v for k, v in asdict(self).items() if k != "data" or v is not None}


def check_python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    ok = sys.version_info >= (3, 11)
    return Check("python", "pass" if ok else "fail", f"{version} ({sys.executable})" + ("" if ok else "; need >= 3.11"))


def check_packages() -> Check:
    found, missing = [], []
    for name in PACKAGES:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            missing.append(name)
    optional = []
    for name in OPTIONAL_PACKAGES:
        try:
            optional.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            optional.append(f"{name} absent")
    detail = ", ".join(found + optional)
    if missing:
        return Check("packages", "fail", f"missing {', '.join(missing)}; {detail}")
    return Check("packages", "pass", detail)


def _binary_has_patches(binary: Path) -> bool:
    data = binary.read_bytes()
    return all(marker in data for marker in PATCH_MARKERS)


def serving_binary() -> tuple[ServingPlan, Path | None]:
    """The build `moe-l2 up` would serve with, chosen by the same function (plan_serving), and its
    binary: MOE_L2_LLAMA_SERVER's, else the cached build of the plan's config, None if not built yet.
    Raises BuildError where `up` would refuse the plan."""
    from moe_l2_llama.build import built_binary
    from moe_l2_llama.serving_plan import plan_serving
    from moe_l2_llama.settings import LlamaSettings

    plan = plan_serving(LlamaSettings())
    return plan, plan.given if plan.given is not None else built_binary(plan.choice.config)


def check_llama_binary() -> Check:
    """The build `moe-l2 up` would serve with (serving_binary), named in the same words as the line
    `up` logs, then whether it is built with the current patches."""
    from moe_l2_llama.build import BuildError, cached_builds, default_cache_dir, default_patches_dir, patch_files

    try:
        plan, binary = serving_binary()
    except BuildError as exc:
        return Check("llama-server", "fail", str(exc))
    if plan.given is not None:
        binary = plan.given
        if not binary.is_file() or not os.access(binary, os.X_OK):
            return Check("llama-server", "fail", f"MOE_L2_LLAMA_SERVER={binary} is not an executable file")
        if not _binary_has_patches(binary):
            return Check("llama-server", "fail", f"{binary} lacks the hot-set patch (no moe_hot_hits_total)")
        return Check("llama-server", "pass", f"{plan.summary}, has the hot-set patch")
    patches = patch_files(default_patches_dir())
    builds = cached_builds(default_cache_dir(), patches)
    current = {b.backend for b in builds if b.current}
    others = sorted(current - {plan.choice.backend})
    also = f" (also current: {', '.join(others)})" if others else ""
    if binary is None:
        stale = "; the cache holds no build of the current patches" if builds and not current else ""
        return Check(
            "llama-server",
            "warn",
            f"{plan.summary}: not built yet{stale}; `moe-l2 up` builds it (or `{plan.choice.build_command()}`){also}",
        )
    if not _binary_has_patches(binary):
        return Check("llama-server", "fail", f"{binary} lacks the hot-set patch; `moe-l2 build-llama --force`")
    return Check(
        "llama-server",
        "pass",
        f"{plan.summary}: {binary.parent.parent.name} matches the {len(patches)} patches{also}: {binary}",
    )


def _model_path(settings: OpsSettings, given: Path | None) -> tuple[Path | None, str]:
    """The model to check and where its path came from."""
    if given is not None:
        return given, "--model"
    if env := os.environ.get("MOE_L2_MODEL_PATH"):
        return Path(env), "MOE_L2_MODEL_PATH"
    try:
        stats = httpx.get(f"{settings.cache_url.rstrip('/')}/v1/stats", timeout=settings.ops_timeout_s).json()
        if stats.get("model_path"):
            return Path(stats["model_path"]), "the running cache-manager"
    except (httpx.HTTPError, ValueError):
        pass
    from moe_l2_ops.stack import StackSettings

    stack = StackSettings()
    demo = stack.state_dir / "models" / f"moe-l2-demo-seed{stack.demo_seed}.gguf"
    return (demo, "the demo model of `moe-l2 up`") if demo.is_file() else (None, "")


def check_model(settings: OpsSettings, given: Path | None) -> Check:
    from moe_l2_gguf.index import DenseModelError, GGUFIndexError, load_index

    path, origin = _model_path(settings, given)
    if path is None:
        return Check("model", "warn", "no model configured (MOE_L2_MODEL_PATH); `moe-l2 up` generates a demo model")
    if not path.is_file() or not os.access(path, os.R_OK):
        return Check("model", "fail", f"{path} ({origin}) is not a readable file")
    try:
        index = load_index(path)
    except DenseModelError:
        return Check("model", "fail", f"{path}: not a mixture-of-experts model (no routed experts)")
    except (GGUFIndexError, OSError, ValueError) as exc:
        return Check("model", "fail", f"{path}: cannot index it: {exc}")
    return Check(
        "model",
        "pass",
        f"{path} ({origin}): {index.arch}, {len(index.moe_layers)} MoE layers x {index.n_expert} experts "
        f"({index.n_expert_used} used), routed experts {format_bytes(index.routed_bytes)} of "
        f"{format_bytes(index.tensor_bytes)}",
    )


def check_gpu() -> Check:
    from moe_l2_cache.gpu import nvml_report

    report = nvml_report()
    if report is None:
        # which build serves (a Vulkan GPU, the CPU) is the llama-server line's to say
        return Check("gpu", "warn", "no NVIDIA driver/GPU visible through NVML")
    if not report.gpus:
        return Check("gpu", "warn", f"driver {report.driver_version} but no GPU")
    gpus = "; ".join(
        f"{g.index}: {g.name} {g.memory_used_bytes / GiB:.1f}/{g.memory_total_bytes / GiB:.1f} GiB used"
        for g in report.gpus
    )
    return Check("gpu", "pass", f"driver {report.driver_version}, CUDA {report.cuda_version or '?'}; {gpus}")


def check_placement(model: Path) -> Check:
    """The placement the cost model predicts for `model` on this machine: its RAM, nvidia-smi's GPUs."""
    from moe_l2_gguf.index import GGUFIndexError
    from moe_l2_placement.here import forecast, host_ram_bytes, nvidia_gpus
    from moe_l2_placement.shape import Shape

    try:
        shape = Shape.from_gguf(model)
    except (GGUFIndexError, OSError, ValueError) as exc:  # the model line says what is wrong with the file
        return Check("placement", "warn", f"no shape to place: {exc}")
    gpus, no_gpu_why = nvidia_gpus()
    fc = forecast(str(model), shape, host_ram_bytes(), gpus, no_gpu_why)
    if fc.predicted:
        detail = f"{fc.placement}; decode {fc.decode_tps:.1f} tok/s, bound by {fc.decode_bound}"
        return Check("placement", "pass", detail, fc.as_dict() | {"lines": fc.lines()})
    return Check("placement", "warn", f"not predicted: {fc.why_not}", fc.as_dict() | {"lines": fc.lines()})


def _has_ipc_lock() -> bool:
    """CAP_IPC_LOCK (bit 14) lifts RLIMIT_MEMLOCK for mlock."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 14 & 1)
    except (OSError, ValueError):
        pass
    return False


def pool_budget() -> int:
    """The expert pool's budget as the cache-manager reads it (its settings, so one default)."""
    from pydantic import ValidationError

    from moe_l2_cache.settings import CacheSettings

    try:
        return CacheSettings().pool_bytes
    except ValidationError:  # another of its variables is wrong: the cache-manager reports that one
        return int(CacheSettings.model_fields["pool_bytes"].default)


def check_memlock() -> Check:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    budget = pool_budget()
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / GiB:.2f} GiB"
    if soft == resource.RLIM_INFINITY or soft >= budget:
        return Check("memlock", "pass", f"RLIMIT_MEMLOCK {limit} >= pool budget {budget / GiB:.2f} GiB")
    if _has_ipc_lock():
        return Check(
            "memlock", "pass", f"RLIMIT_MEMLOCK {limit} but CAP_IPC_LOCK lifts it (budget {budget / GiB:.2f} GiB)"
        )
    return Check(
        "memlock",
        "warn",
        f"RLIMIT_MEMLOCK {limit} < pool budget {budget / GiB:.2f} GiB: the pool pins only what fits, the rest is "
        "prefetched; raise `ulimit -l` (compose: ulimits.memlock -1)",
    )


def check_shm() -> Check:
    try:
        total = shutil.disk_usage("/dev/shm").total
    except OSError:
        return Check("/dev/shm", "warn", "no /dev/shm")
    if total < GiB:
        return Check("/dev/shm", "warn", f"{total / GiB:.2f} GiB (Docker's default 64 MiB?); give it >= 1 GiB")
    return Check("/dev/shm", "pass", f"{total / GiB:.1f} GiB")


def check_disk() -> Check:
    from moe_l2_ops.stack import StackSettings

    folder = StackSettings().state_dir
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    detail = f"{free / GiB:.1f} GiB free at {folder}"
    if free < GiB:
        return Check("disk", "fail", detail)
    return Check("disk", "warn" if free < 10 * GiB else "pass", detail)


def check_redis(settings: OpsSettings) -> Check:
    import redis

    client = redis.Redis.from_url(
        settings.redis_url, socket_timeout=settings.ops_timeout_s, socket_connect_timeout=settings.ops_timeout_s
    )
    try:
        client.ping()
        version = client.info("server").get("redis_version", "?")
        return Check("redis", "pass", f"{settings.redis_url} answers (Redis {version})")
    except redis.RedisError as exc:
        return Check("redis", "fail", f"{settings.redis_url} unreachable: {exc}")
    finally:
        client.close()


@dataclass(frozen=True)
class Probe:
    """One service's health URL and what it answered: a status code, or None and the error's name."""

    name: str
    url: str
    code: int | None
    error: str = ""


def probe_services(settings: OpsSettings) -> list[Probe]:
    out = []
    with httpx.Client(timeout=settings.ops_timeout_s) as client:
        for name, url in settings.services().items():
            is_llama = name == "llama" or name.startswith("llama-")  # llama-1..N: MOE_L2_LLAMA_URLS
            health = f"{url}{LLAMA.health_path}" if is_llama else f"{url}/healthz"
            try:
                out.append(Probe(name, health, client.get(health).status_code))
            except httpx.HTTPError as exc:
                out.append(Probe(name, health, None, type(exc).__name__))
    return out


def check_services(settings: OpsSettings, probes: list[Probe] | None = None) -> list[Check]:
    out = []
    for probe in probe_services(settings) if probes is None else probes:
        if probe.code is None:
            out.append(Check(probe.name, "fail", f"{probe.url} unreachable ({probe.error})"))
        else:
            status: Status = "pass" if probe.code == 200 else "fail"
            out.append(Check(probe.name, status, f"{probe.url} answered {probe.code}"))
    return out


def supervisor_live() -> bool:
    """Whether a `moe-l2 up` runs, by its state file (its pid alive)."""
    from moe_l2_ops.stack import StackSettings
    from moe_l2_ops.supervisor import read_state

    state = read_state(StackSettings().state_file)
    return state is not None and bool(state["live"])


def stack_running(probes: list[Probe], supervised: bool) -> bool:
    """Running: a `moe-l2 up` is alive (also while it is still starting its services), or any service
    answers at all, whatever started it (compose, the tests, a service by hand)."""
    return supervised or any(probe.code is not None for probe in probes)


def check_not_running(probes: list[Probe]) -> Check:
    where = ", ".join(f"{probe.name} {urlsplit(probe.url).netloc}" for probe in probes)
    return Check(
        "stack",
        "warn",
        f"not running (start it with `moe-l2 up` or `make run`): no service answers ({where}); "
        "Redis, the services and the admin calls are checked once it runs",
    )


def check_expert_cache(settings: OpsSettings) -> Check | None:
    """llama's expert cache (GET /moe/cache): its size, the layers it holds and the domains whose
    priors it has; None when llama does not answer (its health check says why)."""
    from moe_l2_contracts.schemas.llama import ExpertCacheShape

    try:
        resp = httpx.get(f"{settings.llama_url.rstrip('/')}/moe/cache", timeout=settings.ops_timeout_s)
    except httpx.HTTPError:
        return None
    if resp.status_code in (404, 501):
        return Check(
            "expert cache",
            "warn",
            "off: every expert a token uses is copied to the GPU or computed on the CPU "
            "(MOE_L2_LLAMA_EXPERT_CACHE_BYTES, llama-server --moe-cache-bytes; needs a GPU build)",
        )
    if resp.status_code != 200:
        return Check("expert cache", "fail", f"GET /moe/cache answered {resp.status_code}: {resp.text[:200]}")
    shape = ExpertCacheShape.model_validate(resp.json())
    priors = f"priors for {len(shape.profile)} domains" if shape.profile else "no domain priors yet (cache-manager)"
    return Check(
        "expert cache",
        "pass",
        f"{shape.n_slot} of {shape.n_expert} experts per layer for {shape.n_layer} layers "
        f"({shape.layers[0]}-{shape.layers[-1]}), {format_bytes(shape.device_bytes)} of GPU memory; {priors}",
    )


def check_supervisor() -> Check | None:
    """The restarts of `moe-l2 up`'s services, from its state file; None where it is not in use."""
    from moe_l2_ops.stack import StackSettings
    from moe_l2_ops.supervisor import read_state

    path = StackSettings().state_file
    state = read_state(path)
    if state is None:
        return None
    services: dict[str, dict] = state["services"]
    if not state["live"]:
        left = [name for name, svc in services.items() if svc.get("state") != "stopped"]
        if not left:
            return None  # stopped cleanly: nothing to say
        return Check(
            "supervisor",
            "warn",
            f"`moe-l2 up` (pid {state.get('pid')}) ended without stopping {', '.join(left)}; "
            f"what it started may still run ({path})",
        )
    parts = []
    for name, svc in services.items():
        text = f"{name} {svc.get('state')}, {svc.get('restarts', 0)} restarts"
        if svc.get("restarts") or svc.get("state") != "running":
            text += f" (last: {svc.get('last_failure') or '-'}; log {svc.get('log')})"
        parts.append(text)
    detail = "; ".join(parts)
    if any(svc.get("state") == "failed" for svc in services.values()):
        return Check("supervisor", "fail", f"restarts given up (crash loop): {detail}")
    if any(svc.get("restarts") or svc.get("state") != "running" for svc in services.values()):
        return Check("supervisor", "warn", detail)
    return Check("supervisor", "pass", detail)


def find_admin_token() -> tuple[str, Path | None, str]:
    """(token, the file it is read from or None, where it came from); ("", None, "") if there is none."""
    from moe_l2_contracts.admin import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE_ENV, read_token_file
    from moe_l2_ops.stack import StackSettings

    if token := os.environ.get(ADMIN_TOKEN_ENV, "").strip():
        return token, None, ADMIN_TOKEN_ENV
    if name := os.environ.get(ADMIN_TOKEN_FILE_ENV, "").strip():
        path = Path(name)
        return read_token_file(path), path, ADMIN_TOKEN_FILE_ENV
    path = StackSettings().admin_token_file
    if path.exists():
        return read_token_file(path), path, "the token `moe-l2 up` created"
    return "", None, ""


def check_admin_token() -> Check:
    from moe_l2_contracts.admin import AdminTokenError
    from moe_l2_ops.stack import StackSettings

    try:
        token, path, origin = find_admin_token()
    except AdminTokenError as exc:
        return Check("admin token", "fail", str(exc))
    if not token:
        return Check(
            "admin token",
            "warn",
            f"none: set MOE_L2_ADMIN_TOKEN, or `moe-l2 up` creates {StackSettings().admin_token_file} at its "
            "first start; until then every admin call is refused",
        )
    if path is None:
        return Check("admin token", "pass", f"from {origin}")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        return Check("admin token", "fail", f"{path} ({origin}) has mode {mode:04o}: others can read it; chmod 600 it")
    return Check("admin token", "pass", f"{path} ({origin}), mode {mode:04o}")


# Admin calls that change nothing: the cache-manager's pull is what its flywheel does every few
# seconds anyway; llama's hot-set body is invalid on purpose, so past the token check it is a 400.
# With the token, any answer but 401/403 means the token was accepted.
ADMIN_PROBES = (
    ("cache-manager", "cache_url", "/v1/pull", {}),
    ("llama", "llama_url", "/moe/hot-set", {"layers": None}),
)


def check_admin_calls(settings: OpsSettings) -> Check:
    """Each admin call is refused (401) without the token and accepted with it."""
    from moe_l2_contracts.admin import ADMIN_TOKEN_HEADER, AdminTokenError

    try:
        token = find_admin_token()[0]
    except AdminTokenError:
        token = ""
    passed, problems = [], []
    with httpx.Client(timeout=settings.ops_timeout_s) as client:
        for name, url_field, path, body in ADMIN_PROBES:
            url = str(getattr(settings, url_field)).rstrip("/") + path
            try:
                without = client.post(url, json=body).status_code
                with_token = (
                    client.post(url, json=body, headers={ADMIN_TOKEN_HEADER: token}).status_code if token else None
                )
            except httpx.HTTPError:
                continue  # not running: its health check says so
            if without != 401:
                problems.append(f"{name} answered {without} to POST {path} without the token: its admin calls are open")
            elif with_token in (401, 403):
                problems.append(f"{name} answered {with_token} to POST {path} with the token (it uses another one?)")
            else:
                passed.append(name)
    if problems:
        return Check("admin calls", "fail", "; ".join(problems))
    if not passed:
        return Check("admin calls", "warn", "no service answered (cache-manager, llama)")
    how = "refused without the token (401)" + (", accepted with it" if token else "")
    return Check("admin calls", "pass", f"{', '.join(passed)}: {how}")


def _guarded(name: str, check: Callable[[], Check]) -> Check:
    """One broken check must not hide the others."""
    try:
        return check()
    except Exception as exc:
        return Check(name, "fail", f"{type(exc).__name__}: {exc}")


def _optional(name: str, check: Callable[[], Check | None]) -> list[Check]:
    """A check that may have nothing to say (None); one that breaks is a failure, as in _guarded."""
    try:
        found = check()
    except Exception as exc:
        return [Check(name, "fail", f"{type(exc).__name__}: {exc}")]
    return [] if found is None else [found]


def machine_checks(settings: OpsSettings, model: Path | None) -> list[Check]:
    """What holds whether or not the stack runs: the install, the build, the model, the hardware."""
    return [
        _guarded("python", check_python),
        _guarded("packages", check_packages),
        _guarded("llama-server", check_llama_binary),
        _guarded("model", lambda: check_model(settings, model)),
        _guarded("gpu", check_gpu),
        _guarded("memlock", check_memlock),
        _guarded("/dev/shm", check_shm),
        _guarded("disk", check_disk),
        # only for a model named on the command line: the prediction reads the whole tensor table
        *([_guarded("placement", lambda: check_placement(model))] if model is not None else []),
    ]


def stack_checks(settings: OpsSettings, probes: list[Probe]) -> list[Check]:
    """The running stack's: Redis, each service, the expert cache."""
    checks = [_guarded("redis", lambda: check_redis(settings)), *check_services(settings, probes)]
    return checks + _optional("expert cache", lambda: check_expert_cache(settings))


def run_checks(settings: OpsSettings, model: Path | None) -> list[Check]:
    checks = machine_checks(settings, model)
    try:
        probes = probe_services(settings)
        running = stack_running(probes, supervisor_live())
    except Exception as exc:  # cannot tell: check everything, as for a running stack
        checks.append(Check("services", "fail", f"{type(exc).__name__}: {exc}"))
        probes, running = [], True
    checks += stack_checks(settings, probes) if running else [check_not_running(probes)]
    checks += _optional("supervisor", check_supervisor)  # before a start too: an unclean end's leftovers
    checks.append(_guarded("admin token", check_admin_token))
    if running:
        checks.append(_guarded("admin calls", lambda: check_admin_calls(settings)))
    return checks


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    return "\n".join(f"{c.status.upper():<4}  {c.name:<{width}}  {c.detail}" for c in checks)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="moe-l2 doctor",
        description="Check what moe-l2 needs and the health of the running services; exit status 1 on a failure.",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="GGUF to check (default: the configured model); given, also the placement the cost model predicts",
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    checks = run_checks(OpsSettings(), args.model)
    if args.json:
        print(json.dumps([c.as_json() for c in checks]))
    else:
        print(render(checks))
        for c in checks:
            if c.data and c.data.get("lines"):
                print(f"\n{c.name} (the cost model, docs/placement-model.md):")
                print("\n".join(f"  {line}" for line in c.data["lines"]))  # type: ignore[union-attr]
        fails = sum(c.status == "fail" for c in checks)
        warns = sum(c.status == "warn" for c in checks)
        print(f"\n{fails} failed, {warns} warnings, {len(checks) - fails - warns} passed")
    return 1 if any(c.status == "fail" for c in checks) else 0
