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


# -- --model: the placement the cost model predicts (moe_l2_placement.here) ---------------------------------


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`moe-l2 make-demo-model`: 8 MoE layers x 32 experts (4 used), a few MiB."""
    path = tmp_path_factory.mktemp("model") / "demo.gguf"
    subprocess.run(
        [sys.executable, "-m", "moe_l2_ops.cli", "make-demo-model", str(path)], check=True, capture_output=True
    )
    return path


def _fake_nvidia_smi(folder: Path, monkeypatch: pytest.MonkeyPatch, rows: str) -> None:
    """An nvidia-smi on PATH that answers the --query-gpu call with `rows` (index, name, total MiB, free MiB)."""
    folder.mkdir(parents=True, exist_ok=True)
    smi = folder / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '%s\\n' {' '.join(repr(r) for r in rows.splitlines())}\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")


def _placement(capsys: pytest.CaptureFixture[str], model: Path) -> tuple[dict, str]:
    doctor.main(["--json", "--model", str(model)])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert all("data" not in c for name, c in checks.items() if name != "placement")  # the others' JSON as before
    doctor.main(["--model", str(model)])
    return checks["placement"], capsys.readouterr().out


def test_doctor_without_a_model_has_no_placement_line(stack_env: dict[str, int]) -> None:
    assert "placement" not in [c.name for c in doctor.machine_checks(doctor.OpsSettings(), None)]


def test_no_gpu_says_why_nothing_is_predicted_and_where_the_experts_live(
    stack_env: dict[str, int], demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi, whatever the machine has
    monkeypatch.setattr(doctor, "check_llama_binary", lambda: Check("llama-server", "pass", "stand-in"))
    placement, text = _placement(capsys, demo_model)
    assert placement["status"] == "warn"  # a CPU machine serves: no failure
    assert placement["detail"].startswith("not predicted: no GPU (no nvidia-smi on PATH)")
    fc = placement["data"]
    assert fc["predicted"] is False and fc["decode_tps"] is None and fc["gpus"] == []
    assert fc["n_cpu"] == fc["shape"]["n_moe"] == 8 and fc["host_expert_bytes"] == fc["shape"]["routed_bytes"]
    assert fc["ram_share"] == 1.0  # a few MiB: host memory holds them all
    assert "placement (the cost model, docs/placement-model.md):" in text
    assert "host memory holds them all" in text and "not predicted: no GPU" in text


def test_an_h200_everything_fits_on_the_device(
    stack_env: dict[str, int], demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    _fake_nvidia_smi(tmp_path / "bin", monkeypatch, "0, NVIDIA H200, 143771, 143000")
    placement, text = _placement(capsys, demo_model)
    fc = placement["data"]
    assert placement["status"] == "pass" and fc["predicted"] is True
    assert fc["n_dev"] == 8 and fc["n_cache"] == fc["n_cpu"] == 0 and fc["host_expert_bytes"] == 0
    assert fc["decode_tps"] > 0 and fc["constants"].startswith("measured: the H200 of 2026-12-04")
    assert "every expert fits: all 8 MoE layers on the device" in placement["detail"]
    assert "predicted decode:" in text and "bound by" in text


def test_a_small_card_gets_the_engines_cache_and_a_slower_decode(
    stack_env: dict[str, int], demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from moe_l2_gguf.index import load_index
    from moe_l2_placement.machine import DEVICE_RESERVE_BYTES

    index = load_index(demo_model)
    # a card that leaves the routed experts 40% of their bytes, in whole MiB
    mib = -(-(index.other_bytes + DEVICE_RESERVE_BYTES + int(0.4 * index.routed_bytes)) // 2**20)
    _fake_nvidia_smi(tmp_path / "bin", monkeypatch, f"0, NVIDIA H200, {mib}, {mib}\n1, NVIDIA H200, {mib}, {mib}")
    placement, text = _placement(capsys, demo_model)
    fc = placement["data"]
    assert fc["predicted"] is True and len(fc["gpus"]) == 2 and fc["device"] == "GPU 0 NVIDIA H200"
    assert fc["n_cache"] > 0 and fc["slots"] >= index.n_expert_used and fc["n_dev"] + fc["n_cache"] == 8
    assert fc["cache_bytes"] + fc["n_dev"] * index.n_expert * index.max_expert_bytes <= fc["budget_bytes"]
    assert 0 < fc["hit_rate"] < 1 and fc["host_expert_bytes"] == fc["n_cache"] * index.n_expert * index.max_expert_bytes
    assert "expert cache:" in text and "2 GPUs; the model places one device's experts" in text

    # the same model on the whole card decodes faster: the cache's misses cost time
    _fake_nvidia_smi(tmp_path / "bin2", monkeypatch, "0, NVIDIA H200, 143771, 143000")
    whole, _ = _placement(capsys, demo_model)
    assert whole["data"]["decode_tps"] > fc["decode_tps"]


def test_an_unmeasured_card_is_an_estimate_that_says_so(
    stack_env: dict[str, int], demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    _fake_nvidia_smi(tmp_path / "bin", monkeypatch, "0, NVIDIA GeForce RTX 4090, 24564, 24000")
    placement, _ = _placement(capsys, demo_model)
    assert placement["data"]["constants"].startswith("assumed, not measured on a NVIDIA GeForce RTX 4090")
    assert "1008 GB/s" in placement["data"]["constants"]


def test_the_ram_tier_when_host_memory_cannot_hold_the_experts() -> None:
    """Past the host's memory the experts are read from the drive: the forecast says how much (no GPU), and with
    a GPU its decode has an NVMe term (moe_l2_placement.here.forecast on a real shape)."""
    from moe_l2_placement.here import Gpu, forecast
    from moe_l2_placement.shape import KNOWN_SHAPES

    ds = KNOWN_SHAPES["ds-v2-lite"]  # 8.1 GB of routed experts
    cpu = forecast("ds", ds, int(12e9), [])  # 12 GB less the 8 GB reserve: half of them
    assert not cpu.predicted and 0.4 < cpu.ram_share < 0.6 and cpu.drive_experts_per_token > 0
    assert "keeps 49%" in cpu.why_not and "read from the drive" in "\n".join(cpu.lines())
    gpu = forecast("ds", ds, int(12e9), [Gpu(0, "NVIDIA H200", 6 * 2**30)])
    roomy = forecast("ds", ds, int(128e9), [Gpu(0, "NVIDIA H200", 6 * 2**30)])
    assert gpu.predicted and gpu.ram_share < 1 and gpu.drive_experts_per_token > 0
    assert roomy.ram_share == 1 and gpu.decode_tps < roomy.decode_tps
