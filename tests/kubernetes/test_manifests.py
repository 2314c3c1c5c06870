"""The Kubernetes manifests (deploy/kubernetes): rendered by `kubectl kustomize`, every object
validated against Kubernetes' own schema, and the stack's properties checked on what renders.

The facts compose.yaml and the manifests share are checked by tests/compose's own checks, on a
compose-shaped view of the containers; the rest by tests/kubernetes/checks.py. Each check is then
broken once on purpose (MUTATIONS) and must fail.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from moe_l2_contracts.domains import EXTRA_DOMAINS_ENV
from moe_l2_contracts.services import SERVICES as MOE_L2_SERVICES
from moe_l2_domains.taxonomy import load_default_taxonomy
from tests.compose.checks import (
    check_cache_manager_env,
    check_domains,
    check_llama_command,
    check_predictor,
    run_llama_entrypoint,
)
from tests.compose.loading import COMPOSE, COMPOSE_CPU, DASHBOARDS, interpolate, load_compose_text, merge
from tests.kubernetes import checks
from tests.kubernetes.rendering import (
    RESTRICTED,
    TARGETS,
    Obj,
    compose_view,
    containers,
    duration_s,
    env,
    find,
    kubelet_expand,
    pod_spec,
    render,
)
from tests.test_env_convention import SETTINGS, env_names

# The oldest Kubernetes the manifests are for (HPA autoscaling/v2, fsGroupChangePolicy, the
# namespace name label all predate it), and the newest schema kubernetes-validate ships.
K8S_VERSIONS = ("1.32", kubernetes_validate.utils.latest_version())
# moe_l2_domains.known reads the extra domains itself, in every service that checks a domain tag.
READ_OUTSIDE_SETTINGS = {EXTRA_DOMAINS_ENV}
DASHBOARD = (DASHBOARDS / "moe-l2.json").read_text()


@functools.cache
def _rendered(target: str) -> tuple[Obj, ...]:
    return tuple(render(target))


def rendered(target: str) -> list[Obj]:
    return copy.deepcopy(list(_rendered(target)))


@functools.cache
def _compose(cpu: bool) -> dict[str, Any]:
    raw = load_compose_text(COMPOSE.read_text())
    return interpolate(merge(raw, load_compose_text(COMPOSE_CPU.read_text())) if cpu else raw)


def start_periods() -> dict[str, float]:
    """compose's healthcheck start period of each service, in seconds."""
    services = _compose(False)["services"]
    return {
        name: duration_s((service.get("healthcheck") or {}).get("start_period", "0s"))
        for name, service in services.items()
    }


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_object_validates(target: str, version: str) -> None:
    objects = rendered(target)
    assert objects
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o["spec"]["template"]["spec"]["containers"][0].update(restartPolcy="Always"),
        lambda o: o["spec"].update(replicas="one"),
        lambda o: o["spec"]["template"]["spec"]["containers"][0].pop("name"),
    ],
    ids=["unknown field", "wrong type", "required field missing"],
)
def test_validation_catches_mutations(mutate: Callable[[Obj], None]) -> None:
    proxy = find(rendered("gpu"), "Deployment", "proxy")
    kubernetes_validate.validate(proxy, K8S_VERSIONS[0], strict=True)
    mutate(proxy)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(proxy, K8S_VERSIONS[0], strict=True)


def test_gpu_overlay() -> None:
    objects = rendered("gpu")
    checks.check_gpu(objects)
    check_llama_command(compose_view(objects))  # the experts' budget auto, as compose's GPU stack


@pytest.mark.parametrize("target", ["base", "cpu"])
def test_cpu_has_no_gpu(target: str) -> None:
    checks.check_no_gpu(rendered(target))
    with pytest.raises(AssertionError):
        checks.check_gpu(rendered(target))


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_images_are_compose_s(target: str) -> None:
    """The overlays run the images compose.yaml builds (or pins), under the same names and tags."""
    compose = _compose(target == "cpu")["services"]
    for name, (container, _) in containers(rendered(target)).items():
        assert container["image"] == compose[name]["image"], name


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_the_facts_compose_checks(target: str) -> None:
    """The same wiring as compose: commands, URLs, domains; the cache-manager on its own pod's llama.
    The gateway's llama and cache-manager URLs differ (compose's name one of each; here every llama
    pod, each with its cache-manager): checks.check_gateway_replicas."""
    objects = rendered(target)
    view = compose_view(objects)
    check_predictor(view)
    check_domains(view)
    check_cache_manager_env(view["services"]["cache-manager"]["environment"], llama_url="http://localhost:11436")
    assert view["services"]["cache-manager"]["command"] == ["python", "-m", "moe_l2_cache"]


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_variable_is_read(target: str) -> None:
    """A misspelt or stale MOE_L2_* name would be ignored in silence: each is one the container's
    program reads: a Python service's settings, llama's entrypoint script (its image has no Python)."""
    for name, (container, _) in containers(rendered(target)).items():
        if name == "llama":
            read = set(re.findall(r"\$\{?(MOE_L2_\w+)", " ".join(container["command"])))
        elif name in SETTINGS:
            read = {n for names in env_names(SETTINGS[name]).values() for n in names} | READ_OUTSIDE_SETTINGS
        else:
            continue
        given = {e["name"] for e in container.get("env", []) if e["name"].startswith("MOE_L2_")}
        assert given and given <= read, f"{name}: {sorted(given - read)} are read by no setting"


@pytest.mark.parametrize(
    "check",
    [
        checks.check_llama_pod,
        checks.check_gateway_replicas,
        checks.check_admin_token,
        checks.check_network_policies,
        checks.check_services,
        checks.check_predictor_scales,
        checks.check_redis,
        checks.check_scraped,
        lambda objects: checks.check_probes_and_resources(objects, start_periods()),
        lambda objects: checks.check_dashboard(objects, DASHBOARD),
    ],
    ids=[
        "llama_pod",
        "gateway_replicas",
        "admin_token",
        "network_policies",
        "services",
        "predictor_scales",
        "redis",
        "scraped",
        "probes_and_resources",
        "dashboard",
    ],
)
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_property(target: str, check: Callable[[list[Obj]], None]) -> None:
    check(rendered(target))


@pytest.mark.parametrize("target", RESTRICTED)
def test_security(target: str) -> None:
    """Pod Security `restricted` (the RAM tier's overlay cannot be: test_ram_tier_overlay)."""
    checks.check_security(rendered(target))


def test_ram_tier_overlay() -> None:
    objects = rendered("ram-tier")
    checks.check_ram_tier(objects)
    for target in RESTRICTED:
        with pytest.raises(AssertionError):
            checks.check_ram_tier(rendered(target))
    # one thing at a time undone, the check fails
    for undo in (
        lambda o: pod_spec(find(o, "StatefulSet", "llama")).pop("shareProcessNamespace"),
        lambda o: _container(o, "cache-manager")["securityContext"]["capabilities"].update(add=["IPC_LOCK"]),
        lambda o: _container(o, "cache-manager")["securityContext"].update(runAsUser=10001, runAsNonRoot=True),
        lambda o: _container(o, "llama")["securityContext"]["capabilities"].update(add=["SYS_PTRACE"]),
        lambda o: _container(o, "cache-manager").update(
            env=[e for e in _container(o, "cache-manager")["env"] if e["name"] != "MOE_L2_RAM_BUDGET"]
        ),
    ):
        broken = rendered("ram-tier")
        undo(broken)
        with pytest.raises(AssertionError):
            checks.check_ram_tier(broken)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="unshare --pid needs root")
def test_the_base_refuses_a_ram_budget_in_one_line() -> None:
    """The cache-manager's shell as the kubelet hands it over: in its own PID namespace (the base) it
    refuses MOE_L2_RAM_BUDGET; in the pod's shared one (the overlay; PID 1 is the pause process) it runs."""
    for target, own_namespace, expected in (("base", True, 1), ("ram-tier", False, 0), ("cpu", True, 0)):
        cache, _ = containers(rendered(target))["cache-manager"]
        variables = env(cache)
        if target == "base":
            variables["MOE_L2_RAM_BUDGET"] = "6GiB"  # what a user's own patch of the base would add
        argv = [kubelet_expand(a, variables) for a in cache["command"]] + ["env"]
        if own_namespace:
            argv = ["unshare", "--pid", "--fork", "--mount-proc", *argv]
        done = subprocess.run(argv, env={"PATH": "/usr/bin:/bin", **variables}, capture_output=True, text=True)
        assert done.returncode == expected, (target, done.stderr)
        if expected:
            assert done.stderr.strip().splitlines() == [
                "MOE_L2_RAM_BUDGET needs llama's PID namespace: use the overlay overlays/ram-tier (docs/kubernetes.md)"
            ]
        else:
            budget = [line for line in done.stdout.splitlines() if line.startswith("MOE_L2_RAM_BUDGET=")]
            assert budget == (["MOE_L2_RAM_BUDGET=24GiB"] if target == "ram-tier" else []), budget


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_llama_replicas(target: str) -> None:
    assert find(rendered(target), "StatefulSet", "llama")["spec"]["replicas"] == checks.LLAMA_REPLICAS[target]


def test_llama_entrypoint_reads_the_token(tmp_path: Path) -> None:
    """llama's shell entrypoint as the kubelet hands it to sh: the token from the Secret's file,
    the taxonomy's domains from the image with the extra ones appended, llama-server's arguments intact."""
    if not shutil.which("sh"):
        pytest.skip("no sh")
    container, _ = containers(rendered("gpu"))["llama"]
    variables = env(container)
    llama = {
        "entrypoint": [kubelet_expand(a, variables) for a in container["command"]],
        "command": [kubelet_expand(a, variables) for a in container["args"]],
        "environment": {**variables, "MOE_L2_EXTRA_DOMAINS": "legal"},
    }
    token_file = tmp_path / "admin-token"
    token_file.write_text("from-the-secret")  # `kubectl create secret --from-literal` adds no newline
    result = run_llama_entrypoint(llama, tmp_path, {"MOE_L2_ADMIN_TOKEN_FILE": str(token_file)})
    assert result.returncode == 0, result.stderr
    out = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert out["token"] == "from-the-secret"
    assert out["domains"] == ",".join(sorted(load_default_taxonomy().names)) + ",legal", "not the taxonomy's"
    assert out["args"] == " ".join(container["args"])
    missing = run_llama_entrypoint(llama, tmp_path, {"MOE_L2_ADMIN_TOKEN_FILE": str(tmp_path / "nope")})
    assert missing.returncode != 0 and "token=" not in missing.stdout, "llama-server started without a token"


def test_kubelet_expansion() -> None:
    assert kubelet_expand("$$(cat f) $(A) $(B) $A ${A} $$", {"A": "1"}) == "$(cat f) 1 $(B) $A ${A} $"


def test_moe_l2_services_are_all_there() -> None:
    assert set(MOE_L2_SERVICES) <= set(containers(rendered("gpu")))


# ---------------------------------------------------------------- each check can fail


def _container(objects: list[Obj], name: str) -> Obj:
    return containers(objects)[name][0]


def _env_set(objects: list[Obj], container: str, name: str, value: str) -> None:
    for item in _container(objects, container)["env"]:
        if item["name"] == name:
            item["value"] = value


def _policy(objects: list[Obj], name: str) -> Obj:
    return find(objects, "NetworkPolicy", name)


_OPEN_LLAMA = {
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": "open"},
    "spec": {"podSelector": {"matchLabels": {checks.NAME: "llama"}}, "ingress": [{"ports": [{"port": 11436}]}]},
}
_Mutation = Callable[[list[Obj]], Any]
MUTATIONS: dict[str, tuple[_Mutation, Callable[[list[Obj]], None]]] = {
    "llama without a GPU": (lambda o: _container(o, "llama")["resources"]["limits"].pop(checks.GPU), checks.check_gpu),
    "cache-manager takes a GPU": (
        lambda o: _container(o, "cache-manager")["resources"]["limits"].update({checks.GPU: 1}),
        checks.check_gpu,
    ),
    "CPU image on a GPU": (lambda o: _container(o, "llama").update(image="moe-l2-llama:local-cpu"), checks.check_gpu),
    "GPU taint not tolerated": (
        lambda o: pod_spec(find(o, "StatefulSet", "llama")).pop("tolerations"),
        checks.check_gpu,
    ),
    "no llama replica": (
        lambda o: find(o, "StatefulSet", "llama")["spec"].update(replicas=0),
        checks.check_llama_pod,
    ),
    "the gateway dials one replica": (
        lambda o: _env_set(o, "proxy", "MOE_L2_LLAMA_URLS", "http://llama-0.llama:11436"),
        checks.check_gateway_replicas,
    ),
    "hints to any cache-manager": (
        lambda o: _env_set(o, "proxy", "MOE_L2_CACHE_URLS", "http://cache-manager:11438"),
        checks.check_gateway_replicas,
    ),
    "round robin": (
        lambda o: _env_set(o, "proxy", "MOE_L2_PROXY_ROUTING", "round_robin"),
        checks.check_gateway_replicas,
    ),
    "a stale single llama URL": (
        lambda o: _container(o, "proxy")["env"].append({"name": "MOE_L2_LLAMA_URL", "value": "http://llama:11436"}),
        checks.check_gateway_replicas,
    ),
    "hot set of the last domain": (
        lambda o: _env_set(o, "cache-manager", "MOE_L2_CACHE_HOT_SET_SCOPE", "domain"),
        checks.check_gateway_replicas,
    ),
    "llama behind a cluster IP": (
        lambda o: find(o, "Service", "llama")["spec"].pop("clusterIP"),
        checks.check_gateway_replicas,
    ),
    "the gateway kept from the cache-managers": (
        lambda o: _policy(o, "llama")["spec"]["ingress"][0].update(ports=[{"port": 11436}]),
        checks.check_gateway_replicas,
    ),
    "models writable": (
        lambda o: _container(o, "cache-manager")["volumeMounts"][0].update(readOnly=False),
        checks.check_llama_pod,
    ),
    "another model": (
        lambda o: _env_set(o, "cache-manager", "MOE_L2_MODEL_PATH", "/models/other.gguf"),
        checks.check_llama_pod,
    ),
    "pool beyond the memory limit": (
        lambda o: _env_set(o, "cache-manager", "MOE_L2_CACHE_POOL_BYTES", str(32 << 30)),
        checks.check_llama_pod,
    ),
    "no readiness probe": (
        lambda o: _container(o, "predictor").pop("readinessProbe"),
        lambda o: checks.check_probes_and_resources(o, start_periods()),
    ),
    "probe on the wrong path": (
        lambda o: _container(o, "proxy")["livenessProbe"]["httpGet"].update(path="/health"),
        lambda o: checks.check_probes_and_resources(o, start_periods()),
    ),
    "llama killed while loading": (
        lambda o: _container(o, "llama")["startupProbe"].update(failureThreshold=10),
        lambda o: checks.check_probes_and_resources(o, start_periods()),
    ),
    "no memory limit": (
        lambda o: _container(o, "redis")["resources"].pop("limits"),
        lambda o: checks.check_probes_and_resources(o, start_periods()),
    ),
    "IPC_LOCK added": (
        lambda o: _container(o, "cache-manager")["securityContext"]["capabilities"].update(add=["IPC_LOCK"]),
        checks.check_security,
    ),
    "writable root": (
        lambda o: _container(o, "proxy")["securityContext"].update(readOnlyRootFilesystem=False),
        checks.check_security,
    ),
    "host IPC": (lambda o: pod_spec(find(o, "StatefulSet", "llama")).update(hostIPC=True), checks.check_security),
    "a committed Secret": (
        lambda o: o.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": checks.SECRET}}),
        checks.check_admin_token,
    ),
    "llama without the token file": (
        lambda o: _container(o, "llama")["env"].remove(
            {"name": "MOE_L2_ADMIN_TOKEN_FILE", "value": "/run/moe-l2/admin-token"}
        ),
        checks.check_admin_token,
    ),
    "token mounted writable": (
        lambda o: [
            m.update(readOnly=False)
            for m in _container(o, "cache-manager")["volumeMounts"]
            if m["name"] == "admin-token"
        ],
        checks.check_admin_token,
    ),
    "optional API keys": (
        lambda o: [
            e["valueFrom"]["secretKeyRef"].update(optional=True)
            for e in _container(o, "proxy")["env"]
            if e["name"] == "MOE_L2_PROXY_API_KEYS"
        ],
        checks.check_admin_token,
    ),
    "llama open to all": (lambda o: o.append(copy.deepcopy(_OPEN_LLAMA)), checks.check_network_policies),
    "redis admits the gateway": (
        lambda o: _policy(o, "redis")["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"].update(
            {checks.NAME: "proxy"}
        ),
        checks.check_network_policies,
    ),
    "predictor from every namespace": (
        lambda o: _policy(o, "predictor")["spec"]["ingress"][0]["from"][1].update(namespaceSelector={}),
        checks.check_network_policies,
    ),
    "no default deny": (lambda o: o.remove(_policy(o, "default-deny-ingress")), checks.check_network_policies),
    "a LoadBalancer": (
        lambda o: find(o, "Service", "cache-manager")["spec"].update(type="LoadBalancer"),
        checks.check_network_policies,
    ),
    "predictor behind a cluster IP": (
        lambda o: find(o, "Service", "predictor")["spec"].pop("clusterIP"),
        checks.check_services,
    ),
    "Service to a missing port": (
        lambda o: find(o, "Service", "cache-manager")["spec"]["ports"][0].update(targetPort="metrics"),
        checks.check_services,
    ),
    "predictor replicas set": (
        lambda o: find(o, "Deployment", "predictor")["spec"].update(replicas=3),
        checks.check_predictor_scales,
    ),
    "redis without AOF": (
        lambda o: _container(o, "redis").update(args=["redis-server", "--appendonly", "no", "--appendfsync", "always"]),
        checks.check_redis,
    ),
    "redis data not persistent": (
        lambda o: find(o, "StatefulSet", "redis")["spec"].pop("volumeClaimTemplates"),
        checks.check_redis,
    ),
    "llama not scraped": (
        lambda o: find(o, "StatefulSet", "llama")["spec"]["template"]["metadata"]["annotations"].pop(
            "prometheus.io/scrape"
        ),
        checks.check_scraped,
    ),
    "dashboard drifted": (
        lambda o: [c["data"].update({"moe-l2.json": "{}"}) for c in o if c["kind"] == "ConfigMap"],
        lambda o: checks.check_dashboard(o, DASHBOARD),
    ),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_checks_catch_mutations(mutation: str) -> None:
    mutate, check = MUTATIONS[mutation]
    objects = rendered("gpu")
    check(objects)  # passes on the real manifests
    mutate(objects)
    with pytest.raises(AssertionError):
        check(objects)
