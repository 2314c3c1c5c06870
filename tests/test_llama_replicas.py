"""`moe-l2 up --llama-replicas N` (issue 16): N llama-servers, each with its own cache-manager, the
gateway told about all of them. One replica is the stack as before, to the byte."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from moe_l2_contracts.admin import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE_ENV, ADMIN_TOKEN_HEADER
from moe_l2_ops.llama_replicas import MAX_REPLICAS, default_replica_count, parse_replica_count
from moe_l2_ops.stack import StackSettings, check_ports, parse_args, stack_services
from moe_l2_ops.supervisor import ServiceSpec, SupervisorError, free_port, port_in_use
from moe_l2_placement.hit_curve import DEFAULT_HIT_CURVE, write_hit_curve
from tests.test_stack import wait_for_line

MODEL, BINARY = Path("/nonexistent.gguf"), Path("/bin/true")
PORT_ENVS = ("MOE_L2_LLAMA_PORT", "MOE_L2_CACHE_PORT", "MOE_L2_PROXY_PORT", "MOE_L2_PREDICTOR_PORT")


@pytest.fixture
def stack_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Default ports, one predictor, no replica settings from the calling shell."""
    for name in (*PORT_ENVS, "MOE_L2_LLAMA_REPLICAS", "MOE_L2_PREDICTOR_REPLICAS", "MOE_L2_PREDICTOR_URLS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    monkeypatch.delenv(ADMIN_TOKEN_FILE_ENV, raising=False)
    monkeypatch.setenv("MOE_L2_STATE_DIR", str(tmp_path / "state"))


def by_name(specs: list[ServiceSpec]) -> dict[str, ServiceSpec]:
    return {s.name: s for s in specs}


def arg(spec: ServiceSpec, flag: str) -> str:
    return spec.argv[spec.argv.index(flag) + 1]


def test_one_replica_is_the_stack_as_before(stack_env: None) -> None:
    specs = by_name(stack_services(StackSettings(), MODEL, BINARY, "t0k3n"))
    assert list(specs) == ["redis", "llama", "cache-manager", "predictor", "proxy"]
    assert specs["llama"].url == "http://127.0.0.1:11436/v1"
    assert arg(specs["llama"], "--port") == "11436"
    assert specs["cache-manager"].url == "http://127.0.0.1:11438"
    assert specs["cache-manager"].env == {
        "MOE_L2_MODEL_PATH": str(MODEL),
        "MOE_L2_REDIS_URL": "redis://127.0.0.1:6379/0",
        "MOE_L2_LLAMA_URL": "http://127.0.0.1:11436",
        # the hit curve of the model's routing, for llama's next start (moe_l2_cache.hit_curve)
        "MOE_L2_CACHE_HIT_CURVE_PATH": str(StackSettings().hit_curve_file(MODEL)),
        ADMIN_TOKEN_ENV: "t0k3n",
    }
    # the gateway finds llama and the cache-manager as it always did: nothing about replicas
    assert specs["proxy"].env == {"MOE_L2_PREDICTOR_URLS": "http://127.0.0.1:11437", ADMIN_TOKEN_ENV: "t0k3n"}

    def fields(specs: list[ServiceSpec]) -> list[tuple]:
        return [(s.name, s.argv, s.env, s.url, s.start_timeout_s, s.required) for s in specs]

    assert fields(stack_services(StackSettings(), MODEL, BINARY, llama_replicas=1)) == fields(
        stack_services(StackSettings(), MODEL, BINARY)
    )


def test_llama_reads_the_hit_curve_its_cache_manager_wrote(
    stack_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The cache-manager writes the hit curve of the model's routing into the state folder; llama's auto
    placement reads it from the next start on (the shipped one until then, or when it does not parse); the
    user's MOE_L2_LLAMA_HIT_CURVE wins."""
    for name in ("MOE_L2_LLAMA_HIT_CURVE", "MOE_L2_CACHE_HIT_CURVE_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MOE_L2_LLAMA_EXPERT_CACHE_BYTES", "auto")  # a GPU build's default under `up`
    settings = StackSettings()
    learned = settings.hit_curve_file(MODEL)
    assert learned.is_relative_to(settings.state_dir)

    def start() -> dict[str, str]:
        specs = by_name(stack_services(settings, MODEL, BINARY))
        assert specs["cache-manager"].env["MOE_L2_CACHE_HIT_CURVE_PATH"] == str(learned)
        return specs["llama"].env

    assert start()["LLAMA_ARG_MOE_CACHE_HIT_CURVE"] == str(DEFAULT_HIT_CURVE)  # none written yet
    learned.parent.mkdir(parents=True)
    write_hit_curve(learned, [(0.5, 0.7), (1.0, 1.0)])  # as the cache-manager writes it
    assert start()["LLAMA_ARG_MOE_CACHE_HIT_CURVE"] == str(learned)
    learned.write_text("0.5 0.7\n")  # one point: llama-server would refuse it
    assert start()["LLAMA_ARG_MOE_CACHE_HIT_CURVE"] == str(DEFAULT_HIT_CURVE)
    assert (
        f"the cache-manager's hit curve is not used ({learned}: a hit curve needs at least 2" in capsys.readouterr().err
    )
    monkeypatch.setenv("MOE_L2_LLAMA_HIT_CURVE", str(tmp_path / "mine.txt"))
    assert start()["LLAMA_ARG_MOE_CACHE_HIT_CURVE"] == str(tmp_path / "mine.txt")
    # a fixed budget reads no curve: nothing in llama's environment
    monkeypatch.setenv("MOE_L2_LLAMA_EXPERT_CACHE_BYTES", "4G")
    assert "LLAMA_ARG_MOE_CACHE_HIT_CURVE" not in start()
    # another model, another curve
    assert StackSettings().hit_curve_file(Path("/models/other.gguf")) != learned


def test_three_replicas(stack_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_L2_LLAMA_PORT", "20000")
    monkeypatch.setenv("MOE_L2_CACHE_PORT", "21000")
    specs = stack_services(StackSettings(), MODEL, BINARY, "t0k3n", llama_replicas=3)
    assert [s.name for s in specs] == [
        "redis",
        *("llama-1", "cache-manager-1", "llama-2", "cache-manager-2", "llama-3", "cache-manager-3"),
        "predictor",
        "proxy",
    ]
    named = by_name(specs)
    llamas = [named[f"llama-{i}"] for i in (1, 2, 3)]
    caches = [named[f"cache-manager-{i}"] for i in (1, 2, 3)]
    assert [arg(s, "--port") for s in llamas] == ["20000", "20100", "20200"]
    assert [s.url for s in llamas] == [f"http://127.0.0.1:{p}/v1" for p in (20000, 20100, 20200)]
    assert all(s.required for s in llamas) and not any(s.required for s in caches)
    assert all(s.env["LLAMA_ARG_MOE_ADMIN_TOKEN"] == "t0k3n" for s in llamas)
    # each cache-manager on its own port, paired with its own llama, all on the same Redis and model
    assert [s.url for s in caches] == [f"http://127.0.0.1:{p}" for p in (21000, 21100, 21200)]
    assert [s.env["MOE_L2_CACHE_PORT"] for s in caches] == ["21000", "21100", "21200"]
    assert [s.env["MOE_L2_LLAMA_URL"] for s in caches] == [f"http://127.0.0.1:{p}" for p in (20000, 20100, 20200)]
    assert {s.env["MOE_L2_REDIS_URL"] for s in caches} == {"redis://127.0.0.1:6379/0"}
    assert {s.env["MOE_L2_MODEL_PATH"] for s in caches} == {str(MODEL)}
    assert {s.env["MOE_L2_CACHE_HOT_SET_SCOPE"] for s in caches} == {"traffic"}
    # the same tables in every cache-manager: the first writes the hit curve every llama reads
    assert [s.env.get("MOE_L2_CACHE_HIT_CURVE_PATH") for s in caches] == [
        str(StackSettings().hit_curve_file(MODEL)),
        None,
        None,
    ]
    # the gateway: both lists, paired by position
    proxy = named["proxy"].env
    assert proxy["MOE_L2_LLAMA_URLS"] == "http://127.0.0.1:20000,http://127.0.0.1:20100,http://127.0.0.1:20200"
    assert proxy["MOE_L2_CACHE_URLS"] == "http://127.0.0.1:21000,http://127.0.0.1:21100,http://127.0.0.1:21200"
    pairs = zip(proxy["MOE_L2_LLAMA_URLS"].split(","), proxy["MOE_L2_CACHE_URLS"].split(","), strict=True)
    for (llama_url, cache_url), cache in zip(pairs, caches, strict=True):
        assert cache.url == cache_url and cache.env["MOE_L2_LLAMA_URL"] == llama_url


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_replica_base() -> int:
    """A free port whose replica ports (+100, +200) are free too: free_port() vouches for the first alone,
    and in one CI run (2026-12-04) +100 was taken by another process, so the test saw llama-2's port busy
    before llama-3's."""
    for _ in range(50):
        base = free_port()
        if base + 200 < 65536 and bindable(base + 100) and bindable(base + 200):
            return base
    raise AssertionError("no free port with free replica ports in 50 tries")


def test_check_ports_covers_every_replica(stack_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    base = free_replica_base()
    monkeypatch.setenv("MOE_L2_LLAMA_PORT", str(base))
    for name in ("MOE_L2_CACHE_PORT", "MOE_L2_PROXY_PORT", "MOE_L2_PREDICTOR_PORT", "MOE_L2_REDIS_PORT"):
        monkeypatch.setenv(name, str(free_port()))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", base + 200))  # where llama-3 would listen
        busy.listen()
        specs = stack_services(StackSettings(), MODEL, BINARY, llama_replicas=3)
        with pytest.raises(SupervisorError, match=rf"llama-3: port {base + 200} on 127.0.0.1 is already in use"):
            check_ports(specs)
    # two replicas of different services on one port: said before anything starts
    monkeypatch.setenv("MOE_L2_CACHE_PORT", str(base + 100))
    with pytest.raises(SupervisorError, match=f"llama-2 and cache-manager-1 would both listen on port {base + 100}"):
        check_ports(stack_services(StackSettings(), MODEL, BINARY, llama_replicas=2))


def test_replica_count_from_the_option_or_the_environment(
    stack_env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parse_args([]).llama_replicas == 1
    assert parse_args(["--llama-replicas", "4"]).llama_replicas == 4
    monkeypatch.setenv("MOE_L2_LLAMA_REPLICAS", "3")
    assert default_replica_count() == 3
    assert parse_args([]).llama_replicas == 3
    assert parse_args(["--llama-replicas", "2"]).llama_replicas == 2  # the option wins
    assert parse_replica_count(MAX_REPLICAS) == 16


@pytest.mark.parametrize("bad", ["0", "17", "-1", "two", "1.5", ""])
def test_bad_replica_counts_are_one_clear_error(
    bad: str, stack_env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--llama-replicas", bad])
    assert exit_.value.code == 2
    assert f"argument --llama-replicas: must be a whole number from 1 to 16, not {bad!r}" in capsys.readouterr().err
    if not bad:
        return  # an empty variable means unset
    monkeypatch.setenv("MOE_L2_LLAMA_REPLICAS", bad)
    with pytest.raises(SystemExit) as exit_:
        parse_args([])
    assert exit_.value.code == 2
    assert "MOE_L2_LLAMA_REPLICAS=" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"between 1 and 16|not a whole number"):
        parse_replica_count(bad)


def test_replica_ports_past_65535_are_refused(stack_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_L2_LLAMA_PORT", "65000")
    with pytest.raises(ValueError, match="lower MOE_L2_LLAMA_PORT"):
        stack_services(StackSettings(), MODEL, BINARY, llama_replicas=16)


def _free_pair() -> int:
    """A free port whose neighbour 100 up is free too (replica 2's)."""
    while True:
        port = free_port()
        if port + 100 <= 65535 and not port_in_use("127.0.0.1", port + 100):
            return port


def _children(up_pid: int, marker: str) -> list[dict[bytes, bytes]]:
    """The environment of every child of `up` whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if int(fields[1]) != up_pid or fields[0] == "Z" or marker.encode() not in b" ".join(argv[:3]):
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        found.append(dict(item.split(b"=", 1) for item in environ if b"=" in item))
    return found


@pytest.mark.llama
def test_up_with_two_llama_replicas(llama_binary: Path, tmp_path: Path) -> None:
    llama, cache = _free_pair(), _free_pair()
    token = "replicas-test-token"
    env = {
        **os.environ,
        "MOE_L2_LLAMA_PORT": str(llama),
        "MOE_L2_CACHE_PORT": str(cache),
        "MOE_L2_REDIS_PORT": str(free_port()),
        "MOE_L2_PROXY_PORT": str(free_port()),
        "MOE_L2_PREDICTOR_PORT": str(free_port()),
        "MOE_L2_STATE_DIR": str(tmp_path / "state"),
        "MOE_L2_LLAMA_PARALLEL": "1",
        "MOE_L2_CACHE_PULL_INTERVAL_S": "0",  # the pulls below are the only ones
        ADMIN_TOKEN_ENV: token,
    }
    for name in ("MOE_L2_MODEL_PATH", "MODEL", "MOE_L2_LLAMA_REPLICAS", "MOE_L2_LLAMA_URLS", "MOE_L2_CACHE_URLS"):
        env.pop(name, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_l2_ops.cli", "up", "--llama-replicas", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    llama_urls = [f"http://127.0.0.1:{llama}", f"http://127.0.0.1:{llama + 100}"]
    cache_urls = [f"http://127.0.0.1:{cache}", f"http://127.0.0.1:{cache + 100}"]
    try:
        output = "".join(wait_for_line(proc, "Ctrl-C stops everything", timeout_s=600))
        for i in (0, 1):  # every replica listed
            assert re.search(rf"^  llama-{i + 1} +{llama_urls[i]}/v1$", output, re.M), output
            assert re.search(rf"^  cache-manager-{i + 1} {cache_urls[i]}$", output, re.M), output
        for url in llama_urls:
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        for url in cache_urls:
            assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200

        # each cache-manager is told its own llama; the gateway both lists, in the same order
        caches = _children(proc.pid, "moe_l2_cache")
        assert sorted((e[b"MOE_L2_CACHE_PORT"], e[b"MOE_L2_LLAMA_URL"]) for e in caches) == sorted(
            (str(p).encode(), u.encode()) for p, u in zip((cache, cache + 100), llama_urls, strict=True)
        )
        [proxy] = _children(proc.pid, "moe_l2_proxy")
        assert proxy[b"MOE_L2_LLAMA_URLS"] == ",".join(llama_urls).encode()
        assert proxy[b"MOE_L2_CACHE_URLS"] == ",".join(cache_urls).encode()

        # and it acts on it: tokens served by llama-2 reach cache-manager-2's pull, not cache-manager-1's
        resp = httpx.post(
            f"{llama_urls[1]}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "what is the integral"}], "max_tokens": 4},
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        headers = {ADMIN_TOKEN_HEADER: token}
        pulled = [httpx.post(f"{url}/v1/pull", headers=headers, timeout=30).json() for url in cache_urls]
        assert pulled[0]["ok"] and pulled[0]["tokens"] == 0, pulled
        assert pulled[1]["ok"] and pulled[1]["tokens"] > 0, pulled

        # `moe-l2 stats` told the replicas: each scraped, a row each (today's gateway reports none)
        result = subprocess.run(
            [sys.executable, "-m", "moe_l2_ops.cli", "stats", "--json", "--sample", "0"],
            capture_output=True,
            text=True,
            env={**env, "MOE_L2_LLAMA_URLS": ",".join(llama_urls), "MOE_L2_CACHE_URLS": ",".join(cache_urls)},
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        doc = json.loads(result.stdout)
        assert all(doc["services"][name] for name in ("llama-1", "llama-2", "cache-manager-1", "cache-manager-2"))
        assert [(r["replica"], r["reachable"]) for r in doc["replicas"]] == [
            (f"127.0.0.1:{llama}", True),
            (f"127.0.0.1:{llama + 100}", True),
        ]

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.terminate()  # lets `up` stop its children
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for port in (llama, llama + 100, cache, cache + 100):
        assert not port_in_use("127.0.0.1", port)
