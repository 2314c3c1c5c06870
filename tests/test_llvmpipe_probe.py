"""The probe that decides whether this machine's software GPU can test anything (tests/llvmpipe_probe.py):
it must pass a server that answers and name the fault of one that dies or never answers, else the
Vulkan tests would skip on a sound machine or hang on a broken one."""

from __future__ import annotations

import stat
from pathlib import Path

from tests.llvmpipe_probe import llvmpipe_fault


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
