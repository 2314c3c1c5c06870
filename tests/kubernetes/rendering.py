"""The Kubernetes manifests as `kubectl kustomize` renders them, and ways to read the objects."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from tests.compose.loading import ROOT

KUSTOMIZE = ROOT / "deploy" / "kubernetes"
TARGETS = {
    "base": KUSTOMIZE / "base",
    "cpu": KUSTOMIZE / "overlays" / "cpu",
    "gpu": KUSTOMIZE / "overlays" / "gpu",
    "ram-tier": KUSTOMIZE / "overlays" / "ram-tier",
}
# The targets Pod Security `restricted` admits; the RAM tier's cannot be (docs/kubernetes.md).
RESTRICTED = ("base", "cpu", "gpu")
WORKLOADS = ("Deployment", "StatefulSet")

Obj = dict[str, Any]


def kubectl() -> str:
    """kubectl (its built-in Kustomize renders the manifests); CI has it, so there its absence fails."""
    found = shutil.which("kubectl")
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("kubectl is not installed: the Kubernetes manifests cannot be rendered")
    pytest.skip("kubectl is not installed: the Kubernetes manifests cannot be rendered (CI has it)")


def render(target: str) -> list[Obj]:
    result = subprocess.run([kubectl(), "kustomize", str(TARGETS[target])], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def find(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def workloads(objects: list[Obj]) -> list[Obj]:
    return [o for o in objects if o["kind"] in WORKLOADS]


def pod_spec(workload: Obj) -> Obj:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: Obj) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def containers(objects: list[Obj]) -> dict[str, tuple[Obj, Obj]]:
    """Every container by name (names are unique in the stack), with the workload that runs it."""
    out: dict[str, tuple[Obj, Obj]] = {}
    for workload in workloads(objects):
        for container in pod_spec(workload)["containers"]:
            assert container["name"] not in out, f"two containers named {container['name']}"
            out[container["name"]] = (container, workload)
    return out


def env(container: Obj) -> dict[str, str]:
    """The plain values of a container's environment (those from a Secret are left out)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def port_number(container: Obj, port: int | str) -> int:
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    return int(number)


def compose_view(objects: list[Obj]) -> dict[str, Any]:
    """The stack's containers as compose services (Kubernetes' command is Docker's entrypoint, its
    args Docker's command, both as the kubelet expands them, as an interpolated compose file's `$$` is
    `$`), so that tests/compose's checks of the same facts run on them."""
    services = {}
    for name, (container, _) in containers(objects).items():
        variables = env(container)
        service: dict[str, Any] = {"image": container["image"], "environment": variables}
        if "command" in container:
            service["entrypoint"] = [kubelet_expand(a, variables) for a in container["command"]]
        if "args" in container:
            service["command"] = [kubelet_expand(a, variables) for a in container["args"]]
        services[name] = service
    return {"services": services}


_REFERENCE = re.compile(r"\$(\$|\(([^)]*)\))")


def kubelet_expand(text: str, variables: dict[str, str]) -> str:
    """What the kubelet does to a command or argument: `$(NAME)` of a variable of the container
    becomes its value, `$$` becomes `$`, anything else stays."""

    def repl(m: re.Match[str]) -> str:
        if m.group(1) == "$":
            return "$"
        return variables.get(m.group(2), m.group(0))

    return _REFERENCE.sub(repl, text)


def duration_s(text: str) -> float:
    """A compose duration: 30s, 20m, 1m30s."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"bad duration {text!r}"
    return sum(float(n) * units[u] for n, u in parts)
