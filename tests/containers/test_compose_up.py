"""`docker compose up` for real: the CPU variant's images built by compose on a real Docker engine,
the stack brought up with every healthcheck, and what a user does with it checked from the host
through the one published port (conftest.py builds and starts it; the tests run in file order and
the last one takes it down).
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

import httpx
import ollama
import openai
from packaging.utils import canonicalize_name

from moe_l2_contracts.admin import ADMIN_TOKEN_HEADER
from moe_l2_ops.stats import parse_metrics
from tests.compose.checks import EXTRAS
from tests.test_lock import lock

from .conftest import COMPOSE_FILES, LLAMAS, PREDICTORS, PROJECT, REPO, UP_SERVICES, Stack
from .engine import compose_binary, run

MODEL = "moe-l2"  # compose.yaml's MOE_L2_LLAMA_MODEL_ALIAS default
PROMPTS = (
    "Solve for x: 3x + 7 = 22, and show each step of the algebra.",
    "Translate 'good morning, how are you today' into French and German.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Why does my program crash with a segmentation fault when I free a pointer twice?",
    "Write a short poem about the sea at night, in four lines.",
    "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies?",
)


def _chat(stack: Stack, prompt: str, *, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(
        f"{stack.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens},
        headers=stack.auth,
        timeout=120,
    )


def _predictor_requests(stack: Stack) -> list[float]:
    """POST /v1/predict requests each predictor replica has answered, from its own /metrics."""
    counts = []
    for index in range(1, PREDICTORS + 1):
        text = stack.python_in(
            "predictor",
            "import urllib.request;print(urllib.request.urlopen('http://localhost:11437/metrics').read().decode())",
            index=index,
        )
        samples = parse_metrics(text).get("moe_l2_predictor_requests_total", [])
        counts.append(sum(v for labels, v in samples if labels.get("endpoint", "").startswith("/v1/predict")))
    return counts


def test_every_service_turns_healthy(stack: Stack) -> None:
    containers = stack.containers(every=True)
    by_service: dict[str, list[dict]] = {}
    for c in containers:
        by_service.setdefault(c["Service"], []).append(c)
    assert set(by_service) == set(UP_SERVICES)
    assert len(by_service["predictor"]) == PREDICTORS
    # the one-shot writer of the admin token ran and is done
    (token,) = by_service.pop("admin-token")
    assert token["State"] == "exited" and token["ExitCode"] == 0
    for service, replicas in by_service.items():
        for c in replicas:
            assert (c["State"], c["Health"]) == ("running", "healthy"), f"{service}: {c['Name']}"


def test_only_the_gateway_is_published_on_loopback(stack: Stack) -> None:
    published = {
        (c["Service"], p["URL"], p["PublishedPort"], p["TargetPort"])
        for c in stack.containers()
        for p in c.get("Publishers") or []
        if p.get("PublishedPort")
    }
    assert published == {("proxy", "127.0.0.1", stack.port, 11435)}


INSTALLED = """
import json, platform
from importlib import metadata
print(json.dumps({"python": platform.python_version(),
                  "dists": {d.metadata["Name"]: d.version for d in metadata.distributions()}}))
"""


def test_the_python_images_run_their_lock(stack: Stack) -> None:
    """Each Python image holds exactly its lock's packages at the lock's versions (requirements/,
    docs/dependencies.md), plus the project and the venv's pip."""
    for service, extra in EXTRAS.items():
        found = json.loads(stack.python_in(service, INSTALLED))
        python = found["python"]
        locked = {p.name: p.version for p in lock(extra) if p.applies(python)}
        # torch is the local CPU build here (2.13.0+cpu), the lock's 2.13.0
        installed = {canonicalize_name(n): v.split("+")[0] for n, v in found["dists"].items()}
        installed.pop("moe-l2")
        installed.pop("pip")
        assert installed == locked, f"{service} (Python {python}) differs from requirements/{extra}.txt"


def test_the_llama_image_runs_the_patched_server(stack: Stack) -> None:
    """The image compiled the pinned source with the patch series: its routing telemetry answers."""
    out = stack.exec(
        "llama",
        "curl",
        "-fsS",
        "-H",
        f"{ADMIN_TOKEN_HEADER}: {stack.admin_token}",
        "http://localhost:11436/moe/routing",
    )
    routing = json.loads(out)
    assert routing["n_layer"] > 0 and routing["n_expert"] > 0


def test_the_openai_sdk_chats_through_the_gateway(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.api_key, timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=16
    )
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.model == MODEL
    # the domain came from a predictor container, not the gateway's keyword fallback
    assert raw.headers["X-MoE-Domain-Source"] == "predictor"
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=16, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text


def test_the_ollama_client_chats_through_the_gateway(stack: Stack) -> None:
    sources: list[str] = []

    def keep_source(response: httpx.Response) -> None:
        if response.request.url.path == "/api/chat":
            sources.append(response.headers.get("X-MoE-Domain-Source", ""))

    client = ollama.Client(host=stack.url, timeout=120, event_hooks={"response": [keep_source]}, headers=stack.auth)
    assert MODEL in {m.model.split(":")[0] for m in client.list().models}
    answer = client.chat(model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}], options={"num_predict": 16})
    assert answer.message.content
    assert sources == ["predictor"]


def test_requests_spread_over_the_predictors_and_survive_one_stopped(stack: Stack) -> None:
    before = _predictor_requests(stack)
    for i in range(5 * PREDICTORS):
        resp = _chat(stack, PROMPTS[i % len(PROMPTS)])
        assert resp.status_code == 200, resp.text
    after = _predictor_requests(stack)
    served = [a - b for a, b in zip(after, before, strict=True)]
    assert all(n > 0 for n in served), f"requests per predictor replica: {served}"

    # One replica stopped while chats run: every chat still succeeds.
    victim = next(c["Name"] for c in stack.containers("predictor") if c["Name"].endswith(f"-{PREDICTORS}"))
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        futures = [pool.submit(_chat, stack, PROMPTS[i % len(PROMPTS)]) for i in range(4)]
        stack.engine.docker("stop", "--time", "2", victim, timeout=60)
        futures += [pool.submit(_chat, stack, PROMPTS[i % len(PROMPTS)]) for i in range(12)]
        statuses = [f.result().status_code for f in futures]
    assert statuses == [200] * len(statuses)
    stack.engine.docker("start", victim, timeout=60)


def _address(stack: Stack, service: str, index: int) -> str:
    code = "import socket;print(socket.gethostbyname(socket.gethostname()))"
    return stack.python_in(service, code, index=index).strip()


def _replicas(stack: Stack) -> dict[str, dict]:
    return {
        r["replica"]: r for r in httpx.get(f"{stack.url}/moe/stats", headers=stack.auth, timeout=30).json()["replicas"]
    }


def test_each_llama_replica_has_its_own_cache_manager_and_gets_its_domains(stack: Stack) -> None:
    # each cache-manager claimed a different llama container, by its address on the compose network
    managers = range(1, LLAMAS + 1)
    served = [json.loads(stack.python_in("cache-manager", _GET % "/v1/stats", index=i))["llama_url"] for i in managers]
    llamas = {f"{_address(stack, 'llama', i)}:11436" for i in range(1, LLAMAS + 1)}
    assert {url.removeprefix("http://") for url in served} == llamas, served

    # one chat at a time (nothing spills): each domain goes to one replica, whose own cache-manager
    # the proxy hints
    before = _replicas(stack)
    hints_before = [json.loads(stack.python_in("cache-manager", _GET % "/v1/stats", index=i)) for i in managers]
    for i in range(3 * len(PROMPTS)):
        assert _chat(stack, PROMPTS[i % len(PROMPTS)]).status_code == 200
    after = _replicas(stack)
    assert set(after) == llamas and all(r["healthy"] for r in after.values()), after
    assert {r["cache_url"].removeprefix("http://") for r in after.values()} == {
        f"{_address(stack, 'cache-manager', i)}:11438" for i in managers
    }
    new = {
        key: {d for d, n in r["domains"].items() if n > before.get(key, {}).get("domains", {}).get(d, 0)}
        for key, r in after.items()
    }
    assert all(new.values()), f"a replica got none of the chats: {new}"
    assert not set.intersection(*new.values()), f"a domain went to both replicas: {new}"
    hints_after = [json.loads(stack.python_in("cache-manager", _GET % "/v1/stats", index=i)) for i in managers]
    for was, now in zip(hints_before, hints_after, strict=True):
        assert now["hints"]["hints"] > was["hints"]["hints"], (was["hints"], now["hints"])


def test_the_cache_manager_pins_the_file_llama_maps(stack: Stack) -> None:
    # The chats above hinted their domains: the pool pinned those domains' hot experts.
    stats = json.loads(stack.python_in("cache-manager", _GET % "/v1/stats"))
    pool = stats["pool"]
    assert stats["mode"] == "active"
    assert pool["lock_mode"] == "mlock" and pool["locked_bytes"] > 0, pool
    # mlock for real: the kernel counts the locked pages against the cache-manager's process
    status = stack.exec("cache-manager", "cat", "/proc/1/status")
    locked_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmLck:"))
    assert locked_kib * 1024 >= pool["locked_bytes"]

    # The very file llama maps: one inode, seen from both containers, mapped by llama-server.
    inode = "import os;s=os.stat('/models/model.gguf');print(s.st_dev,s.st_ino)"
    assert stack.python_in("llama", inode) == stack.python_in("cache-manager", inode)
    assert "/models/model.gguf" in stack.exec("llama", "cat", "/proc/1/maps")

    # Inside the llama container, mincore over the pinned experts' ranges: all resident.
    hotsets = json.loads(stack.python_in("cache-manager", _GET % "/v1/hotsets"))
    ranges = []
    for hot in hotsets.values():
        for layer, experts in hot["layers"].items():
            for expert in experts[: pool["capacity_per_layer"]]:
                found = json.loads(stack.python_in("cache-manager", _GET % f"/v1/index/{layer}/{expert}"))
                ranges += [(r["offset"], r["length"]) for r in found["ranges"]]
                break  # one expert per layer and domain is enough to show it
    assert ranges
    resident = stack.python_in("llama", _MINCORE, json.dumps(ranges))
    assert resident.strip() == "True", resident


def test_redis_keeps_the_tables_across_a_restart(stack: Stack) -> None:
    def tables() -> dict[str, str]:
        keys = stack.exec("redis", "redis-cli", "--scan", "--pattern", "moe:*").split()
        return {k: stack.exec("redis", "redis-cli", "--no-raw", "DUMP", k) for k in sorted(keys) if ":routing:" in k}

    deadline = time.monotonic() + 60
    while not (before := tables()) and time.monotonic() < deadline:
        time.sleep(2)  # the flywheel pulls llama's counts every 2 s (compose.test.yaml)
    assert before, "the flywheel wrote no routing table to Redis"
    # Stop the flywheel's writes for the comparison: the tables must come back as they were.
    stack.compose("stop", "cache-manager", timeout=120)
    before = tables()
    stack.compose("restart", "redis", timeout=120)
    stack.compose("up", "--wait", "--no-build", "redis", timeout=300)
    assert tables() == before
    stack.compose("up", "--wait", "--no-build", "cache-manager", timeout=300)


def test_the_gateway_asks_for_a_key(stack: Stack) -> None:
    """compose passes MOE_L2_PROXY_API_KEYS: 401 without a key or with a wrong one, on both APIs; 200 with
    either key; the probes stay open."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 4}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        denied = httpx.post(f"{stack.url}/v1/chat/completions", json=chat, headers=headers, timeout=60)
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key", denied.text
        assert httpx.get(f"{stack.url}/api/tags", headers=headers, timeout=60).status_code == 401
    assert httpx.post(f"{stack.url}/v1/chat/completions", json=chat, headers=stack.auth, timeout=120).status_code == 200
    second = {"Authorization": "Bearer second-key"}
    assert httpx.get(f"{stack.url}/api/tags", headers=second, timeout=60).status_code == 200
    assert httpx.get(f"{stack.url}/healthz", timeout=60).status_code == 200


def test_the_gateway_published_beyond_loopback_without_keys_refuses(stack: Stack) -> None:
    """The proxy image, configured as compose configures it with MOE_L2_BIND=0.0.0.0 and no keys: one line,
    exit 1 (tests/test_open_bind.py runs the way out, MOE_L2_ALLOW_OPEN=1, without a container)."""
    open_env = ["-e", "MOE_L2_PROXY_API_KEYS=", "-e", "MOE_L2_PROXY_EXPOSED_HOST=0.0.0.0"]
    done = stack.compose("run", "--rm", "--no-deps", "-T", *open_env, "proxy", timeout=300, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "moe_l2_proxy: invalid settings: the gateway would be reachable on 0.0.0.0 (published) without API keys"
        in done.stdout + done.stderr
    ), done.stdout + done.stderr


def test_grafanas_admin_password_is_generated_not_admin(stack: Stack) -> None:
    """The one-shot wrote Grafana's admin password to the grafana-secret volume: generated, not admin, only
    Grafana's uid may read it; and what compose hands Grafana has no password in it, no anonymous access.
    (Grafana itself does not run here: no stand-in for its image, see conftest.py.)"""
    code = (
        "import os;p='/run/grafana/admin-password';s=os.stat(p);"
        "print(oct(s.st_mode & 0o777), s.st_uid, len(open(p).read()), open(p).read() == 'admin')"
    )
    out = stack.compose(
        "run", "--rm", "--no-deps", "-T", "admin-token", "python", "-c", code, timeout=300
    ).stdout.split()
    assert out[:2] == ["0o400", "472"] and int(out[2]) >= 24 and out[3] == "False", out
    grafana = json.loads(stack.compose("config", "--format", "json", timeout=60).stdout)["services"]["grafana"]
    env = grafana["environment"]
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env and env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/grafana/admin-password"


def test_a_ram_budget_without_the_override_is_refused(stack: Stack) -> None:
    """compose.yaml alone: the cache-manager is PID 1 of its own namespace and refuses MOE_L2_RAM_BUDGET."""
    done = stack.compose(
        "run", "--rm", "--no-deps", "-T", "-e", "MOE_L2_RAM_BUDGET=1GiB", "cache-manager", timeout=300, check=False
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "MOE_L2_RAM_BUDGET needs llama's PID namespace: add -f compose.ram-tier.yaml" in done.stdout + done.stderr


def test_the_ram_tier_holds_its_budget(stack: Stack) -> None:
    """compose.ram-tier.yaml with MOE_L2_RAM_BUDGET at the pages always kept plus a quarter of the experts of
    the demo model (7.7 of its 9.3 MB): llama and its cache-manager recreated (one replica), the cache-manager
    in llama's PID namespace finds llama-server's process (process_madvise and ptrace allowed by the override's
    capabilities under Docker's default seccomp profile), pages its mapping out, locks the non-expert tensors,
    and keeps the model's resident bytes within the budget itself once idle, well under the file."""
    from moe_l2_cache.pages import PAGE
    from moe_l2_cache.ram_tier import page_owners
    from moe_l2_gguf.index import load_index

    index = load_index(Path(stack.env["MOE_L2_MODELS_DIR"]) / "model.gguf")
    # the pages always kept (non-expert bytes, and the pages the demo model's off-boundary 8 KiB slices share:
    # 6.16 MB against 3.02 MB of non-expert bytes) and a quarter of the experts
    kept = sum(int((owner < 0).sum()) for owner in page_owners(index)) * PAGE
    budget = kept + index.routed_bytes // 4
    env = {**stack.env, "MOE_L2_RAM_BUDGET": str(budget)}
    files = [a for path in (*COMPOSE_FILES, REPO / "compose.ram-tier.yaml") for a in ("-f", str(path))]
    base = [str(compose_binary()), "-p", PROJECT, "--project-directory", str(REPO), *files]
    scale = ["--scale", "llama=1", "--scale", "cache-manager=1"]
    run([*base, "up", "--wait", "--no-build", *scale, "llama", "cache-manager"], env=env, timeout=900, cwd=REPO)

    def tier() -> dict:
        return json.loads(stack.python_in("cache-manager", _GET % "/v1/stats"))["ram_tier"]

    prompt = json.dumps({"prompt": " ".join(PROMPTS), "max_tokens": 16})
    for domain in ("math", "codegen", "translate"):
        stack.exec(
            "llama", "curl", "-fsS", "-H", "Content-Type: application/json", "-H", f"X-MoE-Domain: {domain}",
            "-d", prompt, "http://localhost:11436/v1/completions",
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while (now := tier())["sweeps"] < 20 or not now["paged_out_bytes_total"]:
        assert time.monotonic() < deadline, now
        time.sleep(1)
    assert now["budget_bytes"] == budget and now["llama_pids"], now
    assert not now["problem"], now["problem"]
    assert now["lock_mode"] == "mlock", now  # root with IPC_LOCK: the non-expert tensors locked
    assert now["kept_bytes"] == kept, now
    # Held to the byte once idle: llama mapped the whole file (9.3 MB here) and the tier paged it down; a pass
    # pages out after the fact, so while llama reads the model may be over by the misses' headroom, but the
    # full passes of an idle second leave the pages kept and the pool's. (Before the budget counted pages,
    # 2026-12-06: 6.35 MB resident for a 6.16 MB budget, still so after 30 s idle.)
    deadline = time.monotonic() + 30
    while (resident := (now := tier())["resident_expert_bytes"] + now["resident_non_expert_bytes"]) > budget:
        if time.monotonic() > deadline:
            break
        time.sleep(1)
    assert resident <= budget < sum(index.file_sizes), f"{resident} bytes resident: {now}"


def test_down_leaves_nothing(stack: Stack) -> None:
    stack.compose("down", "-v", "--remove-orphans", timeout=300)
    label = f"label=com.docker.compose.project={PROJECT}"
    assert stack.engine.docker("ps", "-aq", "--filter", label).stdout.strip() == ""
    assert stack.engine.docker("volume", "ls", "-q", "--filter", label).stdout.strip() == ""
    assert stack.engine.docker("network", "ls", "-q", "--filter", label).stdout.strip() == ""


_GET = "import urllib.request;print(urllib.request.urlopen('http://localhost:11438%s').read().decode())"

# In the container: map the model read-only and ask mincore whether every page of each range (argv[1],
# JSON [[offset, length], ...]) is in the page cache. Prints True or the first range that is not.
_MINCORE = """
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
page = os.sysconf("SC_PAGE_SIZE")
fd = os.open("/models/model.gguf", os.O_RDONLY)
size = os.fstat(fd).st_size
addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
for offset, length in json.loads(sys.argv[1]):
    start = offset // page * page
    pages = (offset + length - start + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(addr + start), pages * page, vec) != 0 or not all(v & 1 for v in vec):
        print("not resident:", offset, length, sum(v & 1 for v in vec), "of", pages)
        sys.exit(0)
print(True)
"""
