"""`moe-l2 up` (what `make run` calls): the demo stack comes up, answers, and stops on Ctrl-C; the
admin token it creates and hands to every service. Restarts: tests/test_restarts.py."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from moe_l2_contracts.admin import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE_ENV
from moe_l2_ops.stack import StackSettings, stack_admin_token, stack_services
from moe_l2_ops.supervisor import free_port, port_in_use
from tests.test_restarts import service_pids


def wait_for_line(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line)
        if marker in line:
            return lines
    raise AssertionError(f"{marker!r} not printed; output so far: {''.join(lines)}")


@pytest.mark.llama
def test_up_serves_the_demo_model_and_stops_cleanly(llama_binary: Path, tmp_path: Path) -> None:
    llama_port, redis_port, proxy_port = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "MOE_L2_LLAMA_PORT": str(llama_port),
        "MOE_L2_REDIS_PORT": str(redis_port),
        "MOE_L2_PROXY_PORT": str(proxy_port),
        "MOE_L2_CACHE_PORT": str(free_port()),
        "MOE_L2_PREDICTOR_PORT": str(free_port()),
        "MOE_L2_STATE_DIR": str(tmp_path / "state"),
        "MOE_L2_LLAMA_PARALLEL": "2",
        # the flywheel's pulls would reset llama's routing counts under this test's feet
        "MOE_L2_CACHE_PULL_INTERVAL_S": "0",
    }
    env.pop("MOE_L2_MODEL_PATH", None)
    env.pop("MODEL", None)
    env.pop(ADMIN_TOKEN_ENV, None)  # so `up` creates the state folder's token
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_l2_ops.cli", "up"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        # as when a shell starts it in the background: SIGINT ignored, Ctrl-C must still work
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        output = "".join(wait_for_line(proc, "Ctrl-C stops everything", timeout_s=600))
        assert f"http://127.0.0.1:{llama_port}/v1" in output
        assert f"redis://127.0.0.1:{redis_port}/0" in output
        assert (tmp_path / "state" / "models" / "moe-l2-demo-seed0.gguf").is_file()

        # the admin token: created private at the first start, in every service's environment
        token_file = tmp_path / "state" / "admin-token"
        assert f"admin token    {token_file}" in output
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        children = service_pids(proc.pid)
        assert set(children) == {"redis", "llama", "cache-manager", "predictor", "proxy"}
        for name, pid in children.items():
            if name == "redis":
                continue  # it writes its process title over its environment block; it makes no admin calls
            environ = dict(
                item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item
            )
            assert environ.get(ADMIN_TOKEN_ENV.encode()) == token.encode(), name
            if name == "llama":
                assert environ.get(b"LLAMA_MOE_ADMIN_TOKEN") == token.encode()

        resp = httpx.post(
            f"http://127.0.0.1:{llama_port}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "what is the integral"}], "max_tokens": 8},
            timeout=60,
        )
        assert resp.status_code == 200
        assert resp.json()["choices"][0]["message"]["content"]
        assert httpx.get(f"http://127.0.0.1:{llama_port}/moe/routing", timeout=10).json()["tokens"] > 0

        # and through the gateway, with the domain predicted for it
        resp = httpx.post(
            f"http://127.0.0.1:{proxy_port}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "solve the integral of x squared"}], "max_tokens": 4},
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        assert resp.headers["X-MoE-Domain"] == "math"

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            # SIGTERM lets `up` stop its children; SIGKILL would orphan them
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert not port_in_use("127.0.0.1", llama_port)
    assert not port_in_use("127.0.0.1", redis_port)
    # Redis persisted with AOF into the state folder
    assert any((tmp_path / "state" / "redis").iterdir())


@pytest.mark.llama
def test_up_with_a_missing_model_is_one_clear_line(llama_binary: Path, tmp_path: Path) -> None:
    env = {**os.environ, "MOE_L2_STATE_DIR": str(tmp_path / "state"), "MOE_L2_LLAMA_PORT": str(free_port())}
    result = subprocess.run(
        [sys.executable, "-m", "moe_l2_ops.cli", "up", "--model", str(tmp_path / "nope.gguf")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == f"error: model {tmp_path / 'nope.gguf'} does not exist"


def up_error(model: Path, tmp_path: Path) -> str:
    """`moe-l2 up --model` with a llama-server that does not exist: a check that comes before the build says
    its line first; one after it would say the binary is missing."""
    env = {
        **os.environ,
        "MOE_L2_STATE_DIR": str(tmp_path / "state"),
        "MOE_L2_LLAMA_PORT": str(free_port()),
        "MOE_L2_LLAMA_SERVER": str(tmp_path / "no-such-llama-server"),
    }
    result = subprocess.run(
        [sys.executable, "-m", "moe_l2_ops.cli", "up", "--model", str(model)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    return result.stderr.strip().splitlines()[-1]


def test_up_with_a_dense_model_is_one_line_before_any_build(tmp_path: Path) -> None:
    from tests.cache.gguf_models import build_dense

    dense = build_dense(tmp_path).path
    assert up_error(dense, tmp_path) == (
        f"error: model {dense} is a dense model (no routed experts): moe-l2 keeps a mixture-of-experts model's "
        "experts in host memory and has nothing to place for it; serve it with llama-server directly"
    )


def test_up_with_a_file_that_is_not_gguf_is_one_line_before_any_build(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    line = up_error(text, tmp_path)
    assert line.startswith(f"error: model {text} cannot be read as a GGUF model: "), line


@pytest.fixture
def no_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No admin token in the environment; the state folder in tmp_path. Returns the token file's path."""
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    monkeypatch.delenv(ADMIN_TOKEN_FILE_ENV, raising=False)
    monkeypatch.setenv("MOE_L2_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state" / "admin-token"


def test_admin_token_is_created_private_and_kept_across_starts(no_token: Path) -> None:
    token = stack_admin_token(StackSettings())
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    assert no_token.read_text().strip() == token
    assert stat.S_IMODE(no_token.stat().st_mode) == 0o600
    written = no_token.stat().st_mtime_ns
    assert stack_admin_token(StackSettings()) == token  # the next `moe-l2 up`
    assert no_token.stat().st_mtime_ns == written


def test_admin_token_from_the_environment_wins(no_token: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "given-by-the-user")
    assert stack_admin_token(StackSettings()) == "given-by-the-user"
    assert not no_token.exists(), "a token file was created although MOE_L2_ADMIN_TOKEN is set"
    monkeypatch.delenv(ADMIN_TOKEN_ENV)
    elsewhere = no_token.parent.parent / "secret"
    elsewhere.write_text("from-a-file\n")
    monkeypatch.setenv(ADMIN_TOKEN_FILE_ENV, str(elsewhere))
    assert stack_admin_token(StackSettings()) == "from-a-file"
    assert not no_token.exists()


def test_every_service_gets_the_admin_token(no_token: Path) -> None:
    specs = stack_services(StackSettings(), Path("/nonexistent.gguf"), Path("/bin/true"), admin_token="t0k3n")
    assert [s.name for s in specs] == ["redis", "llama", "cache-manager", "predictor", "proxy"]
    for spec in specs:
        assert spec.env[ADMIN_TOKEN_ENV] == "t0k3n", spec.name
    llama = next(s for s in specs if s.name == "llama")
    assert llama.env["LLAMA_MOE_ADMIN_TOKEN"] == "t0k3n"


def test_stack_restart_roles(no_token: Path) -> None:
    """Which services a crash loop may leave behind (degraded) and which stop the stack; Redis
    acknowledges a count only once it is on disk."""
    specs = {s.name: s for s in stack_services(StackSettings(), Path("/nonexistent.gguf"), Path("/bin/true"))}
    assert {name for name, s in specs.items() if s.required} == {"redis", "llama", "proxy"}
    argv = specs["redis"].argv
    assert argv[argv.index("--appendonly") + 1] == "yes"
    assert argv[argv.index("--appendfsync") + 1] == "always"


def test_doctor_checks_the_admin_token(no_token: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_l2_ops.doctor import check_admin_token

    check = check_admin_token()
    assert check.status == "warn" and f"`moe-l2 up` creates {no_token}" in check.detail
    token = stack_admin_token(StackSettings())  # what `moe-l2 up` does at its first start
    check = check_admin_token()
    assert (check.status, check.detail) == ("pass", f"{no_token} (the token `moe-l2 up` created), mode 0600")
    no_token.chmod(0o644)
    check = check_admin_token()
    assert check.status == "fail" and "mode 0644: others can read it; chmod 600 it" in check.detail
    assert token not in check.detail
    monkeypatch.setenv(ADMIN_TOKEN_FILE_ENV, str(no_token.parent / "missing"))
    check = check_admin_token()
    assert check.status == "fail" and "cannot read the admin token file" in check.detail
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "from-the-environment")
    assert (check_admin_token().status, check_admin_token().detail) == ("pass", f"from {ADMIN_TOKEN_ENV}")
