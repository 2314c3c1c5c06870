"""The Kubernetes manifests' properties, one check each: plain functions that raise AssertionError
(test_manifests.py breaks each property and asserts that its check fails)."""

from __future__ import annotations

from typing import Any

from moe_l2_contracts.services import SERVICES as MOE_L2_SERVICES
from tests.compose.checks import SERVICE_UID, TOKEN_FILE, TOKEN_HOLDERS
from tests.compose.shapes import flag_value
from tests.kubernetes.rendering import Obj, containers, env, find, pod_labels, pod_spec, port_number, workloads

NAME = "app.kubernetes.io/name"
SECRET = "moe-l2-tokens"
GPU = "nvidia.com/gpu"
# Prometheus's namespace, the one other namespace allowed in (on the metrics ports)
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
# who may open a connection to whom (pod labels); the gateway alone admits anyone
CLIENTS = {"predictor": {"proxy"}, "llama": {"proxy"}, "redis": {"llama"}}
EXPOSED = {"proxy"}
# the moe-l2 containers that export /metrics (Redis has no exporter)
SCRAPED = set(MOE_L2_SERVICES)
# Those that read the admin token (the same as compose's holders).
TOKEN_READERS = TOKEN_HOLDERS
# llama replicas per target: the gpu overlay runs two for the gateway's expert-affinity routing
# (deploy/kubernetes/overlays/gpu/llama-gpu.yaml says why); the base and the CPU overlay one.
LLAMA_REPLICAS = {"base": 1, "cpu": 1, "gpu": 2, "ram-tier": 1}


def check_no_gpu(objects: list[Obj]) -> None:
    for name, (container, _) in containers(objects).items():
        resources = container.get("resources", {})
        assert GPU not in resources.get("limits", {}) and GPU not in resources.get("requests", {}), name
    llama, _ = containers(objects)["llama"]
    assert llama["image"].endswith("-cpu"), f"not the CPU image: {llama['image']}"
    assert env(llama).get("LLAMA_ARG_MOE_CACHE_BYTES") == "0", "a CPU build refuses to start with the expert cache"


def check_gpu(objects: list[Obj]) -> None:
    all_containers = containers(objects)
    llama, workload = all_containers["llama"]
    assert int(llama.get("resources", {}).get("limits", {}).get(GPU, 0)) >= 1, "llama gets no GPU"
    assert llama["image"].endswith("-cuda"), f"not the CUDA image: {llama['image']}"
    others = [n for n, (c, _) in all_containers.items() if n != "llama" and GPU in str(c.get("resources"))]
    assert not others, f"only llama-server holds the GPU: {others}"
    tolerated = {t.get("key") for t in pod_spec(workload).get("tolerations", [])}
    assert GPU in tolerated, "GPU nodes' nvidia.com/gpu taint is not tolerated"


def check_llama_pod(objects: list[Obj]) -> None:
    """llama-server and its cache-manager: one pod per replica, the cache-manager on its own
    llama-server and the same model file, read-only."""
    llama_set = find(objects, "StatefulSet", "llama")
    replicas = llama_set["spec"].get("replicas", 1)
    assert isinstance(replicas, int) and replicas >= 1, f"llama replicas: {replicas!r}"
    names = [c["name"] for c in pod_spec(llama_set)["containers"]]
    assert sorted(names) == ["cache-manager", "llama"], names
    headless = find(objects, "Service", llama_set["spec"]["serviceName"])
    assert headless["spec"].get("clusterIP") == "None", "a StatefulSet's governing Service is headless"
    llama, _ = containers(objects)["llama"]
    cache, _ = containers(objects)["cache-manager"]
    model = flag_value(llama["args"], "-m", "--model")
    assert env(cache).get("MOE_L2_MODEL_PATH") == model, "llama and the cache-manager see different models"
    volumes = {v["name"]: v for v in pod_spec(llama_set)["volumes"]}
    mounted = []
    for container in (llama, cache):
        found = [m for m in container.get("volumeMounts", []) if model.startswith(m["mountPath"].rstrip("/") + "/")]
        assert found, f"{container['name']}: the model {model} is on no mount"
        assert found[0].get("readOnly"), f"{container['name']} mounts the models writable"
        mounted.append((found[0]["name"], found[0]["mountPath"]))
    assert mounted[0] == mounted[1], f"the model is mounted differently: {mounted}"
    claim = volumes[mounted[0][0]].get("persistentVolumeClaim")
    assert claim and claim.get("readOnly"), "the model volume is a read-only PersistentVolumeClaim"
    find(objects, "PersistentVolumeClaim", claim["claimName"])
    pool = int(env(cache)["MOE_L2_CACHE_POOL_BYTES"])
    assert _bytes(cache["resources"]["limits"]["memory"]) > pool, "the locked pool does not fit the memory limit"


def check_probes_and_resources(objects: list[Obj], start_periods: dict[str, float]) -> None:
    """Each container: startup, readiness and liveness probes on its health path, a startup budget
    no shorter than compose's start period, CPU and memory requests, a memory limit."""
    for name, (container, _) in containers(objects).items():
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            assert probe, f"{name}: no {kind}"
            if name in MOE_L2_SERVICES:
                get = probe.get("httpGet") or {}
                assert get.get("path") == MOE_L2_SERVICES[name].health_path, f"{name}: {kind} path"
                assert port_number(container, get.get("port", 0)) == MOE_L2_SERVICES[name].port, f"{name}: {kind} port"
            else:
                assert probe.get("exec", {}).get("command") == ["redis-cli", "ping"], f"{name}: {kind}"
        startup = container["startupProbe"]
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        assert budget >= start_periods[name], f"{name}: {budget} s to start, compose gives {start_periods[name]} s"
        resources = container.get("resources", {})
        assert {"cpu", "memory"} <= set(resources.get("requests", {})), f"{name}: no requests"
        assert "memory" in resources.get("limits", {}), f"{name}: no memory limit"


def check_security(objects: list[Obj]) -> None:
    """Pod Security `restricted`, which the namespace enforces, and the images' users."""
    [namespace] = [o for o in objects if o["kind"] == "Namespace"]
    assert namespace["metadata"]["labels"].get("pod-security.kubernetes.io/enforce") == "restricted"
    for workload in workloads(objects):
        spec = pod_spec(workload)
        context = spec.get("securityContext", {})
        assert context.get("runAsNonRoot") is True, workload["metadata"]["name"]
        assert context.get("seccompProfile", {}).get("type") == "RuntimeDefault", workload["metadata"]["name"]
        assert not any(spec.get(k) for k in ("hostIPC", "hostPID", "hostNetwork")), (
            f"{workload['metadata']['name']}: a host namespace"
        )
        assert spec.get("automountServiceAccountToken") is False, "no service talks to the Kubernetes API"
        for container in spec["containers"]:
            name = container["name"]
            sc = container.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, f"{name}: privilege escalation allowed"
            assert sc.get("readOnlyRootFilesystem") is True, f"{name}: writable root filesystem"
            caps = sc.get("capabilities", {})
            assert caps.get("drop") == ["ALL"] and not caps.get("add"), f"{name}: capabilities {caps}"
            if name in MOE_L2_SERVICES:
                assert context.get("runAsUser") == SERVICE_UID, f"{name}: not the images' uid {SERVICE_UID}"


def check_ram_tier(objects: list[Obj]) -> None:
    """overlays/ram-tier: what docs/ram-tier.md says the tier needs in a pod, and nothing more: one PID
    namespace for the llama pod, the cache-manager root with the three capabilities, llama reading ahead;
    every other container as `restricted` as in the base."""
    [namespace] = [o for o in objects if o["kind"] == "Namespace"]
    labels = namespace["metadata"]["labels"]
    assert labels.get("pod-security.kubernetes.io/enforce") == "privileged", "added capabilities need privileged"
    llama_set = find(objects, "StatefulSet", "llama")
    assert pod_spec(llama_set).get("shareProcessNamespace") is True, "the cache-manager cannot see llama-server"
    assert llama_set["spec"]["replicas"] == 1, "one tier per model file on a node"
    [term] = pod_spec(llama_set)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname", "more replicas must each take a node of their own"
    assert term["labelSelector"]["matchLabels"] == llama_set["spec"]["template"]["metadata"]["labels"]
    cache, _ = containers(objects)["cache-manager"]
    sc = cache["securityContext"]
    assert sc.get("runAsUser") == 0 and sc.get("runAsNonRoot") is False, "added capabilities reach no non-root process"
    assert set(sc["capabilities"].get("add", [])) == {"IPC_LOCK", "SYS_NICE", "SYS_PTRACE"}
    assert sc["capabilities"].get("drop") == ["ALL"] and sc.get("allowPrivilegeEscalation") is False
    assert env(cache).get("MOE_L2_RAM_BUDGET"), "the overlay without a budget"
    llama, _ = containers(objects)["llama"]
    assert env(llama).get("LLAMA_ARG_MOE_WILLNEED") == "1"
    for name, (container, workload) in containers(objects).items():
        if name == "cache-manager":
            continue
        csc = container.get("securityContext", {})
        assert not csc.get("capabilities", {}).get("add"), f"{name}: capabilities beyond the base"
        assert pod_spec(workload).get("securityContext", {}).get("runAsNonRoot") is True, name
        if workload["metadata"]["name"] != "llama":
            assert not pod_spec(workload).get("shareProcessNamespace"), f"{name}: a shared PID namespace"


def check_admin_token(objects: list[Obj]) -> None:
    """The token holders read it from the Secret as compose's file; nothing else mounts it, and
    no Secret is rendered (none can be committed)."""
    assert not [o for o in objects if o["kind"] == "Secret"], "a token is committed in the manifests"
    token_dir, token_name = TOKEN_FILE.rsplit("/", 1)
    all_containers = containers(objects)
    for name, (container, workload) in all_containers.items():
        volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
        secret_mounts = [m for m in container.get("volumeMounts", []) if "secret" in volumes.get(m["name"], {})]
        if name not in TOKEN_READERS:
            assert not secret_mounts, f"{name} needs no token"
            continue
        [mount] = [m for m in secret_mounts if m["mountPath"] == token_dir] or [None]
        assert mount, f"{name} does not mount the token"
        assert mount.get("readOnly"), f"{name} mounts the token writable"
        secret = volumes[mount["name"]]["secret"]
        assert secret["secretName"] == SECRET
        assert {"key": "admin-token", "path": token_name} in secret.get("items", []), f"{name}: token file"
        assert env(container).get("MOE_L2_ADMIN_TOKEN_FILE") == TOKEN_FILE, f"{name} does not read the token file"
    proxy, _ = all_containers["proxy"]
    [keys] = [e for e in proxy.get("env", []) if e["name"] == "MOE_L2_PROXY_API_KEYS"] or [None]
    assert keys, "the gateway, reachable from outside, has no API keys"
    ref = keys.get("valueFrom", {}).get("secretKeyRef", {})
    assert (ref.get("name"), ref.get("key"), ref.get("optional", False)) == (SECRET, "api-keys", False), (
        f"the gateway's API keys must come from {SECRET}/api-keys, not optional: {ref}"
    )


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert not selector.get("matchExpressions"), "only matchLabels selectors are checked here"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def ingress(objects: list[Obj], labels: dict[str, str]) -> tuple[bool, set[str], set[int], set[int]]:
    """What NetworkPolicy lets into a pod: (any source?, client pods' names in the namespace,
    their ports, the monitoring namespace's ports). Unrestricted when no policy selects the pod."""
    policies = [
        p
        for p in objects
        if p["kind"] == "NetworkPolicy"
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and _selects(p["spec"]["podSelector"], labels)
    ]
    if not policies:
        return True, set(), set(), set()
    anyone, clients, client_ports, monitoring_ports = False, set(), set(), set()
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = {int(p["port"]) for p in rule.get("ports", [])}
            peers = rule.get("from")
            if not peers:
                anyone = True
                continue
            for peer in peers:
                if "ipBlock" in peer:
                    anyone = True
                elif "namespaceSelector" in peer:
                    namespaces = peer["namespaceSelector"]
                    assert "podSelector" not in peer, "a monitoring peer is a whole namespace"
                    if namespaces.get("matchLabels") != MONITORING:
                        anyone = True
                    monitoring_ports |= ports
                else:
                    clients.add(peer["podSelector"].get("matchLabels", {}).get(NAME, "*"))
                    client_ports |= ports
    return anyone, clients, client_ports, monitoring_ports


def check_network_policies(objects: list[Obj]) -> None:
    """Default deny; the gateway open to all; every other pod to its clients and Prometheus only."""
    assert any(
        p["kind"] == "NetworkPolicy" and p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")
        for p in objects
    ), "no default-deny ingress policy"
    for workload in workloads(objects):
        labels = pod_labels(workload)
        name = labels[NAME]
        ports = {int(p["containerPort"]) for c in pod_spec(workload)["containers"] for p in c.get("ports", [])}
        anyone, clients, client_ports, monitoring_ports = ingress(objects, labels)
        if name in EXPOSED:
            assert anyone, f"{name} is not reachable from outside the namespace"
            continue
        assert not anyone, f"{name} is reachable from outside the namespace"
        assert clients == CLIENTS.get(name, set()), f"{name} admits {clients}, not {CLIENTS.get(name)}"
        assert client_ports <= ports and monitoring_ports <= ports, f"{name}: a policy names a port it lacks"
    for service in (o for o in objects if o["kind"] == "Service"):
        kind = service["spec"].get("type", "ClusterIP")
        assert kind == "ClusterIP", f"Service {service['metadata']['name']} is a {kind}"


def admits(objects: list[Obj], labels: dict[str, str], client: str, port: int) -> bool:
    """Whether NetworkPolicy lets pods named `client` (app.kubernetes.io/name) open `port` on the
    pods labelled `labels`: some ingress rule of a policy selecting them names both."""
    for policy in objects:
        if policy["kind"] != "NetworkPolicy" or not _selects(policy["spec"]["podSelector"], labels):
            continue
        for rule in policy["spec"].get("ingress", []):
            ports = {int(p["port"]) for p in rule.get("ports", [])}
            peers = rule.get("from")
            from_client = not peers or any(
                "podSelector" in peer
                and "namespaceSelector" not in peer
                and _selects(peer["podSelector"], {NAME: client})
                for peer in peers
            )
            if from_client and (not ports or port in ports):
                return True
    return False


def check_gateway_replicas(objects: list[Obj]) -> None:
    """Issue 16's scale-out: the gateway routes over every llama pod (the headless Service's name,
    which it expands to each ready pod's address) with expert affinity, sends each replica's hints
    to the cache-manager in that pod ({host}: the pod's address), and may reach both ports; each
    cache-manager keeps the hot set of the domains its replica serves."""
    llama_set = find(objects, "StatefulSet", "llama")
    headless = find(objects, "Service", llama_set["spec"]["serviceName"])
    assert headless["spec"].get("clusterIP") == "None", "the gateway needs every pod's address: a headless Service"
    llama, _ = containers(objects)["llama"]
    cache, _ = containers(objects)["cache-manager"]
    proxy, _ = containers(objects)["proxy"]
    llama_port = port_number(llama, "llama")
    cache_port = port_number(cache, "cache-manager")
    [service_port] = headless["spec"]["ports"]
    assert service_port["port"] == llama_port, "a headless Service's name resolves to pods: use their port"
    variables = env(proxy)
    assert proxy["args"] == ["python", "-m", "moe_l2_proxy"]
    assert variables.get("MOE_L2_LLAMA_URLS") == f"http://{headless['metadata']['name']}:{llama_port}", (
        f"the gateway does not reach every llama replica: {variables.get('MOE_L2_LLAMA_URLS')}"
    )
    assert variables.get("MOE_L2_CACHE_URLS") == f"http://{{host}}:{cache_port}", (
        f"hints must go to the chosen replica's own cache-manager: {variables.get('MOE_L2_CACHE_URLS')}"
    )
    for single in ("MOE_L2_LLAMA_URL", "MOE_L2_CACHE_URL"):
        assert single not in variables, f"{single} is ignored beside its _URLS list and would mislead"
    assert variables.get("MOE_L2_PROXY_ROUTING") == "affinity"
    assert variables.get("MOE_L2_PREDICTOR_URLS") == "http://predictor:11437"
    assert env(cache).get("MOE_L2_CACHE_HOT_SET_SCOPE") == "traffic", "hot sets of the replica's traffic"
    for port in (llama_port, cache_port):
        assert admits(objects, pod_labels(llama_set), "proxy", port), f"the gateway cannot reach llama pods' :{port}"


def check_services(objects: list[Obj]) -> None:
    """Every Service selects pods and reaches a declared port; the compose names resolve."""
    for service in (o for o in objects if o["kind"] == "Service"):
        name = service["metadata"]["name"]
        targets = [
            w for w in workloads(objects) if _selects({"matchLabels": service["spec"]["selector"]}, pod_labels(w))
        ]
        assert targets, f"Service {name} selects no pod"
        declared = {
            (p.get("name"), int(p["containerPort"]))
            for c in pod_spec(targets[0])["containers"]
            for p in c.get("ports", [])
        }
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert any(target in pair for pair in declared), f"Service {name}: no container port {target}"
    for name, service in MOE_L2_SERVICES.items():
        [port] = find(objects, "Service", name)["spec"]["ports"]
        assert port["port"] == service.port, f"Service {name} listens on {port['port']}"
    predictor = find(objects, "Service", "predictor")
    assert predictor["spec"].get("clusterIP") == "None", "the gateway balances over the predictor pods' addresses"


def check_predictor_scales(objects: list[Obj]) -> None:
    deployment = find(objects, "Deployment", "predictor")
    assert "replicas" not in deployment["spec"], "replicas would fight the HorizontalPodAutoscaler at each apply"
    [hpa] = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "predictor")
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def check_redis(objects: list[Obj]) -> None:
    redis = find(objects, "StatefulSet", "redis")
    [container] = pod_spec(redis)["containers"]
    args = container.get("args", [])
    assert "command" not in container, "the image's entrypoint must stay (compose's `command` is args)"
    assert args[args.index("--appendonly") + 1] == "yes", "redis needs AOF"
    assert args[args.index("--appendfsync") + 1] == "always"
    [data] = [m for m in container["volumeMounts"] if m["mountPath"] == "/data"]
    claims = {t["metadata"]["name"] for t in redis["spec"].get("volumeClaimTemplates", [])}
    assert data["name"] in claims, "redis' /data is not a persistent volume"


def check_scraped(objects: list[Obj]) -> None:
    """Prometheus's pod annotations reach every moe-l2 service's /metrics port, and not Redis."""
    scraped = set()
    for workload in workloads(objects):
        notes = workload["spec"]["template"]["metadata"].get("annotations", {})
        if notes.get("prometheus.io/scrape") != "true":
            continue
        assert notes.get("prometheus.io/path", "/metrics") == "/metrics"
        for container in pod_spec(workload)["containers"]:
            ports = {int(p["containerPort"]) for p in container.get("ports", [])}
            if "prometheus.io/port" not in notes or int(notes["prometheus.io/port"]) in ports:
                scraped.add(container["name"])
    assert scraped == SCRAPED, f"scraped: {sorted(scraped)}, not {sorted(SCRAPED)}"


def check_dashboard(objects: list[Obj], dashboard: str) -> None:
    [config] = [
        o for o in objects if o["kind"] == "ConfigMap" and "grafana_dashboard" in o["metadata"].get("labels", {})
    ]
    assert config["data"] == {"moe-l2.json": dashboard}, (
        "the dashboard ConfigMap differs from deploy/kubernetes/base/dashboards/moe-l2.json, the file compose "
        "mounts too"
    )


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}
    for unit, factor in units.items():
        if quantity.endswith(unit):
            return int(float(quantity[: -len(unit)]) * factor)
    return int(quantity)
