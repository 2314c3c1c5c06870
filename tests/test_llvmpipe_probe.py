"""The probe that decides whether this machine's software GPU can test anything (tests/llvmpipe_probe.py):
it must pass a server that answers and name the fault of one that dies or never answers, else the
Vulkan tests would skip on a sound machine or hang on a broken one. Its finding fails CI (CI set) and
skips elsewhere (tests/conftest.py): checked on the decision function with stand-in probes, and end to
end by a pytest run of a Vulkan test against a stand-in server that crashes as lavapipe does."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import llvmpipe_verdict, require_sound_llvmpipe
from tests.llvmpipe_probe import llvmpipe_fault, mesa_version

ROOT = Path(__file__).resolve().parent.parent


def fake_server(tmp_path: Path, on_completion: str) -> Path:
    """A stand-in llama-server: healthy, then on the prompt it crashes (as lavapipe does) or stalls."""
    script = tmp_path / "llama-server"
    script.write_text(
        f"""#!/usr/bin/env python3
import http.server, os, signal, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{{"status":"ok"}}')
    def do_POST(self):
        if "{on_completion}" == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(30)
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_a_sound_server_passes(llama_binary: Path, llvmpipe_probe_model: Path, tmp_path: Path) -> None:
    assert llvmpipe_fault(llama_binary, llvmpipe_probe_model, tmp_path) is None


def test_a_server_that_dies_on_the_prompt_is_named(demo_model: Path, tmp_path: Path) -> None:
    fault = llvmpipe_fault(fake_server(tmp_path, "crash"), demo_model, tmp_path)
    assert fault is not None and "SIGSEGV" in fault, fault


def test_a_server_that_never_answers_is_named(demo_model: Path, tmp_path: Path) -> None:
    fault = llvmpipe_fault(fake_server(tmp_path, "stall"), demo_model, tmp_path, timeout_s=2)
    assert fault is not None and "no answer in 2 s" in fault, fault


def test_a_server_that_does_not_start_is_named(demo_model: Path, tmp_path: Path) -> None:
    fault = llvmpipe_fault(Path("/bin/false"), demo_model, tmp_path)
    assert fault is not None and "did not start" in fault, fault


FINDING = "the prompt 'the quick brown fox' had no answer in 60 s; log: /tmp/llvmpipe-probe.log"


def stand_in_probe(finding: str | None) -> Callable[[Path, Path, Path], str | None]:
    """A probe that reports `finding` without starting anything."""
    return lambda binary, model, logs: finding


def test_a_probe_failure_is_a_failure_in_ci_naming_the_finding(tmp_path: Path) -> None:
    action, reason = llvmpipe_verdict(FINDING, ci=True) or ("", "")
    assert action == "fail" and FINDING in reason
    with pytest.raises(pytest.fail.Exception, match="had no answer in 60 s"):
        require_sound_llvmpipe(tmp_path, tmp_path, tmp_path, probe=stand_in_probe(FINDING), ci=True)


def test_a_probe_failure_skips_on_a_developers_machine(tmp_path: Path) -> None:
    with pytest.raises(pytest.skip.Exception, match="had no answer in 60 s"):
        require_sound_llvmpipe(tmp_path, tmp_path, tmp_path, probe=stand_in_probe(FINDING), ci=False)


@pytest.mark.parametrize("ci", [True, False])
def test_a_sound_probe_lets_the_tests_run(tmp_path: Path, ci: bool) -> None:
    assert llvmpipe_verdict(None, ci) is None
    require_sound_llvmpipe(tmp_path, tmp_path, tmp_path, probe=stand_in_probe(None), ci=ci)


def run_a_vulkan_test(tmp_path: Path, server: Path, ci: bool) -> subprocess.CompletedProcess[str]:
    """One Vulkan test in its own pytest, its Vulkan server the stand-in (MOE_L2_VULKAN_LLAMA_SERVER)."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["MOE_L2_VULKAN_LLAMA_SERVER"] = str(server)
    if ci:
        env["CI"] = "1"
    test = "tests/test_vulkan.py::test_greedy_tokens_equal_the_cpu_build[cpu-moe-ds-v2-lite]"
    tmp_path.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 't'}", test]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_ci_fails_when_lavapipe_crashes_on_the_probe(tmp_path: Path) -> None:
    """The planted fault of issue 33: a Vulkan server that dies as lavapipe does makes CI fail, with the
    finding, where it used to skip; the same run outside CI skips with it."""
    server = fake_server(tmp_path, "crash")
    in_ci = run_a_vulkan_test(tmp_path / "ci", server, ci=True)
    assert in_ci.returncode == 1, in_ci.stdout[-3000:]
    assert "1 error" in in_ci.stdout and "skipped" not in in_ci.stdout, in_ci.stdout[-3000:]
    assert "llvmpipe fails the batches the Vulkan tests send" in in_ci.stdout and "SIGSEGV" in in_ci.stdout
    elsewhere = run_a_vulkan_test(tmp_path / "dev", server, ci=False)
    assert elsewhere.returncode == 0 and "1 skipped" in elsewhere.stdout, elsewhere.stdout[-3000:]
    assert "SIGSEGV" in elsewhere.stdout


def test_the_mesa_version_is_read_from_the_driver_the_loader_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    library = tmp_path / "libvulkan_lvp.so"
    library.write_bytes(b"\x7fELF...\0Mesa 24.2.8-1\0...")
    manifest = tmp_path / "lvp_icd.json"
    manifest.write_text(json.dumps({"ICD": {"library_path": str(library), "api_version": "1.3.289"}}))
    monkeypatch.setenv("VK_ICD_FILENAMES", str(manifest))
    mesa_version.cache_clear()
    try:
        assert mesa_version() == (24, 2, 8)
        monkeypatch.setenv("VK_ICD_FILENAMES", str(tmp_path / "missing.json"))
        mesa_version.cache_clear()
        assert mesa_version() is None
    finally:
        mesa_version.cache_clear()
