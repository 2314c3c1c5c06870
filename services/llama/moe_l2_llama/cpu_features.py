"""What this CPU can do, read from /proc/cpuinfo, where it changes how llama-server is started.

Separate from the settings and the command line: it reads the machine, not the configuration, and the
benchmarks ask it directly (bench/expert_offload.py, bench/gpu_identity.py).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path


@cache
def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True on CPUs with AMX (Intel Sapphire Rapids and later), where llama-server needs --no-repack.

    The native CPU build then moves quantized 2-D weights into ggml's AMX buffer type, and that path
    crashes on Q4_K/Q4_0/Q8_0 models at warm-up (measured when the model shapes were added, on a
    Xeon with amx_int8, build 0c1e570: a segfault in ggml_backend_amx_mul_mat for a qwen3moe file,
    GGML_ASSERT(*cur_backend_id != -1) in the scheduler for a deepseek2 one; llama.cpp#20824).
    --no-repack keeps the weights in the plain CPU buffer and both generate. Without AMX the repacked
    layouts are sound and faster (an AMD EPYC without AMX serves the same 3-layer ds-v2-lite file
    with and without the flag), so only AMX CPUs lose them. F16/F32 models never take that path.
    """
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "amx_int8" in flags
