"""The real patched llama-server on the demo MoE model: chat, routing telemetry, hot set, and what
a request may ask of them (closed set of domain tags, admin token).

These tests drive the binary built from the pinned llama.cpp source plus services/llama/patches.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from moe_l2_contracts.admin import ADMIN_TOKEN_HEADER
from moe_l2_contracts.domains import DEFAULT_DOMAINS
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.llama_service import llama_service_spec
from moe_l2_ops.supervisor import Supervisor, free_port
from tests.metrics import sample_sum

from .conftest import ADMIN_HEADERS, LlamaServer

pytestmark = pytest.mark.llama


def domain_prompt(planted: dict, domain: str, n_words: int = 24, seed: int = 0) -> str:
    words = planted["domains"][domain]["words"]
    rng = random.Random(f"{domain}-{seed}")
    return " ".join(rng.choice(words) for _ in range(n_words))


def chat(
    server: LlamaServer,
    content: str,
    *,
    domain: str | None = None,
    max_tokens: int = 12,
    stream: bool = False,
) -> httpx.Response:
    headers = {"X-MoE-Domain": domain} if domain else {}
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 42,
        "stream": stream,
        "cache_prompt": False,
    }
    return server.client.post("/v1/chat/completions", json=body, headers=headers)


def completion_tokens(server: LlamaServer, prompt: str, n: int = 32) -> list[int]:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "seed": 42, "return_tokens": True}
    resp = server.client.post("/completion", json=body)
    resp.raise_for_status()
    return resp.json()["tokens"]


def planted_share(routing: dict, planted: dict, domain: str, tag: str | None = None) -> float:
    """Share of the tag's activations that went to the domain's planted experts."""
    layers = routing["domains"][tag or domain]
    inside = total = 0
    for layer, experts in layers.items():
        planted_ids = set(planted["domains"][domain]["experts"][layer])
        for expert, count in experts.items():
            total += count
            if int(expert) in planted_ids:
                inside += count
    assert total > 0, f"no activations counted under {tag or domain}"
    return inside / total


def metric(text: str, name: str, domain: str | None = None) -> float:
    """Sum of a llamacpp:* metric's samples, optionally of one domain label."""
    return sample_sum(text, f"llamacpp:{name}", **({"domain": domain} if domain is not None else {}))


def set_hot_set(server: LlamaServer, domain: str, layers: dict[str, list[int]]) -> dict:
    resp = server.client.post("/moe/hot-set", json={"domain": domain, "layers": layers}, headers=ADMIN_HEADERS)
    assert resp.status_code == 200, resp.text
    return resp.json()


# (a) chat completions, blocking and streaming


def test_chat_blocking_and_streaming_agree(llama: LlamaServer, planted: dict) -> None:
    prompt = domain_prompt(planted, "math")
    blocking = chat(llama, prompt, max_tokens=16)
    assert blocking.status_code == 200, blocking.text
    body = blocking.json()
    text = body["choices"][0]["message"]["content"]
    assert text
    assert body["usage"]["completion_tokens"] == 16

    chunks: list[str] = []
    with llama.client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 16,
            "temperature": 0,
            "seed": 42,
            "stream": True,
        },
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        done = False
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                done = True
                break
            delta = json.loads(payload)["choices"][0]["delta"] if json.loads(payload)["choices"] else {}
            if delta.get("content"):
                chunks.append(delta["content"])
    assert done, "the stream did not end with [DONE]"
    assert len(chunks) > 1, "streaming delivered the answer in one piece"
    assert "".join(chunks) == text


# (b) routing counts under each tag are dominated by that domain's planted experts


def test_routing_follows_planted_experts(llama: LlamaServer, planted: dict) -> None:
    llama.routing(reset=True)
    for domain in DEFAULT_DOMAINS:
        resp = chat(llama, domain_prompt(planted, domain), domain=domain)
        assert resp.status_code == 200, resp.text
    routing = llama.routing(reset=True)

    assert routing["n_expert"] == planted["n_expert"]
    assert routing["n_layer"] == planted["n_layer"]
    shares = {d: planted_share(routing, planted, d) for d in DEFAULT_DOMAINS}
    for domain, share in shares.items():
        assert share >= 0.8, f"{domain}: only {share:.1%} of activations on its planted experts ({shares})"
    # and the tags are not interchangeable: another domain's planted experts get a small share
    cross = planted_share(routing, planted, "math", tag="codegen")
    assert cross <= 0.5, f"codegen's activations fall on math's planted experts too ({cross:.1%})"

    # every token of every MoE layer is counted exactly n_expert_used times (all but the last layer,
    # which only sees the output rows)
    k = routing["n_expert_used"]
    for domain in DEFAULT_DOMAINS:
        layer0 = sum(routing["domains"][domain]["0"].values())
        assert layer0 == routing["tokens_by_domain"][domain] * k

    # reset=1 returned the counts and cleared them
    assert routing["tokens"] > 0
    assert llama.routing()["tokens"] == 0


def test_untagged_requests_count_under_default_tag(llama: LlamaServer, planted: dict) -> None:
    llama.routing(reset=True)
    assert chat(llama, domain_prompt(planted, "logic")).status_code == 200
    routing = llama.routing(reset=True)
    assert set(routing["domains"]) == {"untagged"}
    assert planted_share(routing, planted, "logic", tag="untagged") >= 0.8


def test_telemetry_disabled_answers_501(llama_off: LlamaServer) -> None:
    resp = llama_off.client.get("/moe/routing")
    assert resp.status_code == 501
    assert "--moe-telemetry" in resp.json()["error"]["message"]


# (c) greedy output is token-identical with telemetry on/off and with a hot set or not


def test_greedy_output_identical_with_telemetry_and_hot_set(
    llama: LlamaServer, llama_off: LlamaServer, planted: dict
) -> None:
    prompt = domain_prompt(planted, "codegen", n_words=30)
    plain = completion_tokens(llama_off, prompt)
    with_telemetry = completion_tokens(llama, prompt)
    set_hot_set(llama, "codegen", planted["domains"]["codegen"]["experts"])
    with_hot_set = completion_tokens(llama, prompt)
    set_hot_set(llama, "none", {})
    assert len(plain) == 32
    assert with_telemetry == plain
    assert with_hot_set == plain


# (d) hot set round trip and hit/miss counters


def test_hot_set_round_trip(llama: LlamaServer, planted: dict) -> None:
    layers = {layer: list(reversed(ids)) + ids[:1] for layer, ids in planted["domains"]["debug"]["experts"].items()}
    posted = set_hot_set(llama, "debug", layers)
    got = llama.client.get("/moe/hot-set").json()
    expected = {layer: sorted(set(ids)) for layer, ids in layers.items()}
    assert posted["layers"] == expected
    assert got["layers"] == expected
    assert got["domain"] == "debug"
    assert got["version"] == posted["version"]
    assert got["n_experts"] == sum(len(v) for v in expected.values())


def test_hit_and_miss_counters_follow_the_hot_set(llama: LlamaServer, planted: dict) -> None:
    def deltas(domain: str, hot_domain: str) -> tuple[float, float]:
        set_hot_set(llama, hot_domain, planted["domains"][hot_domain]["experts"])
        before = llama.metrics()
        assert chat(llama, domain_prompt(planted, domain, seed=7), domain=domain).status_code == 200
        after = llama.metrics()
        hits = metric(after, "moe_hot_hits_total", domain) - metric(before, "moe_hot_hits_total", domain)
        misses = metric(after, "moe_hot_misses_total", domain) - metric(before, "moe_hot_misses_total", domain)
        return hits, misses

    hits, misses = deltas("translate", hot_domain="translate")
    assert hits / (hits + misses) >= 0.8, (hits, misses)
    applied = llama.client.get("/moe/hot-set").json()
    assert applied["applied_version"] == applied["version"]

    other = next(d for d in DEFAULT_DOMAINS if d != "translate")
    hits, misses = deltas("translate", hot_domain=other)
    overlap = sum(
        len(set(planted["domains"]["translate"]["experts"][layer]) & set(ids))
        for layer, ids in planted["domains"][other]["experts"].items()
    ) / sum(len(ids) for ids in planted["domains"]["translate"]["experts"].values())
    assert hits / (hits + misses) <= overlap + 0.2, (hits, misses, overlap)
    set_hot_set(llama, "none", {})


# (e) concurrent requests with different tags keep their counts apart


def test_concurrent_tags_are_kept_apart(llama: LlamaServer, planted: dict) -> None:
    domains = ["codegen", "math", "creative_write", "chinese_tech"]
    usage: dict[str, dict] = {}
    errors: list[str] = []
    barrier = threading.Barrier(len(domains))

    def worker(domain: str) -> None:
        with httpx.Client(base_url=llama.url, timeout=120) as client:
            barrier.wait()
            resp = client.post(
                "/v1/chat/completions",
                headers={"X-MoE-Domain": domain},
                json={
                    "messages": [{"role": "user", "content": domain_prompt(planted, domain, n_words=40, seed=3)}],
                    "max_tokens": 24,
                    "temperature": 0,
                    "cache_prompt": False,
                },
            )
            if resp.status_code != 200:
                errors.append(resp.text)
            else:
                usage[domain] = resp.json()["usage"]

    llama.routing(reset=True)
    threads = [threading.Thread(target=worker, args=(d,)) for d in domains]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    routing = llama.routing(reset=True)

    assert set(routing["domains"]) == set(domains)
    for domain in domains:
        assert planted_share(routing, planted, domain) >= 0.8
        # every prompt token and every generated token but the last went through the model once
        expected = usage[domain]["prompt_tokens"] + usage[domain]["completion_tokens"] - 1
        assert routing["tokens_by_domain"][domain] == expected


# bad input


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"domain": "x"}', '"layers"'),
        ('{"domain": "x", "layers": {"999": [1]}}', "out of range"),
        ('{"domain": "x", "layers": {"-1": [1]}}', "out of range"),
        ('{"domain": "x", "layers": {"abc": [1]}}', "out of range"),
        ('{"domain": "x", "layers": {"0": [32]}}', "out of range"),
        ('{"domain": "x", "layers": {"0": [-1]}}', "out of range"),
        ('{"domain": "x", "layers": {"0": ["a"]}}', "out of range"),
        ('{"domain": "x", "layers": {"0": 3}}', "array"),
        ('{"domain": 5, "layers": {}}', "string"),
    ],
)
def test_bad_hot_set_is_rejected_and_server_keeps_serving(
    llama: LlamaServer, planted: dict, body: str, fragment: str
) -> None:
    before = llama.client.get("/moe/hot-set").json()
    resp = llama.client.post(
        "/moe/hot-set", content=body, headers={"Content-Type": "application/json", **ADMIN_HEADERS}
    )
    assert resp.status_code == 400, resp.text
    assert fragment in resp.json()["error"]["message"]
    assert llama.client.get("/moe/hot-set").json()["version"] == before["version"]
    assert llama.client.get("/health").status_code == 200
    assert chat(llama, domain_prompt(planted, "math"), max_tokens=2).status_code == 200


def test_malformed_domain_header_is_rejected(llama: LlamaServer) -> None:
    resp = chat(llama, "hello", domain="bad domain!")
    assert resp.status_code == 400
    assert "X-MoE-Domain" in resp.json()["error"]["message"]


def test_pulls_without_reset_accumulate(llama: LlamaServer, planted: dict) -> None:
    # a pull hands the counts over from the compute side in one swap: a pull without reset must keep
    # them, later traffic adds to them, and only a reset clears them
    llama.routing(reset=True)
    first = chat(llama, domain_prompt(planted, "math", seed=11), domain="math")
    assert first.status_code == 200, first.text
    n_first = first.json()["usage"]["prompt_tokens"] + first.json()["usage"]["completion_tokens"] - 1
    assert llama.routing()["tokens_by_domain"] == {"math": n_first}
    assert llama.routing()["tokens_by_domain"] == {"math": n_first}

    second = chat(llama, domain_prompt(planted, "logic", seed=11), domain="logic")
    assert second.status_code == 200, second.text
    n_second = second.json()["usage"]["prompt_tokens"] + second.json()["usage"]["completion_tokens"] - 1
    routing = llama.routing(reset=True)
    assert routing["tokens_by_domain"] == {"math": n_first, "logic": n_second}
    assert routing["tokens"] == n_first + n_second
    k = routing["n_expert_used"]
    assert sum(routing["domains"]["math"]["0"].values()) == n_first * k
    assert llama.routing()["tokens"] == 0


def test_no_count_is_lost_to_concurrent_pulls(llama: LlamaServer, planted: dict) -> None:
    # the flywheel pulls while slots generate: every token must land in exactly one pull
    domains = ["codegen", "debug", "translate", "general_qa"]
    expected: dict[str, int] = {}
    errors: list[str] = []
    done = threading.Event()
    pulled: list[dict] = []

    def worker(domain: str) -> None:
        with httpx.Client(base_url=llama.url, timeout=120) as client:
            resp = client.post(
                "/v1/chat/completions",
                headers={"X-MoE-Domain": domain},
                json={
                    "messages": [{"role": "user", "content": domain_prompt(planted, domain, n_words=40, seed=5)}],
                    "max_tokens": 32,
                    "temperature": 0,
                    "cache_prompt": False,
                },
            )
            if resp.status_code != 200:
                errors.append(resp.text)
            else:
                usage = resp.json()["usage"]
                expected[domain] = usage["prompt_tokens"] + usage["completion_tokens"] - 1

    def puller() -> None:
        with httpx.Client(base_url=llama.url, timeout=120, headers=ADMIN_HEADERS) as client:
            while not done.is_set():
                resp = client.get("/moe/routing", params={"reset": "1"})
                resp.raise_for_status()
                pulled.append(resp.json())

    llama.routing(reset=True)
    pull_thread = threading.Thread(target=puller)
    pull_thread.start()
    workers = [threading.Thread(target=worker, args=(d,)) for d in domains]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    done.set()
    pull_thread.join()
    pulled.append(llama.routing(reset=True))
    assert not errors

    assert len(pulled) > 2, "the pulls did not overlap the generation"
    totals: dict[str, int] = {}
    layer0: dict[str, int] = {}
    for snapshot in pulled:
        for domain, n in snapshot["tokens_by_domain"].items():
            totals[domain] = totals.get(domain, 0) + n
        for domain, layers in snapshot["domains"].items():
            layer0[domain] = layer0.get(domain, 0) + sum(layers.get("0", {}).values())
    assert totals == expected
    k = pulled[-1]["n_expert_used"]
    assert layer0 == {d: n * k for d, n in expected.items()}


# domain tags: a closed set (--moe-domains, which the `llama` fixture gets from the taxonomy)


@pytest.mark.parametrize("tag", ["_global", "_other", "_x", "__"])
def test_reserved_domain_tag_is_refused(llama: LlamaServer, tag: str) -> None:
    llama.routing(reset=True)
    resp = chat(llama, "hello", domain=tag)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "reserved" in error["message"] and tag in error["message"]
    assert tag not in llama.routing()["domains"]
    assert f'domain="{tag}"' not in llama.metrics()


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_domain_tag_is_refused_with_the_valid_ones(llama: LlamaServer, stream: bool) -> None:
    resp = chat(llama, "hello", domain="gwtest_not_a_domain", stream=stream)
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert "gwtest_not_a_domain" in message
    for domain in DEFAULT_DOMAINS:
        assert domain in message
    assert "gwtest_not_a_domain" not in llama.routing()["domains"]
    assert 'domain="gwtest_not_a_domain"' not in llama.metrics()


def test_untagged_header_is_the_same_as_none(llama: LlamaServer, planted: dict) -> None:
    llama.routing(reset=True)
    assert chat(llama, domain_prompt(planted, "math"), domain="untagged").status_code == 200
    assert set(llama.routing(reset=True)["domains"]) == {"untagged"}


# servers started with their own environment or arguments


@pytest.fixture(scope="module")
def start_custom(
    llama_binary: Path, demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., LlamaServer]]:
    """Factory: a llama-server (telemetry on) with extra environment variables or arguments."""
    supervisor = Supervisor(tmp_path_factory.mktemp("llama-custom-logs"))
    clients: list[httpx.Client] = []

    def start(
        name: str, *, env: dict[str, str] | None = None, extra_args: str = "", ctx_size: int = 2048
    ) -> LlamaServer:
        settings = LlamaSettings(
            port=free_port(), parallel=2, ctx_size=ctx_size, telemetry=True, threads=2, extra_args=extra_args
        )
        spec = llama_service_spec(name, llama_binary, demo_model, settings)
        running = supervisor.start(dataclasses.replace(spec, env={**spec.env, **(env or {})}))
        client = httpx.Client(base_url=spec.url, timeout=120)
        clients.append(client)
        return LlamaServer(url=spec.url, client=client, log_path=running.log_path)

    yield start
    for client in clients:
        client.close()
    supervisor.stop()


def compute_buffer_mib(server: LlamaServer) -> float:
    """The CPU compute buffer llama-server reserved for its graph (logged at load with -lv 4)."""
    found = re.findall(r"CPU compute buffer size =\s+([\d.]+) MiB", server.log_path.read_text())
    assert found, f"no compute buffer size in {server.log_path}"
    return float(found[0])


def test_only_the_telemetry_keeps_every_layers_selection(start_custom: Callable[..., LlamaServer]) -> None:
    """The telemetry turns keep_moe_selection on (patch 0007): each MoE layer's argsort is a graph
    output, kept to the end of the graph so that the callback reads them all in one split; the
    compute buffer grows by at most those selections. Without the telemetry the graph is llama.cpp's."""
    on = start_custom("llama-keep-selection", extra_args="-lv 4")
    off = start_custom("llama-no-telemetry", env={"LLAMA_ARG_MOE_TELEMETRY": "0"}, extra_args="-lv 4")
    for server in (on, off):
        assert chat(server, "hello", max_tokens=2).status_code == 200
    routing = on.routing()
    n_ubatch = 512  # llama-server's default -ub
    selections_mib = routing["n_layer"] * routing["n_expert"] * n_ubatch * 4 / 2**20
    grown = compute_buffer_mib(on) - compute_buffer_mib(off)
    assert 0 < grown <= selections_mib + 0.01, (grown, selections_mib)


def test_without_a_domain_list_distinct_tags_are_capped(start_custom: Callable[..., LlamaServer]) -> None:
    # run by hand (no --moe-domains), any well-formed tag is accepted, up to a bound
    server = start_custom("llama-open-tags", env={"LLAMA_ARG_MOE_DOMAINS": ""}, extra_args="--moe-max-domains 3")
    for tag in ("alpha", "beta", "gamma"):
        assert chat(server, "hello", domain=tag, max_tokens=2).status_code == 200
    refused = chat(server, "hello", domain="delta", max_tokens=2)
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert "delta" in message and "3" in message and "alpha" in message
    # the tags already in use and untagged requests still pass; reserved names never do
    assert chat(server, "hello", domain="beta", max_tokens=2).status_code == 200
    assert chat(server, "hello", max_tokens=2).status_code == 200
    assert chat(server, "hello", domain="_global", max_tokens=2).status_code == 400
    assert set(server.routing()["domains"]) == {"alpha", "beta", "gamma", "untagged"}


# admin calls: POST /moe/hot-set and GET /moe/routing?reset=1 need X-MoE-Admin-Token


def assert_unauthorized(resp: httpx.Response, fragment: str) -> None:
    assert resp.status_code == 401, resp.text
    error = resp.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == 401
    assert fragment in error["message"]


@pytest.mark.parametrize(
    ("headers", "fragment"),
    [({}, ADMIN_TOKEN_HEADER), ({ADMIN_TOKEN_HEADER: "wrong"}, "invalid"), ({ADMIN_TOKEN_HEADER: ""}, "")],
)
def test_admin_calls_refuse_a_missing_or_wrong_token(
    llama: LlamaServer, planted: dict, headers: dict[str, str], fragment: str
) -> None:
    llama.routing(reset=True)
    assert chat(llama, domain_prompt(planted, "debug"), domain="debug").status_code == 200
    tokens = llama.routing()["tokens"]
    assert tokens > 0

    assert_unauthorized(llama.client.get("/moe/routing", params={"reset": "1"}, headers=headers), fragment)
    assert llama.routing()["tokens"] == tokens, "a refused reset cleared the counts"

    version = llama.client.get("/moe/hot-set").json()["version"]
    resp = llama.client.post("/moe/hot-set", json={"domain": "debug", "layers": {"0": [1]}}, headers=headers)
    assert_unauthorized(resp, fragment)
    assert llama.client.get("/moe/hot-set").json()["version"] == version


def test_admin_calls_pass_with_the_token_and_reads_stay_open(llama: LlamaServer, planted: dict) -> None:
    assert chat(llama, domain_prompt(planted, "debug"), domain="debug").status_code == 200
    # reads need no token
    assert llama.client.get("/moe/routing").status_code == 200
    assert llama.client.get("/moe/routing", params={"reset": "0"}).status_code == 200
    assert llama.client.get("/moe/hot-set").status_code == 200

    resp = llama.client.get("/moe/routing", params={"reset": "1"}, headers=ADMIN_HEADERS)
    assert resp.status_code == 200, resp.text
    assert resp.json()["tokens"] > 0
    assert llama.routing()["tokens"] == 0
    posted = set_hot_set(llama, "debug", {"0": [1, 2]})
    assert llama.client.get("/moe/hot-set").json()["version"] == posted["version"]
    set_hot_set(llama, "none", {})


def test_admin_calls_are_refused_without_a_configured_token(start_custom: Callable[..., LlamaServer]) -> None:
    server = start_custom("llama-no-admin-token", env={"LLAMA_ARG_MOE_ADMIN_TOKEN": ""})
    for headers in ({}, ADMIN_HEADERS, {ADMIN_TOKEN_HEADER: ""}):
        resp = server.client.get("/moe/routing", params={"reset": "1"}, headers=headers)
        assert_unauthorized(resp, "admin token not configured")
        resp = server.client.post("/moe/hot-set", json={"domain": "x", "layers": {}}, headers=headers)
        assert_unauthorized(resp, "admin token not configured")
    assert server.client.get("/moe/routing").status_code == 200
    assert server.client.get("/moe/hot-set").status_code == 200


def test_the_flags_and_the_deprecated_variables(start_custom: Callable[..., LlamaServer], tmp_path: Path) -> None:
    """The server patches take flags (--moe-*, their LLAMA_ARG_MOE_* variables, as upstream's); the LLAMA_MOE_*
    variables they were read from are still read for one release, each with one warning that names its flag, and
    a LLAMA_ARG_* variable set too wins. The admin token comes from a file, as --api-key-file's keys."""
    token_file = tmp_path / "admin-token"
    token_file.write_text("from-a-file\n")
    server = start_custom(
        "llama-flags",
        # LLAMA_ARG_MOE_TELEMETRY=1 comes from llama_server_env, as `moe-l2 up` sets it
        env={"LLAMA_ARG_MOE_DOMAINS": "", "LLAMA_MOE_MAX_DOMAINS": "2", "LLAMA_MOE_TELEMETRY": "0"},
        extra_args=f"--moe-admin-token-file {token_file}",
    )
    for tag in ("alpha", "beta"):
        assert chat(server, "hello", domain=tag, max_tokens=2).status_code == 200
    refused = chat(server, "hello", domain="gamma", max_tokens=2)
    assert refused.status_code == 400 and "--moe-max-domains" in refused.text, refused.text
    assert server.client.get("/moe/routing").status_code == 200, "the old LLAMA_MOE_TELEMETRY=0 won"
    assert_unauthorized(server.client.get("/moe/routing", params={"reset": "1"}, headers=ADMIN_HEADERS), "invalid")
    resp = server.client.get("/moe/routing", params={"reset": "1"}, headers={ADMIN_TOKEN_HEADER: "from-a-file"})
    assert resp.status_code == 200, resp.text
    log = server.log_path.read_text().splitlines()
    for old, flag in (("LLAMA_MOE_MAX_DOMAINS", "--moe-max-domains"), ("LLAMA_MOE_TELEMETRY", "--moe-telemetry")):
        warnings = [line for line in log if f"{old} is deprecated" in line]
        assert len(warnings) == 1 and flag in warnings[0], warnings


def test_moe_endpoints_with_api_key(start_custom: Callable[..., LlamaServer]) -> None:
    # llama-server's --api-key guards every endpoint; the /moe/ ones also take the admin token, which
    # the cache-manager sends instead of an API key, and an admin call always needs the admin token
    server = start_custom("llama-api-key", extra_args="--api-key test-api-key")
    api_key = {"Authorization": "Bearer test-api-key"}

    assert server.client.get("/health").status_code == 200
    assert server.client.get("/moe/routing").status_code == 401
    assert server.client.get("/moe/hot-set").status_code == 401
    assert server.client.get("/moe/routing", headers=api_key).status_code == 200
    assert server.client.get("/moe/routing", headers={ADMIN_TOKEN_HEADER: "wrong"}).status_code == 401

    # the admin token alone: reads and admin calls
    assert server.client.get("/moe/routing", headers=ADMIN_HEADERS).status_code == 200
    assert server.client.get("/moe/routing", params={"reset": "1"}, headers=ADMIN_HEADERS).status_code == 200
    resp = server.client.post("/moe/hot-set", json={"domain": "x", "layers": {}}, headers=ADMIN_HEADERS)
    assert resp.status_code == 200, resp.text

    # the API key alone is not enough for an admin call
    assert_unauthorized(server.client.get("/moe/routing", params={"reset": "1"}, headers=api_key), ADMIN_TOKEN_HEADER)
    resp = server.client.post("/moe/hot-set", json={"domain": "x", "layers": {}}, headers=api_key)
    assert_unauthorized(resp, ADMIN_TOKEN_HEADER)

    # and the admin token opens nothing outside /moe/
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    assert server.client.post("/v1/chat/completions", json=body, headers=ADMIN_HEADERS).status_code == 401
    assert server.client.post("/v1/chat/completions", json=body, headers=api_key).status_code == 200


def _busy(server: LlamaServer) -> tuple[float, float]:
    """(tokens predicted so far, requests being processed) from llama's /metrics."""
    text = server.client.get("/metrics").text
    return sample_sum(text, "llamacpp:tokens_predicted_total"), sample_sum(text, "llamacpp:requests_processing")


def test_blocking_client_that_leaves_is_noticed_under_traffic(start_custom: Callable[..., LlamaServer]) -> None:
    """Patch 0001: a non-streaming request whose client closes its connection stops generating within
    about a second (HTTP_POLLING_SECONDS), also while other results keep arriving. Here the traffic is a
    /metrics scrape every 0.25 s (each one a task whose result wakes every waiting HTTP thread): stock
    llama-server restarted its one-second wait at every such wake-up, never looked at the connection,
    and generated all of its tokens for nobody."""
    # 8,000 tokens: this machine's demo model generates about 1,000 a second (2026-12-07: 1,042 in the 1.1 s
    # between the request's start and its slot's release), so an uncancelled request runs for seconds after
    # the client's poll notices it; at 4,000 the margin was one poll, and a fast machine failed the bound
    tokens = 8000
    server = start_custom("llama-blocking-leaves", ctx_size=4 * 4096)
    before, _ = _busy(server)
    scraping = threading.Event()
    scraping.set()

    def scrape() -> None:
        while scraping.is_set():
            server.client.get("/metrics")
            time.sleep(0.25)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    try:
        body = json.dumps({"prompt": "tell me everything", "n_predict": tokens, "ignore_eos": True}).encode()
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            head = "POST /completion HTTP/1.1\r\nHost: llama\r\nContent-Type: application/json\r\n"
            sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            deadline = time.monotonic() + 30
            while _busy(server)[1] == 0:  # the request is in a slot
                assert time.monotonic() < deadline, "llama never started the request"
                time.sleep(0.05)
            time.sleep(0.3)
        left = time.monotonic()
        deadline = left + 30
        while _busy(server)[1] != 0:
            assert time.monotonic() < deadline, f"still generating 30 s after the client left: {_busy(server)}"
            time.sleep(0.1)
        stopped_after = time.monotonic() - left
    finally:
        scraping.clear()
        scraper.join(timeout=5)
    generated = _busy(server)[0] - before
    print(f"client gone: slot released after {stopped_after:.2f} s, {generated:.0f} of {tokens} tokens generated")
    # uncancelled it would have generated all of them; noticed, it stops within a poll or two (the bound
    # is generous for a loaded 2-core machine: the poll is one second)
    assert generated < tokens / 2, generated
    assert stopped_after < 5, stopped_after
    log = server.log_path.read_text()
    assert "cancel task" in log, "llama did not cancel the task of the client that left"
