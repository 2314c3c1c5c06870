"""`moe-l2 up` (what `make run` calls): the demo stack comes up, answers, and stops on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from moe_l2_common.supervisor import free_port, port_in_use

pytestmark = pytest.mark.llama


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
        "MOE_L2_PARALLEL": "2",
        # the flywheel's pulls would reset llama's routing counts under this test's feet
        "MOE_L2_PULL_INTERVAL_S": "0",
    }
    env.pop("MOE_L2_MODEL_PATH", None)
    env.pop("MODEL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_l2_common.cli", "up"],
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


def test_up_with_a_missing_model_is_one_clear_line(llama_binary: Path, tmp_path: Path) -> None:
    env = {**os.environ, "MOE_L2_STATE_DIR": str(tmp_path / "state"), "MOE_L2_LLAMA_PORT": str(free_port())}
    result = subprocess.run(
        [sys.executable, "-m", "moe_l2_common.cli", "up", "--model", str(tmp_path / "nope.gguf")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == f"error: model {tmp_path / 'nope.gguf'} does not exist"
