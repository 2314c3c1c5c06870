"""Each check can fail: one property broken at a time, the matching check must raise."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest

from moe_l2_domains.taxonomy import load_default_taxonomy
from tests.compose.checks import (
    PORTS,
    check_admin_token,
    check_cache_manager,
    check_depends_on,
    check_domains,
    check_grafana_login,
    check_healthchecks,
    check_images,
    check_llama_command,
    check_llama_cpu,
    check_llama_gpu,
    check_models_mount,
    check_ports,
    check_predictor,
    check_proxy,
    check_proxy_exposure,
    check_redis,
    check_schema,
    check_services,
    check_variables,
)
from tests.compose.dockerfiles import check_dockerfile
from tests.compose.loading import ROOT, interpolate, merge
from tests.compose.monitoring import check_grafana, check_prometheus, check_replica_rows, gateway_metric_names

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
_TAXONOMY_NAMES = sorted(load_default_taxonomy().names)


def _without_domains_line(doc: dict[str, Any]) -> None:
    """llama's entrypoint as it was: the domains from a variable compose would have to set."""
    script = doc["services"]["llama"]["entrypoint"]
    script[2] = script[2].replace("$(moe-l2-domains)", "$LLAMA_ARG_MOE_DOMAINS")


_Check = Callable[[dict[str, Any]], None]
COMPOSE_MUTATIONS: dict[str, tuple[_Check, _Check]] = {
    "version key": (_edit("version", value="3.9"), check_services),
    "service removed": (_edit("services", "grafana"), check_services),
    "no GPU reservation": (_edit("services", "llama", "deploy"), check_llama_gpu),
    "GPU without gpu capability": (_edit("services", "llama", *_GPU, value=["compute"]), check_llama_gpu),
    "no --metrics": (_edit("services", "llama", "command", without="--metrics"), check_llama_command),
    "no telemetry": (_edit("services", "llama", "environment", "LLAMA_ARG_MOE_TELEMETRY"), check_llama_command),
    "ipc host back": (_edit("services", "cache-manager", "ipc", value="host"), check_cache_manager),
    "llama's PID namespace in the base": (
        _edit("services", "cache-manager", "pid", value="service:llama"),
        check_cache_manager,
    ),
    "no RAM-budget guard": (_edit("services", "cache-manager", "entrypoint"), check_cache_manager),
    "proxy without API keys": (_edit("services", "proxy", "environment", "MOE_L2_PROXY_API_KEYS"), check_proxy),
    "proxy published wide while told loopback": (
        _edit("services", "proxy", "ports", value=["0.0.0.0:11435:11435"]),
        check_proxy,
    ),
    "proxy not told where it is published": (
        _edit("services", "proxy", "environment", "MOE_L2_PROXY_EXPOSED_HOST"),
        lambda doc: check_proxy_exposure(doc["services"]["proxy"]),
    ),
    "proxy open by default": (_edit("services", "proxy", "environment", "MOE_L2_ALLOW_OPEN", value="1"), check_proxy),
    "grafana admin/admin": (
        _edit("services", "grafana", "environment", "GF_SECURITY_ADMIN_PASSWORD", value="admin"),
        check_grafana_login,
    ),
    "grafana anonymous": (
        _edit("services", "grafana", "environment", "GF_AUTH_ANONYMOUS_ENABLED", value="true"),
        check_grafana_login,
    ),
    "grafana starts before its password": (
        _edit("services", "grafana", "depends_on", "admin-token"),
        check_grafana_login,
    ),
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
    "proxy pairs cache-managers by position": (
        _edit("services", "proxy", "environment", "MOE_L2_PROXY_CACHE_PAIRING"),
        check_proxy,
    ),
    "cache-managers that claim no llama": (
        _edit("services", "cache-manager", "environment", "MOE_L2_CACHE_CLAIM_LLAMA"),
        check_proxy,
    ),
    "llama container_name": (_edit("services", "llama", "container_name", value="llama"), check_proxy),
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
    "cache-manager starts before the token exists": (
        _edit("services", "cache-manager", "depends_on", "admin-token"),
        check_admin_token,
    ),
    "the published gateway gets the token": (
        _edit("services", "proxy", "volumes", value=["admin-token:/run/moe-l2:ro"]),
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
    "llama given a copy of the domains": (
        _edit("services", "llama", "environment", "LLAMA_ARG_MOE_DOMAINS", value=",".join(_TAXONOMY_NAMES)),
        check_domains,
    ),
    "llama's entrypoint without the taxonomy's domains": (_without_domains_line, check_domains),
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
    for job in ("predictor", "llama"):
        broken = copy.deepcopy(prometheus_config)
        next(j for j in broken["scrape_configs"] if j["job_name"] == job)["dns_sd_configs"][0]["port"] = 80
        with pytest.raises(AssertionError):
            check_prometheus(broken, doc)
    broken = copy.deepcopy(prometheus_config)
    llama = next(j for j in broken["scrape_configs"] if j["job_name"] == "llama")
    llama["static_configs"] = [{"targets": ["llama:11436"]}]
    llama.pop("dns_sd_configs")
    with pytest.raises(AssertionError):
        check_prometheus(broken, doc)  # one target: `--scale llama=N` would scrape whichever DNS answers

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


def _replica_panel(dashboard: dict[str, Any], title_start: str) -> dict[str, Any]:
    return next(p for p in dashboard["panels"] if p.get("title", "").startswith(title_start))


def _set_expr(panel: dict[str, Any], old: str, new: str) -> None:
    target = next(t for t in panel["targets"] if old in t["expr"])
    target["expr"] = target["expr"].replace(old, new)


REPLICA_MUTATIONS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "a replica panel shows every replica's hits": lambda d: _set_expr(
        _replica_panel(d, "Expert hot-set hit rate on"), '{instance="$replica"}', ""
    ),
    "llama's series filtered by the gateway's label": lambda d: _set_expr(
        _replica_panel(d, "Decode tokens/s on"), 'instance="$replica"', 'replica="$replica"'
    ),
    "the gateway's series filtered by instance": lambda d: _set_expr(
        _replica_panel(d, "Domain mix routed to"), 'replica="$replica"', 'instance="$replica"'
    ),
    "a series the gateway does not export": lambda d: _set_expr(
        _replica_panel(d, "Routing decisions"), "moe_l2_routing_decisions_total", "moe_l2_routing_choices_total"
    ),
    "an undefined variable": lambda d: _set_expr(
        _replica_panel(d, "In flight on"), 'replica="$replica"', 'replica="$llama"'
    ),
    "the row repeats over nothing": lambda d: next(p for p in d["panels"] if p.get("repeat")).update(repeat="llama"),
    "the variable lists llama's instances": lambda d: d["templating"]["list"][0].update(
        query={"query": "label_values(llamacpp:tokens_predicted_total, instance)"}
    ),
    "one replica only": lambda d: d["templating"]["list"][0].update(multi=False, includeAll=False),
}


@pytest.mark.parametrize("mutation", sorted(REPLICA_MUTATIONS))
def test_replica_row_checks_catch_mutations(mutation: str, grafana_files: tuple[dict[str, Any], ...]) -> None:
    dashboard = copy.deepcopy(grafana_files[2])
    names = gateway_metric_names()
    check_replica_rows(dashboard, names)
    REPLICA_MUTATIONS[mutation](dashboard)
    with pytest.raises(AssertionError):
        check_replica_rows(dashboard, names)
