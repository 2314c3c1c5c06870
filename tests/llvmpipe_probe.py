"""Is this machine's software GPU sound? One stock request that some llvmpipe builds cannot run.

Measured 2026-12-03 on a 2-core "AMD EPYC" (AVX2, no AVX-512) with Debian 12's Mesa 22.3.6
(llvmpipe, LLVM 15.0.6, 256 bits): llama-server's Vulkan backend with the experts on the device
(`-ngl 99`) dies in lavapipe's queue thread (SIGSEGV in libvulkan_lvp.so, a call through a null
pointer) on every prompt of 3 to 8 tokens, the batches MUL_MAT_ID takes its vector path for; 1-2 and
9+ token prompts answer. Nothing of moe-l2's is in that path (no expert cache, no flag of ours), and
upstream's own `test-backend-ops -o MUL_MAT_ID -b Vulkan0` crashes the same way on that machine while
each of its cases passes alone. With the expert cache on, the same fault shows as a prompt that never
answers, so every Vulkan test would wait out its 300 s timeout. The earlier CI machines (same Mesa)
ran all of it; Mesa 25.0.7 from bookworm-backports did not help (its warm-up ran past 5 minutes).

So the Vulkan tests ask first, with a reduced DeepSeek-V2-Lite shape (the one the expert cache's
tests run) fully on the device and five short prompts: a server that dies or does not answer within
`timeout_s` is a device that cannot test anything, and the tests skip with this reason rather than
fail one by one on Mesa's fault. The demo model was the first probe: it let one faulty run through
(it faulted 7 runs of 8), and the expert cache's tests then hung on that machine.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from moe_l2_gguf.model_shapes import get_shape, write_shape_model
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.llama_service import llama_service_spec
from moe_l2_ops.supervisor import RunningService, Supervisor, SupervisorError, describe_exit, free_port

# one dense layer and one MoE layer of 64 experts (0.43 GiB, written in under a second): on the faulty
# machine it stalled at the 2nd prompt in 9 runs of 9, while the demo model let 1 run of 8 through
PROBE_SHAPE = get_shape("ds-v2-lite").reduced(2, 8192)

# 3 to 7 tokens with the BOS: MUL_MAT_ID's vector path (2 < batch <= 8)
PROBE_PROMPTS = ("the capital", "the capital of", "the capital of france", "a b c d e", "one two three four five six")


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
            for prompt in PROBE_PROMPTS:
                if fault := _ask(client, prompt, running, timeout_s):
                    return fault
        return None
    finally:
        supervisor.stop()


def _ask(client: httpx.Client, prompt: str, running: RunningService, timeout_s: float) -> str | None:
    what = f"the prompt {prompt!r}"
    try:
        resp = client.post(
            "/completion", json={"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": False}
        )
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
