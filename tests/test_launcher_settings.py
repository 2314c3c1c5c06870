"""Every deployment setting (moe_l2_ops.deployment.SETTINGS) reaches the service whose settings read it, on
each of the three launchers: compose.yaml (read as YAML, interpolated as Compose does), the Kubernetes base
(rendered by `kubectl kustomize`) and `moe-l2 up` (its services as it builds them, with the environment
the supervisor gives each). A launcher that drops one fails here; test_a_dropped_setting_is_caught drops
one from each and shows it.

What "reaches" means, per service:
- a Python service: the variable, with the user's value, in its environment (compose, `up`: then read back
  through the service's own settings model); on Kubernetes, declared on its container;
- llama-server: what LlamaSettings makes of the value (moe_l2_llama.command_line.llama_server_command / _env:
  a flag with the value, a switch, a variable), in llama's arguments or as llama-server's own LLAMA_ARG_*;
- replicas: compose's `scale:`, the workload's replicas (the predictor's HorizontalPodAutoscaler), `up`'s
  number of processes.
On compose, llama-server's side is what it is started with: its entrypoint (a shell: it derives -c) run
with a stand-in llama-server that records its arguments and environment.

And one default each: a setting's default in its settings model is the one compose.yaml falls back on, the
Kubernetes base declares and `moe-l2 up` uses; llama-server's slots, context per request (-c over the slots)
and model name as each launcher starts it by default are LlamaSettings' defaults. A different default planted
in each launcher is caught, the check naming the setting and both values (test_a_planted_default_is_caught).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import pytest

import moe_l2_llama.command_line
import moe_l2_llama.settings
from moe_l2_llama.command_line import llama_server_command, llama_server_env
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.deployment import (
    COMPOSE,
    KUBERNETES,
    LAUNCHER,
    RAM_TIER_COMPOSE,
    RAM_TIER_KUBERNETES,
    SETTINGS,
    SETTINGS_MODELS,
    UP,
    Setting,
    field_env,
)
from moe_l2_ops.supervisor import ServiceSpec
from tests.compose.checks import install_llama_image_files
from tests.compose.loading import _BRACED_RE, _VAR_RE, ROOT, interpolate, load_compose_text, merge
from tests.compose.loading import COMPOSE as COMPOSE_FILE
from tests.compose.shapes import as_argv, as_dict
from tests.kubernetes.rendering import TARGETS, Obj, containers, find, kubelet_expand, render, workloads
from tests.kubernetes.rendering import env as declared_env
from tests.test_env_convention import env_names

# Each request's context, from which llama-server's -c is made (times the slots). moe_l2_ops.deployment (owned
# elsewhere) lists ctx_size, the total it replaces; until it lists this one too, it is checked from here. With
# one slot the example is -c itself; test_the_total_is_each_request_times_the_slots checks the product.
CTX_PER_REQUEST = Setting(
    "llama-server's context per request (KV cache)",
    "llama",
    "ctx_per_request",
    "8192",
    needs=MappingProxyType({"MOE_L2_LLAMA_PARALLEL": "1"}),
)
CHECKED = SETTINGS if CTX_PER_REQUEST.name in {s.name for s in SETTINGS} else (*SETTINGS, CTX_PER_REQUEST)
IDS = [setting.env for setting in CHECKED]
# llama-server's short spellings of the flags LlamaSettings writes long (compose and the base use them)
LLAMA_FLAG_ALIASES = {"--parallel": {"-np"}, "--ctx-size": {"-c"}, "--alias": {"-a"}, "--model": {"-m"}}
MODEL = Path("/models/model.gguf")


@contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """os.environ is exactly `values` (its MOE_L2_* at least) for the block."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update({k: v for k, v in saved.items() if not k.startswith("MOE_L2_")} | dict(values))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def user_env(setting: Setting) -> dict[str, str]:
    return {**setting.needs, setting.env: setting.example}


def field_for(service: str, env: str) -> str:
    """The field of a service's settings model that reads `env`."""
    [name] = [f for f, names in env_names(SETTINGS_MODELS[service]).items() if env in names]
    return name


def read_back(service: str, setting: Setting, env: Mapping[str, str]) -> Any:
    with environment(env):
        return getattr(SETTINGS_MODELS[service](), field_for(service, setting.env))


# ------------------------------------------------------------------ the description itself


@pytest.mark.parametrize("setting", CHECKED, ids=IDS)
def test_each_setting_is_read_by_its_services(setting: Setting) -> None:
    """The variable is the one each named service's settings read, and the example is a value they accept
    that is not their default (so that the launchers' checks below can tell it arrived)."""
    if setting.owner == LAUNCHER:
        from moe_l2_ops.llama_replicas import REPLICAS_ENV, default_replica_count
        from moe_l2_ops.predictor_replicas import replica_count

        count = {"MOE_L2_LLAMA_REPLICAS": default_replica_count, "MOE_L2_PREDICTOR_REPLICAS": replica_count}
        assert REPLICAS_ENV in count and setting.env in count, f"{setting.env} is no launcher's"
        with environment(user_env(setting)):
            assert count[setting.env]() == int(setting.example) != 1
        return
    for service in setting.services:
        given = read_back(service, setting, user_env(setting))
        default = read_back(service, setting, dict(setting.needs))
        assert given != default, f"{service}: the example {setting.example!r} is the default"


def test_the_list_covers_what_the_issue_names() -> None:
    names = {setting.env for setting in SETTINGS}
    assert names >= {
        "MOE_L2_PROXY_API_KEYS",
        "MOE_L2_ADMIN_TOKEN",
        "MOE_L2_PROXY_ORIGINS",
        "MOE_L2_LLAMA_EXPERT_CACHE_BYTES",
        "MOE_L2_LLAMA_EXPERT_CACHE_POLICY",
        "MOE_L2_RAM_BUDGET",
        "MOE_L2_LLAMA_REPLICAS",
        "MOE_L2_PREDICTOR_REPLICAS",
        "MOE_L2_PROXY_ROUTING",
        "MOE_L2_LLAMA_MODEL_ALIAS",
        "MOE_L2_CACHE_POOL_BYTES",
    }
    assert len(names) == len(SETTINGS), "a setting listed twice"


# ------------------------------------------------------------------ llama-server's side of a setting


def llama_effects(setting: Setting) -> tuple[set[str], set[str], dict[str, str]]:
    """What LlamaSettings makes of the setting's example: flags followed by the example, switches that
    appear, and llama-server variables set to the example."""
    with environment(setting.needs):
        base = LlamaSettings()
        argv0, env0 = llama_server_command(Path("llama-server"), MODEL, base), llama_server_env(base)
    with environment(user_env(setting)):
        given = LlamaSettings()
        argv, env = llama_server_command(Path("llama-server"), MODEL, given), llama_server_env(given)
    valued = {argv[i - 1] for i, arg in enumerate(argv) if arg == setting.example and i > 0}
    # flags that appear, standing alone (the next argument is another flag, or none)
    switches = {
        a
        for i, a in enumerate(argv)
        if a.startswith("--") and a not in argv0 and (i + 1 == len(argv) or argv[i + 1].startswith("-"))
    }
    variables = {k: v for k, v in env.items() if v == setting.example and env0.get(k) != v}
    assert valued or switches or variables, f"LlamaSettings makes nothing of {setting.env}"
    return valued, switches, variables


def llama_arg_env(flag: str) -> str:
    """llama-server's own variable for a flag (common/arg.cpp's set_env names)."""
    return "LLAMA_ARG_" + flag.lstrip("-").upper().replace("-", "_")


def flag_values(argv: list[str], flag: str) -> list[str]:
    names = {flag} | LLAMA_FLAG_ALIASES.get(flag, set())
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in names]


def check_llama_args(setting: Setting, argv: list[str], env: Mapping[str, str]) -> None:
    """llama-server, started with `argv` and `env`, gets the setting's example as LlamaSettings would pass it."""
    valued, switches, variables = llama_effects(setting)
    for flag in valued:
        assert setting.example in flag_values(argv, flag) or env.get(llama_arg_env(flag)) == setting.example, (
            f"llama: {setting.env} does not reach {flag}"
        )
    for flag in switches:
        assert flag in argv or env.get(llama_arg_env(flag), "").lower() in ("1", "true", "on", "enabled"), (
            f"llama: {setting.env} does not turn on {flag}"
        )
    for name, value in variables.items():
        assert env.get(name) == value, f"llama: {setting.env} does not reach {name}"


def script_reads(container: Obj, name: str) -> bool:
    """llama's entrypoint script reads the variable (it makes -c of each request's context and the slots)."""
    return re.search(rf"\$\{{?{name}\b", " ".join(container.get("command", []))) is not None


def check_llama_declares(setting: Setting, container: Obj) -> None:
    """Kubernetes: llama's container declares where the setting goes (its flag, its LLAMA_ARG_* variable, or
    the setting's variable, which its entrypoint reads)."""
    valued, switches, variables = llama_effects(setting)
    names = {e["name"] for e in container.get("env", [])}
    argv = [*container.get("command", []), *container.get("args", [])]
    for flag in valued | switches:
        spellings = {flag} | LLAMA_FLAG_ALIASES.get(flag, set())
        assert spellings & set(argv) or llama_arg_env(flag) in names or script_reads(container, setting.env), (
            f"llama: nowhere for {setting.env} ({flag})"
        )
    for name in variables:
        assert name in names or setting.file_env in names, f"llama: nowhere for {setting.env} ({name})"


# ------------------------------------------------------------------ compose


def compose_doc(setting: Setting, env: Mapping[str, str]) -> dict[str, Any]:
    """compose.yaml interpolated with `env`; with compose.ram-tier.yaml where the setting lives there."""
    raw = load_compose_text(COMPOSE_FILE.read_text())
    if setting.elsewhere.get(COMPOSE) == RAM_TIER_COMPOSE:
        raw = merge(raw, load_compose_text((ROOT / RAM_TIER_COMPOSE).read_text()))
    return interpolate(raw, dict(env))


# A stand-in llama-server: records the arguments and the environment it was started with, beside itself.
STAND_IN = f"""#!{sys.executable}
import json, os, sys
with open(os.path.join(os.path.dirname(__file__), "started.json"), "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, f)
"""


class Started(NamedTuple):
    argv: list[str]
    env: dict[str, str]
    stderr: str


def started_llama(entrypoint: list[str], command: list[str], environment: Mapping[str, str]) -> Started:
    """llama-server's arguments and environment as llama's entrypoint (a shell, compose's or the Kubernetes
    base's, escapes already undone) starts it in a container with `environment`, and what the shell said; the
    admin token's volume holds a token, as it does once the one-shot (compose) or the Secret (Kubernetes) has
    written it; the image's moe-l2-domains is beside the stand-in."""
    with tempfile.TemporaryDirectory() as tmp:
        bin_dir = Path(tmp) / "bin"
        bin_dir.mkdir()
        install_llama_image_files(bin_dir)
        stand_in = bin_dir / "llama-server"
        stand_in.write_text(STAND_IN)
        stand_in.chmod(0o755)
        token = Path(tmp) / "admin-token"
        token.write_text("token-from-the-volume")
        env = {**environment, "MOE_L2_ADMIN_TOKEN_FILE": str(token), "PATH": f"{bin_dir}:/usr/bin:/bin"}
        done = subprocess.run([*entrypoint, *command], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"llama's entrypoint: {done.stderr.strip()}"
        started = json.loads((bin_dir / "started.json").read_text())
    return Started(started["argv"], started["env"], done.stderr)


def compose_llama(doc: dict[str, Any]) -> Started:
    """llama-server as compose's llama service starts it (`doc` interpolated)."""
    spec = doc["services"]["llama"]
    return started_llama(as_argv(spec["entrypoint"]), as_argv(spec.get("command")), as_dict(spec.get("environment")))


def kubernetes_llama(container: Obj) -> Started:
    """llama-server as the llama container starts it: its command and arguments as the kubelet expands them."""
    variables = declared_env(container)
    return started_llama(
        [kubelet_expand(a, variables) for a in container["command"]],
        [kubelet_expand(a, variables) for a in container.get("args", [])],
        variables,
    )


def check_compose(setting: Setting, doc: dict[str, Any]) -> None:
    for service in setting.services:
        spec = doc["services"][service]
        if setting.owner == LAUNCHER:
            assert str(spec.get("scale")) == setting.example, f"compose: {setting.env} does not scale {service}"
        elif service == "llama":
            started = compose_llama(doc)
            check_llama_args(setting, started.argv, started.env)
        else:
            assert as_dict(spec.get("environment")).get(setting.env) == setting.example, (
                f"compose: {setting.env} does not reach {service}"
            )


@pytest.mark.parametrize("setting", CHECKED, ids=IDS)
def test_compose_carries_it(setting: Setting) -> None:
    check_compose(setting, compose_doc(setting, user_env(setting)))
    if setting.elsewhere.get(COMPOSE):
        # compose.yaml alone hands it to the owner, whose entrypoint refuses it in one line (tests/compose)
        alone = interpolate(load_compose_text(COMPOSE_FILE.read_text()), user_env(setting))
        owner = alone["services"][setting.owner]
        assert as_dict(owner.get("environment")).get(setting.env) == setting.example, "dropped, not refused"
        assert setting.env in " ".join(as_argv(owner.get("entrypoint"))), f"{setting.owner} does not refuse it"


# ------------------------------------------------------------------ Kubernetes


def rendered(target: str) -> list[Obj]:
    return copy.deepcopy(_rendered(target))


_CACHE: dict[str, list[Obj]] = {}


def _rendered(target: str) -> list[Obj]:
    if target not in _CACHE:
        _CACHE[target] = render(target)
    return _CACHE[target]


def check_kubernetes(setting: Setting, objects: list[Obj]) -> None:
    every = containers(objects)
    for service in setting.services:
        container, workload = every[service]
        if setting.owner == LAUNCHER:
            scalers = [
                o
                for o in objects
                if o["kind"] == "HorizontalPodAutoscaler"
                and o["spec"]["scaleTargetRef"]["name"] == workload["metadata"]["name"]
            ]
            assert isinstance(workload["spec"].get("replicas"), int) or scalers, f"kubernetes: who scales {service}?"
        elif service == "llama":
            check_llama_declares(setting, container)
        else:
            names = {e["name"] for e in container.get("env", [])}
            assert setting.env in names or setting.file_env in names, (
                f"kubernetes: {service} does not declare {setting.env}"
            )


@pytest.mark.parametrize("setting", CHECKED, ids=IDS)
def test_the_kubernetes_base_carries_it(setting: Setting) -> None:
    where = setting.elsewhere.get(KUBERNETES)
    target = "ram-tier" if where == RAM_TIER_KUBERNETES else "base"
    check_kubernetes(setting, rendered(target))
    if where:
        # the base: the owner's container refuses it in one line (tests/kubernetes runs the refusal)
        container, _ = containers(rendered("base"))[setting.owner]
        assert setting.env in " ".join(container.get("command", [])), f"the base's {setting.owner} does not refuse it"


# ------------------------------------------------------------------ moe-l2 up


def up_services(env: Mapping[str, str], tmp_path: Path) -> list[ServiceSpec]:
    """`moe-l2 up`'s services as its main() builds them, under the user's `env` (no process started)."""
    from moe_l2_ops.stack import StackSettings, parse_args, stack_admin_token, stack_services

    tmp_path.mkdir(parents=True, exist_ok=True)
    binary = tmp_path / "llama-server"
    binary.touch()
    with environment({**env, "MOE_L2_STATE_DIR": str(tmp_path / "state")}):
        args = parse_args([])
        settings = StackSettings()
        token = stack_admin_token(settings)
        services = stack_services(settings, MODEL, binary, token, args.llama_replicas)
        for spec in services:  # what each process would start with, read while the user's env is on
            spec.env = spec.environment()
    return services


def named(services: list[ServiceSpec], service: str) -> list[ServiceSpec]:
    return [s for s in services if s.name == service or s.name.removeprefix(service + "-").isdigit()]


def check_up(setting: Setting, services: list[ServiceSpec]) -> None:
    for service in setting.services:
        specs = named(services, service)
        if setting.owner == LAUNCHER:
            assert len(specs) == int(setting.example), f"moe-l2 up: {setting.env} starts {len(specs)} {service}"
            continue
        assert specs, f"moe-l2 up runs no {service}"
        for spec in specs:
            if service == "llama":
                check_llama_args(setting, spec.argv, spec.env)
            else:
                expected = read_back(service, setting, user_env(setting))
                assert read_back(service, setting, spec.env) == expected, (
                    f"moe-l2 up: {setting.env} does not reach {spec.name}"
                )


@pytest.mark.parametrize("setting", CHECKED, ids=IDS)
def test_moe_l2_up_carries_it(setting: Setting, tmp_path: Path) -> None:
    assert UP not in setting.elsewhere, "`moe-l2 up` runs every setting itself"
    check_up(setting, up_services(user_env(setting), tmp_path))


# ------------------------------------------------------------------ a launcher that drops one fails


def _without(env: dict[str, str], name: str) -> None:
    env.pop(name, None)


def test_a_dropped_setting_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    by_env = {s.env: s for s in SETTINGS}

    # compose: the gateway's keys left out of its environment
    keys = by_env["MOE_L2_PROXY_API_KEYS"]
    doc = compose_doc(keys, user_env(keys))
    check_compose(keys, doc)
    doc["services"]["proxy"]["environment"].pop("MOE_L2_PROXY_API_KEYS")
    with pytest.raises(AssertionError, match="compose: MOE_L2_PROXY_API_KEYS does not reach proxy"):
        check_compose(keys, doc)

    # Kubernetes: the expert cache's policy no longer declared on llama
    policy = by_env["MOE_L2_LLAMA_EXPERT_CACHE_POLICY"]
    objects = rendered("base")
    check_kubernetes(policy, objects)
    llama = containers(objects)["llama"][0]
    llama["env"] = [e for e in llama["env"] if e["name"] != "LLAMA_ARG_MOE_CACHE_POLICY"]
    with pytest.raises(AssertionError, match="llama: nowhere for MOE_L2_LLAMA_EXPERT_CACHE_POLICY"):
        check_kubernetes(policy, objects)

    # moe-l2 up: a service started without the user's CORS origins
    origins = by_env["MOE_L2_PROXY_ORIGINS"]
    check_up(origins, up_services(user_env(origins), tmp_path / "a"))
    real = ServiceSpec.environment
    monkeypatch.setattr(
        ServiceSpec, "environment", lambda self: {k: v for k, v in real(self).items() if k != "MOE_L2_PROXY_ORIGINS"}
    )
    with pytest.raises(AssertionError, match="moe-l2 up: MOE_L2_PROXY_ORIGINS does not reach proxy"):
        check_up(origins, up_services(user_env(origins), tmp_path / "b"))


def test_replicas_and_workloads_agree() -> None:
    """The base runs one llama pod with both containers: its replicas are llama's and the cache-manager's."""
    objects = rendered("base")
    llama = find(objects, "StatefulSet", "llama")
    assert {c["name"] for c in llama["spec"]["template"]["spec"]["containers"]} == {"llama", "cache-manager"}
    assert {w["metadata"]["name"] for w in workloads(objects)} >= {"llama", "predictor", "proxy"}


# ------------------------------------------------------------------ one default per setting

# What a launcher starts llama-server with by default, read back as LlamaSettings' fields: `moe-l2 up`,
# compose and Kubernetes must all start it as these fields' defaults say (the issue: 4,096 tokens over 4 slots
# under `up`, 16,384 under compose; the GGUF's name under `up`, moe-l2 under compose).
SERVED = ("parallel", "ctx_per_request", "model_alias")
TOTAL = "llama-server's -c"  # not a setting: each request's context times the slots, made by each launcher
# Settings whose compose.yaml fallback differs from the model's default on purpose, and why.
OWN_DEFAULTS = {
    "MOE_L2_LLAMA_EXPERT_CACHE_BYTES": "compose.yaml is the GPU stack, and auto is `moe-l2 up`'s default on a "
    "GPU build too (moe_l2_llama.serving_plan.GPU_DEFAULTS); compose.cpu.yaml and the Kubernetes base turn it off",
}
# compose's entrypoint unsets these when empty, so that an empty fallback is no value at all
UNSET_WHEN_EMPTY = {"MOE_L2_RAM_BUDGET"}  # the cache-manager's: `[ -n "$$MOE_L2_RAM_BUDGET" ] || unset ...`
# (where, a setting's variable or TOTAL, its value there)
Seen = list[tuple[str, str, str]]


def model_value(setting: Setting, raw: str | None) -> str:
    """What the setting's model makes of `raw` as its variable (None: unset, its default), as text."""
    env = {} if raw is None else {setting.env: raw}
    if setting.owner == LAUNCHER:
        from moe_l2_ops.llama_replicas import default_replica_count
        from moe_l2_ops.predictor_replicas import replica_count

        count = {"MOE_L2_LLAMA_REPLICAS": default_replica_count, "MOE_L2_PREDICTOR_REPLICAS": replica_count}
        with environment(env):
            return str(count[setting.env]())
    return str(read_back(setting.owner, setting, env))


def expected_defaults() -> dict[str, str]:
    """The one source: every setting's default in its settings model, and the -c LlamaSettings' defaults make."""
    expected = {setting.env: model_value(setting, None) for setting in CHECKED}
    with environment({}):
        llama = LlamaSettings()
    # the served ones whether or not moe_l2_ops.deployment lists them
    expected |= {field_env(LlamaSettings, name): str(getattr(llama, name)) for name in SERVED}
    # the rule itself rather than total_context(): a launcher that computes it otherwise differs here
    expected[TOTAL] = str(llama.ctx_per_request * llama.parallel)
    return expected


def as_started(where: str, argv: list[str], env: Mapping[str, str]) -> Seen:
    """llama-server's slots, context per request, total and name as it was started (a flag wins over its
    LLAMA_ARG_* variable, and a later flag over an earlier one, as in llama-server)."""

    def given(flag: str, variable: str) -> str:
        values = flag_values(argv, flag)
        return values[-1] if values else env.get(variable, "(unset)")

    slots, total = given("--parallel", "LLAMA_ARG_N_PARALLEL"), given("--ctx-size", "LLAMA_ARG_CTX_SIZE")
    per_request = str(int(total) // int(slots)) if total.isdigit() and slots.isdigit() else f"{total} / {slots}"
    names = {name: field_env(LlamaSettings, name) for name in SERVED}
    return [
        (where, names["parallel"], slots),
        (where, names["ctx_per_request"], per_request),
        (where, TOTAL, total),
        (where, names["model_alias"], given("--alias", "LLAMA_ARG_ALIAS")),
    ]


def compose_fallbacks(filename: str, text: str) -> Seen:
    """Every `${VAR:-default}` of a checked setting in a compose file, as its settings model reads the default."""
    by_env = {setting.env: setting for setting in CHECKED}
    seen = []
    for match in _VAR_RE.finditer(text):
        braced = _BRACED_RE.match(match.group(2) or "")  # group 2: a ${...}; `$$` escapes are group 1
        if braced is None:
            continue
        name, op, fallback = braced.groups()
        if op in (":-", "-") and name in by_env and name not in OWN_DEFAULTS:
            given = None if name in UNSET_WHEN_EMPTY and not fallback else fallback
            seen.append((f"{filename} falls back on", name, model_value(by_env[name], given)))
    return seen


def compose_defaults(texts: Mapping[str, str]) -> Seen:
    """compose's fallbacks in each file, and llama-server as compose starts it with no setting given: from
    compose.yaml, and with each override (`texts`: file name -> its text; compose.yaml's first)."""
    [(base_name, base_text), *overrides] = texts.items()
    seen = [item for filename, text in texts.items() for item in compose_fallbacks(filename, text)]
    base = load_compose_text(base_text)
    # the RAM tier's override requires its budget: any, it is not one of these settings
    given = {"MOE_L2_RAM_BUDGET": "6GiB"}
    docs = {base_name: interpolate(base, given)}
    for filename, text in overrides:
        docs[f"{base_name} + {filename}"] = interpolate(merge(base, load_compose_text(text)), given)
    for files, doc in docs.items():
        started = compose_llama(doc)
        seen += as_started(f"{files} starts llama-server with", started.argv, started.env)
    return seen


def kubernetes_defaults(target: str, objects: list[Obj]) -> Seen:
    """The values the rendered manifests declare for a checked setting's variable, and llama-server as the llama
    container starts it."""
    every = containers(objects)
    seen = []
    for setting in CHECKED:
        if setting.owner == LAUNCHER or setting.env in OWN_DEFAULTS:
            continue
        if Path(setting.elsewhere.get(KUBERNETES, "")).name == target:
            continue  # the overlay that carries it must set it (the RAM tier's budget): the user's to edit
        for service in setting.services:
            value = declared_env(every[service][0]).get(setting.env)
            if value is not None:
                seen.append((f"Kubernetes {target} declares on {service}", setting.env, model_value(setting, value)))
    started = kubernetes_llama(every["llama"][0])
    return seen + as_started(f"Kubernetes {target} starts llama-server with", started.argv, started.env)


def up_defaults(tmp_path: Path) -> Seen:
    """llama-server as `moe-l2 up` starts it with no setting given (each replica's, were there several)."""
    return [
        item
        for spec in named(up_services({}, tmp_path), "llama")
        for item in as_started("moe-l2 up starts llama-server with", spec.argv, spec.env)
    ]


def difference(name: str, default: str, where: str, value: str) -> str:
    return f"{name}: the settings model's default is {default!r}, {where} {value!r}"


def check_defaults(expected: Mapping[str, str], seen: Seen) -> None:
    """Every launcher's default is the settings model's: else one line per difference, naming the setting,
    the model's default and the launcher's."""
    problems = [
        difference(name, expected[name], where, value) for where, name, value in seen if value != expected[name]
    ]
    assert not problems, "a launcher's default is not the settings model's:\n" + "\n".join(problems)


def compose_texts() -> dict[str, str]:
    names = ("compose.yaml", "compose.cpu.yaml", RAM_TIER_COMPOSE)
    return {name: (ROOT / name).read_text() for name in names}


def test_compose_defaults_are_the_settings_models() -> None:
    seen = compose_defaults(compose_texts())
    assert {name for _, name, _ in seen} >= {*(field_env(LlamaSettings, n) for n in SERVED), TOTAL}
    check_defaults(expected_defaults(), seen)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_kubernetes_defaults_are_the_settings_models(target: str) -> None:
    seen = kubernetes_defaults(target, rendered(target))
    # each request's context is a variable of the llama container (its entrypoint makes -c of it)
    declared = {name for where, name, _ in seen if where.endswith("declares on llama")}
    assert "MOE_L2_LLAMA_CTX_PER_REQUEST" in declared
    check_defaults(expected_defaults(), seen)


def test_moe_l2_up_defaults_are_the_settings_models(tmp_path: Path) -> None:
    check_defaults(expected_defaults(), up_defaults(tmp_path))


def test_the_defaults_are_4_slots_of_4096_tokens_and_moe_l2() -> None:
    """The single defaults (docs/containers.md and docs/kubernetes.md give them): 4 slots of 4,096 tokens, -c
    16,384, the name moe-l2."""
    expected = expected_defaults()
    assert (expected["MOE_L2_LLAMA_PARALLEL"], expected["MOE_L2_LLAMA_CTX_PER_REQUEST"]) == ("4", "4096")
    assert (expected[TOTAL], expected["MOE_L2_LLAMA_MODEL_ALIAS"]) == ("16384", "moe-l2")


def test_a_planted_default_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = expected_defaults()

    # compose: another fallback for the slots (in a copy of compose.yaml's text)
    texts = compose_texts()
    planted = texts["compose.yaml"].replace("${MOE_L2_LLAMA_PARALLEL:-4}", "${MOE_L2_LLAMA_PARALLEL:-8}")
    assert planted != texts["compose.yaml"]
    with pytest.raises(AssertionError) as caught:
        check_defaults(expected, compose_defaults({**texts, "compose.yaml": planted}))
    said = str(caught.value)
    assert difference("MOE_L2_LLAMA_PARALLEL", "4", "compose.yaml falls back on", "8") in said
    # and llama-server is started so: 8 slots, 8 x 4096 in all
    assert difference("MOE_L2_LLAMA_PARALLEL", "4", "compose.yaml starts llama-server with", "8") in said
    assert difference(TOTAL, "16384", "compose.yaml starts llama-server with", "32768") in said

    # Kubernetes: another context per request declared on llama, another name in its arguments
    objects = rendered("base")
    llama = containers(objects)["llama"][0]
    [per_request] = [item for item in llama["env"] if item["name"] == "MOE_L2_LLAMA_CTX_PER_REQUEST"]
    per_request["value"] = "2048"
    llama["args"][llama["args"].index("--alias") + 1] = "deepseek-v2-lite"
    with pytest.raises(AssertionError) as caught:
        check_defaults(expected, kubernetes_defaults("base", objects))
    said = str(caught.value)
    assert difference("MOE_L2_LLAMA_CTX_PER_REQUEST", "4096", "Kubernetes base declares on llama", "2048") in said
    assert difference(TOTAL, "16384", "Kubernetes base starts llama-server with", "8192") in said
    started = "Kubernetes base starts llama-server with"
    assert difference("MOE_L2_LLAMA_MODEL_ALIAS", "moe-l2", started, "deepseek-v2-lite") in said

    # moe-l2 up: the issue's -c, each request's context as the total (1,024 tokens a request over 4 slots)
    monkeypatch.setattr(moe_l2_llama.command_line, "total_context", lambda settings: settings.ctx_per_request)
    with pytest.raises(AssertionError) as caught:
        check_defaults(expected, up_defaults(tmp_path))
    said = str(caught.value)
    assert difference("MOE_L2_LLAMA_CTX_PER_REQUEST", "4096", "moe-l2 up starts llama-server with", "1024") in said
    assert difference(TOTAL, "16384", "moe-l2 up starts llama-server with", "4096") in said


# ------------------------------------------------------------------ the context: each request's, times the slots


def patched_llama(values: Mapping[str, str], slots: str | None = None) -> Obj:
    """The base's llama container as a kustomize patch would leave it: `values` set on it, -np `slots`."""
    container = copy.deepcopy(containers(rendered("base"))["llama"][0])
    container["env"] = [e for e in container["env"] if e["name"] not in values]
    container["env"] += [{"name": name, "value": value} for name, value in values.items()]
    if slots is not None:
        container["args"][container["args"].index("-np") + 1] = slots
    return container


def up_llama(env: Mapping[str, str], tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    [spec] = named(up_services(env, tmp_path), "llama")
    return spec.argv, spec.env


def ctx_and_slots(argv: list[str], env: Mapping[str, str]) -> tuple[str, str]:
    """llama-server's -c and -np, from its arguments or its LLAMA_ARG_* variables."""
    seen = {name: value for _, name, value in as_started("", argv, env)}
    return seen[TOTAL], seen["MOE_L2_LLAMA_PARALLEL"]


def test_the_total_is_each_request_times_the_slots(tmp_path: Path) -> None:
    """8,192 tokens a request over 3 slots: llama-server's -c is 24,576 whichever launcher starts it."""
    user = {"MOE_L2_LLAMA_CTX_PER_REQUEST": "8192", "MOE_L2_LLAMA_PARALLEL": "3"}
    compose = compose_llama(interpolate(load_compose_text(COMPOSE_FILE.read_text()), user))
    kubernetes = kubernetes_llama(patched_llama({"MOE_L2_LLAMA_CTX_PER_REQUEST": "8192"}, slots="3"))
    for argv, env in ((compose.argv, compose.env), (kubernetes.argv, kubernetes.env), up_llama(user, tmp_path)):
        assert ctx_and_slots(argv, env) == ("24576", "3")


def test_the_old_total_still_works_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """MOE_L2_LLAMA_CTX_SIZE, the total over the slots before each request's context: still -c itself, with one
    line saying which variable replaces it."""
    old = {"MOE_L2_LLAMA_CTX_SIZE": "12288"}
    compose = compose_llama(interpolate(load_compose_text(COMPOSE_FILE.read_text()), old))
    kubernetes = kubernetes_llama(patched_llama(old))
    for started in (compose, kubernetes):
        assert ctx_and_slots(started.argv, started.env) == ("12288", "4")
        [line] = started.stderr.splitlines()
        assert "MOE_L2_LLAMA_CTX_SIZE is deprecated: set MOE_L2_LLAMA_CTX_PER_REQUEST instead" in line
    moe_l2_llama.settings.warn_ctx_size_deprecated.cache_clear()
    with caplog.at_level("WARNING", logger="moe_l2.settings"):
        assert ctx_and_slots(*up_llama(old, tmp_path)) == ("12288", "4")
    [record] = [r for r in caplog.records if "MOE_L2_LLAMA_CTX_SIZE" in r.getMessage()]  # once, not per build
    assert "set MOE_L2_LLAMA_CTX_PER_REQUEST instead" in record.getMessage()
    # the default, without it: no line
    assert not kubernetes_llama(patched_llama({})).stderr


@pytest.mark.parametrize("value", ["4k", "-1", ""])
def test_a_context_that_is_no_number_is_refused(value: str, tmp_path: Path) -> None:
    """llama's entrypoint (compose's, Kubernetes') refuses it in one line before llama-server starts, rather
    than hand it -c 0 (the model's whole context); `moe-l2 up`'s settings refuse it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    install_llama_image_files(bin_dir)  # the image's moe-l2-domains, which the entrypoint runs first
    compose = interpolate(load_compose_text(COMPOSE_FILE.read_text()))["services"]["llama"]
    container = patched_llama({"MOE_L2_LLAMA_CTX_PER_REQUEST": value})
    variables = declared_env(container)
    for argv, env in (
        (as_argv(compose["entrypoint"]) + as_argv(compose["command"]), as_dict(compose["environment"])),
        ([kubelet_expand(a, variables) for a in [*container["command"], *container["args"]]], variables),
    ):
        # no llama-server on PATH: had the shell gone on to start it, it would say that instead
        path = f"{bin_dir}:/usr/bin:/bin"
        env = {**env, "MOE_L2_LLAMA_CTX_PER_REQUEST": value, "LLAMA_ARG_MOE_ADMIN_TOKEN": "t", "PATH": path}
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 1
        assert done.stderr.splitlines() == [f"MOE_L2_LLAMA_CTX_PER_REQUEST={value}, -np 4: both must be whole numbers"]
    if value:
        with environment({"MOE_L2_LLAMA_CTX_PER_REQUEST": value}), pytest.raises(ValueError, match="ctx_per_request"):
            LlamaSettings()


def test_an_empty_variable_is_the_default(tmp_path: Path) -> None:
    """compose's `${VAR:-default}` makes an empty variable the default; `moe-l2 up` reads it so too."""
    empty = {field_env(LlamaSettings, name): "" for name in SERVED}
    compose = compose_llama(interpolate(load_compose_text(COMPOSE_FILE.read_text()), empty))
    expected = expected_defaults()
    check_defaults(expected, as_started("compose.yaml starts llama-server with", compose.argv, compose.env))
    check_defaults(expected, as_started("moe-l2 up starts llama-server with", *up_llama(empty, tmp_path)))
