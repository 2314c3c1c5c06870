"""Every deployment setting (moe_l2_ops.deployment.SETTINGS) reaches the service whose settings read it, on
each of the three launchers: compose.yaml (read as YAML, interpolated as Compose does), the Kubernetes base
(rendered by `kubectl kustomize`) and `moe-l2 up` (its services as it builds them, with the environment
the supervisor gives each). A launcher that drops one fails here; test_a_dropped_setting_is_caught drops
one from each and shows it.

What "reaches" means, per service:
- a Python service: the variable, with the user's value, in its environment (compose, `up`: then read back
  through the service's own settings model); on Kubernetes, declared on its container;
- llama-server: what LlamaSettings makes of the value (moe_l2_llama.settings.llama_server_command / _env:
  a flag with the value, a switch, a variable), in llama's arguments or as llama-server's own LLAMA_ARG_*;
- replicas: compose's `scale:`, the workload's replicas (the predictor's HorizontalPodAutoscaler), `up`'s
  number of processes.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from moe_l2_llama.settings import LlamaSettings, llama_server_command, llama_server_env
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
)
from moe_l2_ops.supervisor import ServiceSpec
from tests.compose.loading import COMPOSE as COMPOSE_FILE
from tests.compose.loading import ROOT, interpolate, load_compose_text, merge
from tests.compose.shapes import as_argv, as_dict
from tests.kubernetes.rendering import Obj, containers, find, render, workloads
from tests.test_env_convention import env_names

IDS = [setting.env for setting in SETTINGS]
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


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
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


def check_llama_declares(setting: Setting, container: Obj) -> None:
    """Kubernetes: llama's container declares where the setting goes (its flag, or the variable)."""
    valued, switches, variables = llama_effects(setting)
    names = {e["name"] for e in container.get("env", [])}
    argv = [*container.get("command", []), *container.get("args", [])]
    for flag in valued | switches:
        spellings = {flag} | LLAMA_FLAG_ALIASES.get(flag, set())
        assert spellings & set(argv) or llama_arg_env(flag) in names, f"llama: nowhere for {setting.env} ({flag})"
    for name in variables:
        assert name in names or setting.file_env in names, f"llama: nowhere for {setting.env} ({name})"


# ------------------------------------------------------------------ compose


def compose_doc(setting: Setting, env: Mapping[str, str]) -> dict[str, Any]:
    """compose.yaml interpolated with `env`; with compose.ram-tier.yaml where the setting lives there."""
    raw = load_compose_text(COMPOSE_FILE.read_text())
    if setting.elsewhere.get(COMPOSE) == RAM_TIER_COMPOSE:
        raw = merge(raw, load_compose_text((ROOT / RAM_TIER_COMPOSE).read_text()))
    return interpolate(raw, dict(env))


def check_compose(setting: Setting, doc: dict[str, Any]) -> None:
    for service in setting.services:
        spec = doc["services"][service]
        if setting.owner == LAUNCHER:
            assert str(spec.get("scale")) == setting.example, f"compose: {setting.env} does not scale {service}"
        elif service == "llama":
            check_llama_args(
                setting,
                as_argv(spec.get("entrypoint")) + as_argv(spec.get("command")),
                as_dict(spec.get("environment")),
            )
        else:
            assert as_dict(spec.get("environment")).get(setting.env) == setting.example, (
                f"compose: {setting.env} does not reach {service}"
            )


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
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


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
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


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
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
