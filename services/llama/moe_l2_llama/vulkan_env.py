"""The environment a Vulkan build of llama-server needs to find its device, the software GPU
(Mesa's llvmpipe) included.

Separate from the command line: it depends on the binary (its build-info.json) and on the machine's
devices (vulkaninfo), not on the settings.
"""

from __future__ import annotations

import os
from pathlib import Path

from moe_l2_llama.backend import probe_vulkan
from moe_l2_llama.build_info import build_backend

# The software GPU: device 0, and one llvmpipe thread. With llvmpipe's default of one thread per core,
# Mesa 22.3.6's lavapipe (Debian 12) corrupted its heap ("double free or corruption", SIGABRT) or never
# answered a prompt of 9 tokens through llama-server's Vulkan backend, in 5 starts of 5 on a 2-core Xeon
# with AVX-512 (2026-12-06; LP_NUM_THREADS=2 failed 1 start of 3, LP_NATIVE_VECTOR_WIDTH=256 hung on
# every prompt); with LP_NUM_THREADS=1 every prompt of
# 2, 7, 9 and 25 tokens answered in 5 starts of 5, as fast within the noise (a 9-token prompt 3.7-6.1 s
# against 4.2 s). So the "batches of 3 to 8 rows" fault of tests/llvmpipe_probe.py is a race between
# llvmpipe's threads: a 7-token prompt answers on one thread.
SOFTWARE_VULKAN_ENV = {"GGML_VK_VISIBLE_DEVICES": "0", "LP_NUM_THREADS": "1"}


def device_env(binary: Path) -> dict[str, str]:
    """Variables that let a GPU build find its device.

    ggml-vulkan skips devices of type CPU (Mesa's llvmpipe, the software GPU of machines without
    one) unless GGML_VK_VISIBLE_DEVICES names them, and then runs everything on the CPU backend
    without a word. A Vulkan build therefore gets device 0 unless the environment already chooses,
    or vulkaninfo lists a real GPU: ggml-vulkan then picks the discrete and integrated GPUs itself,
    where device 0 could be llvmpipe. On a machine with several devices, set GGML_VK_VISIBLE_DEVICES.
    On llvmpipe, LP_NUM_THREADS=1 as well (SOFTWARE_VULKAN_ENV), unless the environment sets it.
    """
    if build_backend(binary) != "vulkan" or "GGML_VK_VISIBLE_DEVICES" in os.environ:
        return {}
    devices, _ = probe_vulkan()
    if any(d.is_gpu for d in devices):
        return {}
    return {k: v for k, v in SOFTWARE_VULKAN_ENV.items() if k == "GGML_VK_VISIBLE_DEVICES" or k not in os.environ}
