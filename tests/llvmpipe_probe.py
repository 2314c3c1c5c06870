"""Is this machine's software GPU sound for the batches the Vulkan tests send? One stock request each.

Measured 2026-12-03 on a 2-core "AMD EPYC" (AVX2, no AVX-512) with Debian 12's Mesa 22.3.6
(llvmpipe, LLVM 15.0.6, 256 bits), and again (issue 33) on a machine of the same kind with AVX-512:
llama-server's Vulkan backend with the experts on the device (`-ngl 99`) dies in lavapipe's queue
thread (SIGSEGV in libvulkan_lvp.so, a call through a null pointer) or never answers on every prompt
of 3 to 8 tokens, the batches MUL_MAT_ID takes its vector path for; 1-2 and 9+ token prompts answer.
Nothing of moe-l2's is in that path (no expert cache, no flag of ours), and upstream's own
`test-backend-ops -o MUL_MAT_ID -b Vulkan0` crashes the same way on that machine while each of its
cases passes alone. Earlier CI machines (same Mesa) ran all of it; Mesa 25.0.7 from bookworm-backports
did not help (its warm-up ran past 5 minutes).

So the Vulkan tests (tests/test_vulkan.py; the expert cache's tests moved to the RPC device, which needs
no Mesa) send only batches clear of that range: VULKAN_PROMPTS, 9 and 25 tokens, and single-token decode
steps. The probe sends exactly those, fully on the device, on a reduced DeepSeek-V2-Lite shape: a
server that dies or does not answer within `timeout_s` is a device that cannot run what the tests run,
so a probe failure means those tests could prove nothing (tests/conftest.py fails in CI and skips
elsewhere). The probe's own 3-7 token prompts of before stalled at the second prompt in 9 runs of 9 on
the faulty machine; the demo model, the first probe, let one faulty run of 8 through. Measured on a
faulty machine (2026-12-04, load about 4): 2 tokens 0.8 s, 3 tokens 61.8 s, 9 tokens 4.2 s; this probe
passed there in under 15 s and the Vulkan tests then ran green. On a 2-core Xeon with AVX-512
(2026-12-06) this probe failed too, on the 9-token prompt, until llvmpipe ran on one thread: the
service now sets LP_NUM_THREADS=1 on the software GPU (moe_l2_llama.settings.SOFTWARE_VULKAN_ENV,
docs/test-bed.md), and the probe runs the server as the tests do, with it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from functools import cache
from pathlib import Path

import httpx

from moe_l2_gguf.model_shapes import get_shape, write_shape_model
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.llama_service import llama_service_spec
from moe_l2_ops.supervisor import RunningService, Supervisor, SupervisorError, describe_exit, free_port

# one dense layer and one MoE layer of 64 experts (0.43 GiB, written in under a second): on the faulty
# machine it stalled at the 2nd prompt in 9 runs of 9, while the demo model let 1 run of 8 through
PROBE_SHAPE = get_shape("ds-v2-lite").reduced(2, 8192)

# The rows of a batch for which lavapipe faults on MUL_MAT_ID (its vector path, 2 < batch <= 8).
FAULTING_ROWS = range(3, 9)

# What the Vulkan tests send: prompts of 9 and 25 tokens with the BOS on both of their models (the
# demo model's and the shapes' byte-level vocabularies cut them alike; tests/test_vulkan.py checks it),
# under ggml's op-offload threshold of 32 rows (above it llvmpipe's MUL_MAT_ID took minutes per
# request on 2 cores), then single-row decode steps.
VULKAN_PROMPTS = (
    "the capital of france is",
    "the quick brown fox jumps over the lazy dog by the river",
)
# a prompt's batch and a decode step: the two kinds of batch the tests send
PROBE_N_PREDICT = 2


def write_probe_model(path: Path) -> Path:
    write_shape_model(path, PROBE_SHAPE, seed=0, progress=False)
    return path


def llvmpipe_fault(binary: Path, model: Path, logs: Path, timeout_s: float = 60) -> str | None:
    """None when short prompts with every expert on the device all answer, else what went wrong."""
    settings = LlamaSettings(port=free_port(), parallel=1, ctx_size=256, threads=2, gpu_layers=99)
    spec = llama_service_spec("llvmpipe-probe", binary, model, settings)
    supervisor = Supervisor(logs)
    try:
        try:
            running = supervisor.start(spec)
        except SupervisorError as exc:
            return f"llama-server did not start: {exc}"
        with httpx.Client(base_url=spec.url, timeout=timeout_s) as client:
            for prompt in VULKAN_PROMPTS:
                if fault := _ask(client, prompt, running, timeout_s):
                    return fault
        return None
    finally:
        supervisor.stop()


def _ask(client: httpx.Client, prompt: str, running: RunningService, timeout_s: float) -> str | None:
    what = f"the prompt {prompt!r}"
    try:
        body = {"prompt": prompt, "n_predict": PROBE_N_PREDICT, "temperature": 0, "cache_prompt": False}
        resp = client.post("/completion", json=body)
    except httpx.TimeoutException:
        return f"{what} had no answer in {timeout_s:.0f} s; log: {running.log_path}"
    except httpx.TransportError as exc:
        try:  # a crashing server drops the connection a moment before it is reaped
            running.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return f"{what} lost its connection ({exc}); log: {running.log_path}"
        return f"on {what} llama-server {describe_exit(running.proc.returncode)}; log: {running.log_path}"
    if resp.status_code != 200:
        return f"{what} got HTTP {resp.status_code}: {resp.text[:200]}"
    return None


def _icd_libraries() -> list[Path]:
    """The driver libraries the Vulkan loader would use for lavapipe: VK_ICD_FILENAMES (or
    VK_DRIVER_FILES) if set, else the lvp manifests in the standard folders."""
    env = os.environ.get("VK_DRIVER_FILES") or os.environ.get("VK_ICD_FILENAMES")
    if env:
        manifests = [Path(m) for m in env.split(os.pathsep) if m]
    else:
        folders = [Path("/usr/share/vulkan/icd.d"), Path("/usr/local/share/vulkan/icd.d"), Path("/etc/vulkan/icd.d")]
        manifests = [m for f in folders for m in sorted(f.glob("lvp_icd*.json"))]
    libraries = []
    for manifest in manifests:
        try:
            libraries.append(Path(json.loads(manifest.read_text())["ICD"]["library_path"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return libraries


@cache
def mesa_version() -> tuple[int, int, int] | None:
    """The Mesa release of the lavapipe driver installed here, read from the library itself (it embeds
    `Mesa 22.3.6`; no vulkaninfo needed), or None without one."""
    for library in _icd_libraries():
        try:
            found = re.search(rb"Mesa (\d+)\.(\d+)\.(\d+)", library.read_bytes())
        except OSError:
            continue
        if found:
            return int(found[1]), int(found[2]), int(found[3])
    return None
