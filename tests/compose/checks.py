"""The compose file's properties, one check each: plain functions that raise AssertionError."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from moe_l2_contracts.services import PROXY
from moe_l2_contracts.services import SERVICES as MOE_L2_SERVICES
from tests.compose.dockerfiles import image_is_pinned
from tests.compose.loading import ROOT, variables
from tests.compose.shapes import as_argv, as_dict, flag_value, healthcheck_argv, mounts, published_ports

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
# The services that hold the admin token (moe_l2_contracts.admin), and where the volume puts it.
# the services that read the admin token; the gateway (the one service published) and the predictor
# call no admin endpoint, so they do not hold it
TOKEN_HOLDERS = {"cache-manager", "llama"}
TOKEN_FILE = "/run/moe-l2/admin-token"
SERVICE_UID = 10001  # every moe-l2 image's USER
# What the llama image ships beside llama-server (services/llama/Dockerfile): moe-l2-domains, which lists
# the taxonomy's domains for llama's entrypoint, and the taxonomy it reads (../share/moe-l2 from itself).
DOMAINS_SCRIPT = ROOT / "services" / "llama" / "docker" / "moe-l2-domains"
TAXONOMY_FILE = ROOT / "shared" / "moe_l2_domains" / "data" / "taxonomy.yaml"
# llama's entrypoint's line that sets them (compose's and the Kubernetes base's, their escapes undone).
DOMAINS_LINE = 'LLAMA_ARG_MOE_DOMAINS="$(moe-l2-domains)${MOE_L2_EXTRA_DOMAINS:+,$MOE_L2_EXTRA_DOMAINS}"'


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
    assert env.get("LLAMA_ARG_MOE_TELEMETRY") == "1"
    assert env.get("LLAMA_ARG_MOE_TRANSITIONS") == "1", "the expert cache's prefetch learns from these counts"
    assert env.get("GGML_OP_OFFLOAD_MIN_BATCH") == "1"
    assert "LLAMA_ARG_CPU_MOE" in env and "LLAMA_ARG_N_CPU_MOE" in env, "--cpu-moe/--n-cpu-moe are not set"
    assert env.get("LLAMA_ARG_MOE_CACHE_BYTES") == "auto", "the GPU stack splits the experts' budget on its card"
    assert env.get("LLAMA_ARG_MOE_CACHE_POLICY") == "default"
    assert not flag_value(argv, "--alias", "-a").startswith("/"), "clients would see the model's path"
    assert as_argv(llama.get("entrypoint"))[-1] == "llama-server", "the wrapper must exec llama-server"


def check_domains(doc: dict[str, Any]) -> None:
    """llama accepts exactly the domains the Python services accept (moe_l2_domains.known_domains): its
    entrypoint takes the taxonomy's from the image (moe-l2-domains) and adds the extra ones, so compose
    carries no copy of the list (tests/compose/test_domains.py runs it)."""
    services = doc["services"]
    llama = services["llama"]
    env = as_dict(llama.get("environment"))
    assert "LLAMA_ARG_MOE_DOMAINS" not in env, "a copy of the taxonomy's domains: llama's entrypoint reads them"
    assert DOMAINS_LINE in "\n".join(as_argv(llama.get("entrypoint"))), "llama's entrypoint does not set the domains"
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
    # the page cache the pool works on is the host kernel's in any IPC namespace (docs/kubernetes.md)
    assert "ipc" not in cache, "the cache-manager needs no IPC namespace but its own"
    assert "pid" not in cache and "user" not in cache, "llama's PID namespace and root: compose.ram-tier.yaml only"
    assert {c.upper().removeprefix("CAP_") for c in cache.get("cap_add", [])} == {"IPC_LOCK"}
    memlock = (cache.get("ulimits") or {}).get("memlock")
    assert memlock is not None, "cache-manager has no memlock ulimit"
    limits = (memlock, memlock) if isinstance(memlock, int) else (memlock.get("soft"), memlock.get("hard"))
    assert all(int(x) == -1 for x in limits), f"memlock must be unlimited, not {memlock}"
    assert as_argv(cache.get("command")) == ["python", "-m", "moe_l2_cache"]
    entrypoint = as_argv(cache.get("entrypoint"))
    assert entrypoint[:2] == ["sh", "-c"] and 'exec "$@"' in entrypoint[2], "the RAM-budget guard must exec the command"
    check_cache_manager_env(as_dict(cache.get("environment")))


def check_ram_tier(doc: dict[str, Any]) -> None:
    """compose.ram-tier.yaml merged: what docs/ram-tier.md says the tier needs in a container."""
    cache = doc["services"]["cache-manager"]
    assert cache.get("pid") == "service:llama", "the tier must see llama's processes"
    caps = {c.upper().removeprefix("CAP_") for c in cache.get("cap_add", [])}
    assert caps >= {"IPC_LOCK", "SYS_NICE", "SYS_PTRACE"}, caps
    assert str(cache.get("user", "")).split(":")[0] == "0", "added capabilities reach no non-root process"
    assert as_dict(cache.get("environment")).get("MOE_L2_RAM_BUDGET"), "the override without a budget"
    llama = as_dict(doc["services"]["llama"].get("environment"))
    assert llama.get("LLAMA_ARG_MOE_WILLNEED") == "1", "llama reads the chosen experts ahead (--moe-willneed)"


def run_cache_manager_entrypoint(
    cache: dict[str, Any], extra_env: dict[str, str], *, own_pid_namespace: bool
) -> subprocess.CompletedProcess[str]:
    """The cache-manager's entrypoint (a compose service's fields, `$$` already `$`) run by a real sh, its
    command replaced by `env`; `own_pid_namespace`: the shell is PID 1 of a new PID namespace, as in a
    container without `pid: service:llama` (needs root, for unshare)."""
    env = {"PATH": "/usr/bin:/bin", **as_dict(cache.get("environment")), **extra_env}
    argv = [*as_argv(cache["entrypoint"]), "env"]
    if own_pid_namespace:
        argv = ["unshare", "--pid", "--fork", "--mount-proc", *argv]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)


def check_cache_manager_env(env: dict[str, str], llama_url: str = "http://llama:11436") -> None:
    """What the cache-manager must be told, wherever it runs (compose, tests/kubernetes)."""
    assert env.get("MOE_L2_REDIS_URL") == "redis://redis:6379/0"
    assert env.get("MOE_L2_LLAMA_URL") == llama_url
    assert int(env.get("MOE_L2_CACHE_POOL_BYTES", "0")) > 0
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
    """The proxy reaches every replica of llama, the predictor and the cache-manager through one
    service name each (`--scale`), and pairs each llama with the cache-manager that claimed it."""
    proxy = doc["services"]["proxy"]
    assert as_argv(proxy.get("command")) == ["python", "-m", "moe_l2_proxy"]
    env = as_dict(proxy.get("environment"))
    assert env.get("MOE_L2_LLAMA_URLS") == "http://llama:11436"
    assert env.get("MOE_L2_PREDICTOR_URLS") == "http://predictor:11437"
    assert env.get("MOE_L2_CACHE_URLS") == "http://cache-manager:11438"
    assert env.get("MOE_L2_PROXY_CACHE_PAIRING") == "discover"
    assert not {"MOE_L2_LLAMA_URL", "MOE_L2_CACHE_URL"} & set(env), "one name each: the lists"
    check_proxy_exposure(proxy)
    cache = as_dict(doc["services"]["cache-manager"].get("environment"))
    assert cache.get("MOE_L2_CACHE_CLAIM_LLAMA") in ("1", "true"), "each cache-manager must claim its own llama"
    for name in ("llama", "cache-manager"):
        for key in ("container_name", "ports", "hostname"):
            assert key not in doc["services"][name], f"{name} sets {key}: `--scale {name}=N` would break"


def check_proxy_exposure(proxy: dict[str, Any], bind: str = "127.0.0.1") -> None:
    """The gateway listens on 0.0.0.0 in its container and is told where it is really published (so that
    it refuses to start open beyond loopback), and takes the keys and MOE_L2_ALLOW_OPEN from the user."""
    env = as_dict(proxy.get("environment"))
    assert env.get("MOE_L2_PROXY_HOST") == "0.0.0.0"
    [port] = published_ports(proxy)
    assert env.get("MOE_L2_PROXY_EXPOSED_HOST") == port.host_ip == bind, "the gateway must know what is published"
    assert "MOE_L2_PROXY_API_KEYS" in env, "compose must pass the API keys"
    assert env.get("MOE_L2_ALLOW_OPEN") in ("0", "", "false"), "open only on the user's word"


def check_grafana_login(doc: dict[str, Any]) -> None:
    """No admin/admin, no anonymous editor: the admin password is a file the one-shot writes."""
    grafana = doc["services"]["grafana"]
    env = as_dict(grafana.get("environment"))
    assert env.get("GF_AUTH_ANONYMOUS_ENABLED") == "false", "anonymous access"
    assert "GF_AUTH_ANONYMOUS_ORG_ROLE" not in env and env.get("GF_USERS_ALLOW_SIGN_UP") == "false"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env, "a password in the environment (admin by default)"
    password_file = env.get("GF_SECURITY_ADMIN_PASSWORD__FILE", "")
    folder = password_file.rsplit("/", 1)[0]
    [mount] = [m for m in mounts(grafana) if m.target == folder] or [None]
    assert mount and mount.kind == "volume" and mount.read_only, "Grafana's password volume"
    init = doc["services"]["admin-token"]
    [writer] = [m for m in mounts(init) if m.source == mount.source] or [None]
    assert writer and not writer.read_only, "the one-shot does not write Grafana's password"
    init_env = as_dict(init.get("environment"))
    assert init_env.get("GF_SECURITY_ADMIN_PASSWORD__FILE", "").rsplit("/", 1)[0] == writer.target
    assert "MOE_L2_GRAFANA_ADMIN_PASSWORD" in init_env
    assert (grafana.get("depends_on") or {}).get("admin-token", {}).get(
        "condition"
    ) == "service_completed_successfully", "Grafana may start before its password exists"


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


# An override whose whole point is one variable may require it (`:?`): compose then stops, saying so.
REQUIRED = {"compose.ram-tier.yaml": {"MOE_L2_RAM_BUDGET"}}


def check_variables(texts: dict[str, str]) -> None:
    for filename, text in texts.items():
        for name, op in variables(text).items():
            assert name.startswith("MOE_L2_"), f"{filename}: configuration variables are MOE_L2_*, not {name}"
            if name in REQUIRED.get(filename, ()):
                assert op == ":?", f"{filename}: ${{{name}}} must be required"
                continue
            assert op in (":-", "-"), f"{filename}: ${{{name}}} has no default: plain `docker compose up` breaks"


def check_schema(doc: dict[str, Any], schema: dict[str, Any]) -> None:
    import jsonschema

    if "draft-07" in str(schema.get("$schema", "")):
        validator_cls: Any = jsonschema.Draft7Validator
    else:
        validator_cls = jsonschema.validators.validator_for(schema)
    errors = sorted(validator_cls(schema).iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:10])


def install_llama_image_files(bin_dir: Path) -> None:
    """What the llama image puts beside llama-server, as it does: moe-l2-domains in `bin_dir` and the taxonomy
    in `bin_dir`/../share/moe-l2 (tests/compose/test_domains.py checks the Dockerfile's copies)."""
    shutil.copy(DOMAINS_SCRIPT, bin_dir / "moe-l2-domains")
    (bin_dir / "moe-l2-domains").chmod(0o755)
    share = bin_dir.parent / "share" / "moe-l2"
    share.mkdir(parents=True, exist_ok=True)
    shutil.copy(TAXONOMY_FILE, share / "taxonomy.yaml")


def run_llama_entrypoint(
    llama: dict[str, Any], tmp_path: Path, extra_env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """llama's entrypoint + command (a compose service's fields), run by a real sh with a stand-in
    llama-server that prints what it got, beside the llama image's own moe-l2-domains."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    install_llama_image_files(bin_dir)
    stand_in = bin_dir / "llama-server"
    stand_in.write_text(
        '#!/bin/sh\necho "token=$LLAMA_ARG_MOE_ADMIN_TOKEN"\necho "domains=$LLAMA_ARG_MOE_DOMAINS"\necho "args=$*"\n'
    )
    stand_in.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **as_dict(llama.get("environment")), **extra_env}
    argv = as_argv(llama["entrypoint"]) + as_argv(llama["command"])
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
