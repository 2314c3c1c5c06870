"""The supervisor's restarts (issue #11 item 4), on small real HTTP server processes.

Each behaviour of the restart loop is driven here step by step with processes that crash, hang or
start slowly on demand; tests/test_restarts.py kills the real stack's services under traffic.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from moe_l2_ops.supervisor import (
    LogRotation,
    RestartPolicy,
    RunningService,
    ServiceLog,
    ServiceSpec,
    Supervisor,
    SupervisorError,
    free_port,
    http_ok,
    port_in_use,
    read_state,
)

# A tiny service. Its first start serves at once; later starts (a marker file counts them) do what
# `later` says: serve, crash (exit 3), hang (never listen), or sleep N seconds before serving.
FAKE = textwrap.dedent(
    """
    import http.server, pathlib, sys, time
    port, marker, later = int(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
    starts = int(marker.read_text()) + 1 if marker.exists() else 1
    marker.write_text(str(starts))
    print(f"start {starts}", flush=True)
    if starts > 1:
        kind, _, arg = later.partition(":")
        if kind == "crash" and (not arg or starts <= 1 + int(arg)):
            sys.exit(3)
        if kind == "hang":
            time.sleep(3600)
        if kind == "slow":
            time.sleep(float(arg))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)

FAST = RestartPolicy(delay_s=0.1, max_delay_s=0.4, reset_after_s=60, max_failures=5, window_s=60, probe_interval_s=0.1)


def fake(
    tmp_path: Path, name: str, later: str = "serve", *, required: bool = True, timeout_s: float = 20
) -> ServiceSpec:
    port = free_port()
    return ServiceSpec(
        name=name,
        argv=[sys.executable, "-c", FAKE, str(port), str(tmp_path / f"{name}.starts"), later],
        health=http_ok(f"http://127.0.0.1:{port}/healthz", timeout_s=1),
        url=f"http://127.0.0.1:{port}",
        start_timeout_s=timeout_s,
        required=required,
    )


class Lines(list[str]):
    def __call__(self, line: str) -> None:
        self.append(line)


def drive(sup: Supervisor, until: Callable[[], bool], timeout_s: float = 30) -> None:
    """Runs the supervisor's watch loop, one step at a time, until the condition holds."""
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, f"not reached in {timeout_s}s: {[s.snapshot() for s in sup.running]}"
        sup.step()
        time.sleep(0.05)


def svc(sup: Supervisor, name: str) -> RunningService:
    return next(s for s in sup.running if s.spec.name == name)


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie child of ours would still answer: its state in /proc says
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def supervisors() -> Iterator[Callable[..., Supervisor]]:
    made: list[Supervisor] = []

    def make(tmp_path: Path, echo: Callable[[str], None] | None = None, policy: RestartPolicy = FAST) -> Supervisor:
        sup = Supervisor(
            tmp_path / "logs", Lines() if echo is None else echo, policy=policy, state_path=tmp_path / "services.json"
        )
        made.append(sup)
        return sup

    yield make
    for sup in made:
        sup.stop(timeout_s=5)


def test_a_killed_service_comes_back_health_checked(tmp_path: Path, supervisors: Callable[..., Supervisor]) -> None:
    lines = Lines()
    sup = supervisors(tmp_path, lines)
    # its restart takes 1.5 s before it listens: it must be "starting", not "running", until then
    slow, other = sup.start(fake(tmp_path, "slow", "slow:1.5")), sup.start(fake(tmp_path, "other"))
    first_pid, other_pid = slow.proc.pid, other.proc.pid
    os.kill(first_pid, signal.SIGKILL)
    killed_at = time.monotonic()

    seen_starting_unhealthy = False

    def back() -> bool:
        nonlocal seen_starting_unhealthy
        if slow.state == "starting" and slow.proc.pid != first_pid and not slow.spec.health():
            seen_starting_unhealthy = True
        return slow.restarts == 1 and slow.state == "running"

    drive(sup, back)
    assert time.monotonic() - killed_at >= 1.5, "declared running before it could answer"
    assert seen_starting_unhealthy
    assert slow.proc.pid != first_pid and slow.spec.health() and slow.restarts == 1
    assert other.proc.pid == other_pid and other.state == "running" and other.restarts == 0
    assert any("slow was killed by SIGKILL; restarting it in 0.1s (restart 1)" in line for line in lines), lines
    assert any(line.startswith("slow is back (restart 1, healthy ") for line in lines), lines

    state = read_state(tmp_path / "services.json")
    assert state is not None and state["live"] and state["pid"] == os.getpid()
    entry = state["services"]["slow"]
    assert (entry["state"], entry["restarts"], entry["pid"], entry["last_exit"]) == (
        "running",
        1,
        slow.proc.pid,
        -signal.SIGKILL,
    )
    assert entry["last_failure"] == "was killed by SIGKILL" and entry["last_recovery_s"] >= 1.5
    assert state["services"]["other"]["restarts"] == 0
    log = (tmp_path / "logs" / "slow.log").read_text()
    assert "restart 1 of slow (was killed by SIGKILL)" in log and "start 2" in log


def test_one_restart_does_not_hold_up_another(tmp_path: Path, supervisors: Callable[..., Supervisor]) -> None:
    sup = supervisors(tmp_path)
    slow, quick = sup.start(fake(tmp_path, "slow", "slow:6")), sup.start(fake(tmp_path, "quick"))
    os.kill(slow.proc.pid, signal.SIGKILL)
    drive(sup, lambda: slow.state == "starting")
    os.kill(quick.proc.pid, signal.SIGKILL)
    drive(sup, lambda: quick.state == "running" and quick.restarts == 1)
    assert slow.state == "starting", "the quick service waited for the slow one's restart"
    drive(sup, lambda: slow.state == "running")


def test_a_restart_that_never_gets_healthy_is_a_failure(tmp_path: Path, supervisors: Callable[..., Supervisor]) -> None:
    lines = Lines()
    policy = RestartPolicy(delay_s=0.1, max_delay_s=0.1, max_failures=3, window_s=60, probe_interval_s=0.1)
    sup = supervisors(tmp_path, lines, policy)
    hung = sup.start(fake(tmp_path, "hung", "hang", required=False, timeout_s=1.5))
    os.kill(hung.proc.pid, signal.SIGKILL)
    drive(sup, lambda: hung.state == "failed")
    assert hung.restarts == 2
    assert sum("was not healthy 1.5s after its start" in line for line in lines) == 2, lines
    assert pid_gone(hung.proc.pid), "the hung process was left running"


def test_crash_loop_of_an_optional_service_leaves_the_stack_serving(
    tmp_path: Path, supervisors: Callable[..., Supervisor]
) -> None:
    lines = Lines()
    sup = supervisors(tmp_path, lines)
    crashy = sup.start(fake(tmp_path, "crashy", "crash", required=False))
    other = sup.start(fake(tmp_path, "other"))
    os.kill(crashy.proc.pid, signal.SIGKILL)
    drive(sup, lambda: crashy.state == "failed")
    # kill -9, then four restarts that exit 3: five failures within the window
    assert crashy.restarts == 4 and crashy.last_exit == 3
    loop_lines = [line for line in lines if "crash loop" in line]
    assert len(loop_lines) == 1, lines
    assert loop_lines[0].startswith("crashy exited with status 3: 5 failures within 60s, a crash loop; not restarting")
    assert "keeps serving without it (degraded)" in loop_lines[0]
    for _ in range(10):  # given up means given up
        sup.step()
        time.sleep(0.05)
    assert crashy.restarts == 4 and other.state == "running" and other.spec.health()
    state = read_state(tmp_path / "services.json")
    assert state is not None
    assert state["services"]["crashy"]["state"] == "failed" and state["services"]["crashy"]["pid"] is None


def test_crash_loop_of_a_required_service_stops_with_one_error(
    tmp_path: Path, supervisors: Callable[..., Supervisor]
) -> None:
    sup = supervisors(tmp_path)
    crashy = sup.start(fake(tmp_path, "crashy", "crash", required=True))
    os.kill(crashy.proc.pid, signal.SIGKILL)
    with pytest.raises(SupervisorError) as info:
        drive(sup, lambda: False)
    first = str(info.value).splitlines()[0]
    assert first.startswith("crashy exited with status 3: 5 failures within 60s, a crash loop")
    assert "the stack cannot serve without crashy, so it stops" in first


def test_backoff_doubles_up_to_its_cap_and_starts_over_after_a_healthy_run(
    tmp_path: Path, supervisors: Callable[..., Supervisor]
) -> None:
    lines = Lines()
    policy = RestartPolicy(delay_s=0.2, max_delay_s=0.8, reset_after_s=1.0, max_failures=10, window_s=60)
    sup = supervisors(tmp_path, lines, policy)
    flaky = sup.start(fake(tmp_path, "flaky", "crash:3"))  # starts 2-4 crash, the 5th serves
    os.kill(flaky.proc.pid, signal.SIGKILL)
    drive(sup, lambda: flaky.state == "running" and flaky.restarts == 4)
    delays = [line.split("restarting it in ")[1].split("s ")[0] for line in lines if "restarting it in" in line]
    assert delays == ["0.2", "0.4", "0.8", "0.8"]
    lines.clear()
    # healthy for longer than reset_after_s, by the supervisor's own record, watched as `watch` would
    drive(sup, lambda: time.monotonic() - (flaky.healthy_at or time.monotonic()) > policy.reset_after_s)
    os.kill(flaky.proc.pid, signal.SIGKILL)
    drive(sup, lambda: flaky.state == "running" and flaky.restarts == 5)
    assert any("restarting it in 0.2s (restart 5)" in line for line in lines), lines


RUNNER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from moe_l2_ops.supervisor import RestartPolicy, ServiceSpec, Supervisor, http_ok
    specs, state = json.loads(sys.argv[1]), Path(sys.argv[2])
    sup = Supervisor(state.parent / "logs", policy=RestartPolicy(delay_s=0.1), state_path=state)
    try:
        for s in specs:
            sup.start(ServiceSpec(s["name"], s["argv"], http_ok(s["url"] + "/healthz"), s["url"]))
        sup.watch()
    except KeyboardInterrupt:
        sup.stop()
    """
)


def test_ctrl_c_during_a_restart_stops_everything(tmp_path: Path) -> None:
    specs = [fake(tmp_path, "steady"), fake(tmp_path, "restarting", "slow:60")]
    state_path = tmp_path / "services.json"
    encoded = json.dumps([{"name": s.name, "argv": s.argv, "url": s.url} for s in specs])
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, encoded, str(state_path)])
    try:

        def services() -> dict:
            state = read_state(state_path)
            return state["services"] if state else {}

        deadline = time.monotonic() + 30
        while [svc.get("state") for svc in services().values()] != ["running", "running"]:
            assert time.monotonic() < deadline and runner.poll() is None
            time.sleep(0.1)
        steady_pid, first_pid = services()["steady"]["pid"], services()["restarting"]["pid"]
        os.kill(first_pid, signal.SIGKILL)
        while not (services()["restarting"]["state"] == "starting" and services()["restarting"]["pid"] != first_pid):
            assert time.monotonic() < deadline and runner.poll() is None
            time.sleep(0.1)
        restarting_pid = services()["restarting"]["pid"]
        runner.send_signal(signal.SIGINT)
        assert runner.wait(timeout=30) == 0
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    for pid in (steady_pid, restarting_pid):
        assert pid_gone(pid), f"process {pid} outlived Ctrl-C"
    assert not any(port_in_use("127.0.0.1", int(s.url.rsplit(":", 1)[1])) for s in specs)
    assert {svc["state"] for svc in services().values()} == {"stopped"}


# --------------------------------------------------------------------------- the logs' rotation

# Writes `lines` numbered 100-byte lines as fast as it can, then how long that took, then waits.
CHATTY = textwrap.dedent(
    """
    import sys, time
    lines, write, pad = int(sys.argv[1]), sys.stdout.buffer.write, b"x" * 89
    started = time.perf_counter()
    for i in range(lines):
        write(b"%09d " % i + pad + b"\\n")
    sys.stdout.flush()
    print(f"done {lines} lines in {time.perf_counter() - started:.2f}s", flush=True)
    time.sleep(3600)
    """
)


def _last_line(path: Path) -> bytes:
    lines = path.read_bytes().rstrip().splitlines()
    return lines[-1] if lines else b""


def _numbered(paths: list[Path]) -> list[int]:
    return [int(line[:9]) for path in paths for line in path.read_bytes().splitlines() if line[:9].isdigit()]


def test_a_chatty_service_log_rotates_without_losing_or_blocking(
    tmp_path: Path, supervisors: Callable[..., Supervisor]
) -> None:
    rotation = LogRotation(max_bytes=1 << 20, backups=2)
    sup = supervisors(tmp_path)
    sup.log_rotation = rotation
    lines = 60_000  # 6 MB through a 1 MiB limit: five rotations, the oldest files dropped
    spec = ServiceSpec("chatty", [sys.executable, "-c", CHATTY, str(lines)], health=lambda: True, url="-")
    chatty = sup.start(spec)
    current = chatty.log_path
    # no step() of the supervisor's loop meanwhile: the readers drain the pipe on their own
    deadline = time.monotonic() + 60
    while not _last_line(current).startswith(b"done"):
        assert time.monotonic() < deadline, f"the child did not get its {lines} lines out: {current.stat().st_size}"
        assert chatty.proc.poll() is None
        time.sleep(0.1)

    files = [current.with_name("chatty.log.2"), current.with_name("chatty.log.1"), current]
    sizes = [f.stat().st_size for f in files]
    assert not current.with_name("chatty.log.3").exists()
    assert all(0 < size <= rotation.max_bytes for size in sizes), sizes
    # oldest to newest, the kept lines follow each other without a gap and end with the last one written
    kept = _numbered(files)
    assert kept == list(range(lines - len(kept), lines)), (kept[:3], kept[-3:], len(kept))
    assert len(kept) * 100 > 2 * rotation.max_bytes  # two full old files and the current one
    assert current.read_text().splitlines()[-1].startswith(f"done {lines} lines in ")


def test_a_restart_marker_follows_the_dead_process_last_lines(
    tmp_path: Path, supervisors: Callable[..., Supervisor]
) -> None:
    sup = supervisors(tmp_path)
    flaky = sup.start(fake(tmp_path, "flaky", "crash:1"))  # start 2 prints its line and exits 3, start 3 serves
    os.kill(flaky.proc.pid, signal.SIGKILL)
    drive(sup, lambda: flaky.state == "running" and flaky.restarts == 2)
    log = [line for line in flaky.log_path.read_text().splitlines() if line]
    assert log == [
        "start 1",
        "---- moe-l2: restart 1 of flaky (was killed by SIGKILL) ----",
        "start 2",
        "---- moe-l2: restart 2 of flaky (exited with status 3) ----",
        "start 3",
    ]


def test_a_first_start_that_dies_shows_its_last_lines(tmp_path: Path, supervisors: Callable[..., Supervisor]) -> None:
    # much output then the reason, at once: the message must wait for the reader to write it all
    code = "import sys\nfor i in range(20000): print('noise', i)\nprint('fatal: bad config')\nsys.exit(2)"
    spec = ServiceSpec("broken", [sys.executable, "-c", code], health=lambda: False, url="-")
    with pytest.raises(SupervisorError) as info:
        supervisors(tmp_path).start(spec)
    message = str(info.value).splitlines()
    assert message[0].startswith("broken exited with status 2; log: ")
    assert message[-2:] == ["    noise 19999", "    fatal: bad config"]


def test_service_log_keeps_bytes_and_cuts_only_overlong_lines(tmp_path: Path) -> None:
    rotation = LogRotation(max_bytes=4096, backups=1)  # one write holds at most 1024 bytes
    log = ServiceLog(tmp_path / "svc.log", rotation)
    read_end, write_end = os.pipe()
    log.attach(os.fdopen(read_end, "rb", buffering=0))
    not_utf8, long_line = b"caf\xc3\xa9 \xff\xfe", b"y" * 1500
    os.write(write_end, not_utf8 + b"\n" + long_line + b"\nno newline at the end")
    os.close(write_end)
    log.close()
    assert (tmp_path / "svc.log").read_bytes() == (
        not_utf8 + b"\n" + long_line[:1024] + b"\n" + long_line[1024:] + b"\nno newline at the end\n"
    )


def test_log_rotation_settings() -> None:
    assert LogRotation().max_bytes == 50 << 20 and LogRotation().backups == 3
    assert LogRotation(max_bytes=0, backups=0).write_limit == 64 * 1024  # 0: never rotated
    with pytest.raises(ValueError, match="at least one old file"):
        LogRotation(max_bytes=1 << 20, backups=0)
    with pytest.raises(ValueError, match=">= 0"):
        LogRotation(max_bytes=-1)


# --------------------------------------------------------------------------- what stats and doctor read


def _state(tmp_path: Path, pid: int, services: dict[str, dict]) -> None:
    (tmp_path / "state").mkdir(exist_ok=True)
    doc = {"version": 1, "pid": pid, "started_at": 0, "updated_at": 0, "services": services}
    (tmp_path / "state" / "services.json").write_text(json.dumps(doc))


def _entry(state: str, restarts: int, failure: str | None = None) -> dict:
    return {"state": state, "restarts": restarts, "pid": 1, "last_failure": failure, "log": "/x.log"}


def test_stats_and_doctor_show_restarts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_l2_ops.doctor import check_supervisor
    from moe_l2_ops.stats import read_supervisor, render_restarts

    monkeypatch.setenv("MOE_L2_STATE_DIR", str(tmp_path / "state"))
    assert read_supervisor() is None and check_supervisor() is None  # not under `moe-l2 up`

    _state(tmp_path, os.getpid(), {"redis": _entry("running", 0), "llama": _entry("running", 0)})
    check = check_supervisor()
    assert check is not None and check.status == "pass"
    assert check.detail == "redis running, 0 restarts; llama running, 0 restarts"

    killed = "was killed by SIGKILL"
    _state(tmp_path, os.getpid(), {"redis": _entry("running", 0), "predictor": _entry("running", 2, killed)})
    supervised = read_supervisor()
    assert supervised is not None and supervised["predictor"]["restarts"] == 2
    assert render_restarts(supervised) == f"redis 0, predictor 2 (last: {killed})"
    check = check_supervisor()
    assert (
        check is not None
        and check.status == "warn"
        and f"predictor running, 2 restarts (last: {killed}" in check.detail
    )

    crash = "exited with status 3"
    _state(tmp_path, os.getpid(), {"redis": _entry("running", 0), "predictor": _entry("failed", 4, crash)})
    assert render_restarts(read_supervisor() or {}) == f"redis 0, predictor 4 FAILED (last: {crash})"
    check = check_supervisor()
    assert check is not None and check.status == "fail" and "crash loop" in check.detail

    # a state file whose `moe-l2 up` is gone: no figures; doctor warns only if it did not stop cleanly
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    _state(tmp_path, dead_pid, {"redis": _entry("stopped", 0)})
    assert read_supervisor() is None and check_supervisor() is None
    _state(tmp_path, dead_pid, {"redis": _entry("running", 0)})
    check = check_supervisor()
    assert check is not None and check.status == "warn" and "may still run" in check.detail


# --------------------------------------------------------------------------- the gateway's drain at a stop

# Serves until SIGTERM, then "drains": takes `drain` seconds to exit, writing a marker once drained (a
# process killed during its drain never writes it).
DRAINING = textwrap.dedent(
    """
    import http.server, pathlib, signal, sys, threading, time
    port, marker, drain = int(sys.argv[1]), pathlib.Path(sys.argv[2]), float(sys.argv[3])

    def on_term(*_):
        def finish():
            time.sleep(drain)
            marker.write_text("drained")
            sys.stdout.flush()
            import os
            os._exit(0)
        threading.Thread(target=finish, daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


def draining(tmp_path: Path, drain_s: float, stop_timeout_s: float | None) -> ServiceSpec:
    port = free_port()
    return ServiceSpec(
        name="gateway",
        argv=[sys.executable, "-c", DRAINING, str(port), str(tmp_path / "drained"), str(drain_s)],
        health=http_ok(f"http://127.0.0.1:{port}/healthz", timeout_s=1),
        url=f"http://127.0.0.1:{port}",
        stop_timeout_s=stop_timeout_s,
    )


def test_a_stop_gives_a_service_its_own_grace_beyond_the_default(
    tmp_path: Path, supervisors: Callable[..., Supervisor]
) -> None:
    """The gateway drains for MOE_L2_PROXY_DRAIN_S after SIGTERM: the stop waits its `stop_timeout_s`, longer
    than the stop's own timeout, rather than killing it with its streams."""
    sup = supervisors(tmp_path)
    sup.start(draining(tmp_path, drain_s=2.0, stop_timeout_s=6.0))
    proc = svc(sup, "gateway").proc
    sup.stop(timeout_s=0.5)
    assert (tmp_path / "drained").read_text() == "drained"
    assert proc.returncode == 0  # it exited by itself, not by SIGKILL


def test_a_second_interrupt_during_the_stop_kills_what_is_left_at_once(tmp_path: Path) -> None:
    spec = draining(tmp_path, drain_s=60.0, stop_timeout_s=120.0)
    state_path = tmp_path / "services.json"
    runner_code = RUNNER.replace(
        'http_ok(s["url"] + "/healthz"), s["url"])', 'http_ok(s["url"] + "/healthz"), s["url"], stop_timeout_s=120)'
    )
    encoded = json.dumps([{"name": spec.name, "argv": spec.argv, "url": spec.url}])
    runner = subprocess.Popen([sys.executable, "-c", runner_code, encoded, str(state_path)])
    try:
        deadline = time.monotonic() + 30
        while ((read_state(state_path) or {}).get("services") or {}).get("gateway", {}).get("state") != "running":
            assert time.monotonic() < deadline and runner.poll() is None
            time.sleep(0.1)
        pid = (read_state(state_path) or {})["services"]["gateway"]["pid"]
        runner.send_signal(signal.SIGINT)  # the stop starts: SIGTERM, the 60 s drain begins
        time.sleep(1.0)
        assert runner.poll() is None, "the stop did not wait for the drain"
        runner.send_signal(signal.SIGINT)  # impatient: no more waiting
        assert runner.wait(timeout=15) == 0
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    assert pid_gone(pid)
    assert not (tmp_path / "drained").exists()
    assert {svc["state"] for svc in read_state(state_path)["services"].values()} == {"stopped"}
