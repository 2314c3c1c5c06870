"""`moe-l2 doctor` before the stack is started, and once anything of it runs.

Nothing runs: one `stack` line rather than a failure per service, the machine's checks kept, exit 0
unless the machine itself fails. Anything answers, or a `moe-l2 up` is alive: every check, as before.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from moe_l2_ops import doctor
from moe_l2_ops.doctor import Check
from moe_l2_ops.supervisor import free_port

SERVICE_CHECKS = {"redis", "proxy", "llama", "cache-manager", "predictor", "expert cache", "admin calls"}
MACHINE_CHECKS = ["python", "packages", "llama-server", "model", "gpu", "memlock", "/dev/shm", "disk"]


@pytest.fixture
def stack_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Every service's URL at a port where nothing listens, and an empty state folder."""
    for key in [k for k in os.environ if k.startswith("MOE_L2_")]:
        monkeypatch.delenv(key)
    ports = {name: free_port() for name in ("proxy", "llama", "predictor", "cache", "redis")}
    for name in ("proxy", "llama", "cache"):
        monkeypatch.setenv(f"MOE_L2_{name.upper()}_URL", f"http://127.0.0.1:{ports[name]}")
    monkeypatch.setenv("MOE_L2_PREDICTOR_URLS", f"http://127.0.0.1:{ports['predictor']}")
    monkeypatch.setenv("MOE_L2_REDIS_URL", f"redis://127.0.0.1:{ports['redis']}/0")
    monkeypatch.setenv("MOE_L2_OPS_TIMEOUT_S", "1")
    monkeypatch.setenv("MOE_L2_STATE_DIR", str(tmp_path / "state"))
    return ports


@pytest.fixture
def healthy_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine's checks all pass, so the exit status depends on the stack's alone."""
    monkeypatch.setattr(doctor, "machine_checks", lambda settings, model: [Check("python", "pass", "stand-in")])


@contextlib.contextmanager
def _serve_health(port: int) -> Iterator[None]:
    """Something that answers 200 on every path at `port`."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def _write_state(stack_env: dict[str, int], pid: int, state: str) -> None:
    folder = Path(os.environ["MOE_L2_STATE_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    services = {"redis": {"state": state, "restarts": 0, "pid": pid, "log": "/x.log"}}
    doc = {"version": 1, "pid": pid, "started_at": 0, "updated_at": 0, "services": services}
    (folder / "services.json").write_text(json.dumps(doc))


def _run(capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, dict[str, str]]]:
    rc = doctor.main(["--json"])
    return rc, {c["name"]: c for c in json.loads(capsys.readouterr().out)}


def test_before_up_one_line_says_the_stack_is_not_running(
    stack_env: dict[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    checks = doctor.run_checks(doctor.OpsSettings(), None)
    names = [c.name for c in checks]
    assert names[: len(MACHINE_CHECKS)] == MACHINE_CHECKS  # what is meaningful before up is still checked
    assert not SERVICE_CHECKS & set(names), names
    stack = [c for c in checks if c.name == "stack"]
    assert len(stack) == 1 and stack[0].status == "warn"
    assert stack[0].detail.startswith("not running (start it with `moe-l2 up` or `make run`)")
    assert f"proxy 127.0.0.1:{stack_env['proxy']}" in stack[0].detail  # where doctor looked

    rc = doctor.main([])
    text = capsys.readouterr().out
    assert text.count("not running") == 1 and "FAIL  proxy" not in text
    assert rc == (1 if any(c.status == "fail" for c in checks) else 0)


def test_not_running_alone_is_no_failure(
    stack_env: dict[str, int], healthy_machine: None, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, checks = _run(capsys)
    assert rc == 0 and checks["stack"]["status"] == "warn"


def test_a_failing_machine_check_still_fails_before_up(
    stack_env: dict[str, int], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(doctor, "machine_checks", lambda settings, model: [Check("disk", "fail", "0.1 GiB free")])
    rc, checks = _run(capsys)
    assert rc == 1 and checks["stack"]["status"] == "warn"


def test_one_service_answering_means_every_check_runs(
    stack_env: dict[str, int], healthy_machine: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with _serve_health(stack_env["predictor"]):
        rc, checks = _run(capsys)
    assert "stack" not in checks
    assert checks["predictor"]["status"] == "pass"
    for name in ("proxy", "llama", "cache-manager", "redis"):
        assert checks[name]["status"] == "fail", checks[name]
    assert "admin calls" in checks and rc == 1


def test_a_live_moe_l2_up_means_every_check_runs(
    stack_env: dict[str, int], healthy_machine: None, capsys: pytest.CaptureFixture[str]
) -> None:
    # `moe-l2 up` alive (this process's pid) while nothing answers yet: it is starting, or its services are down
    _write_state(stack_env, os.getpid(), "starting")
    rc, checks = _run(capsys)
    assert "stack" not in checks and rc == 1
    assert checks["proxy"]["status"] == "fail" and "unreachable" in checks["proxy"]["detail"]
    assert checks["supervisor"]["status"] == "warn"


def test_an_unclean_end_is_reported_before_a_start(
    stack_env: dict[str, int], healthy_machine: None, capsys: pytest.CaptureFixture[str]
) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write_state(stack_env, int(gone.stdout), "running")
    rc, checks = _run(capsys)
    assert checks["stack"]["status"] == "warn"
    assert checks["supervisor"]["status"] == "warn" and "may still run" in checks["supervisor"]["detail"]
    assert rc == 0
