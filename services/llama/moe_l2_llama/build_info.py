"""What a built llama-server's build-info.json says about it (`moe-l2 build-llama` writes one next to
its bin/): the backend it was built for.

Separate from the build itself (moe_l2_llama.build) so that the serving plan, the Vulkan environment and
`moe-l2 version` can read a binary's backend without the build machinery.
"""

from __future__ import annotations

import json
from pathlib import Path


def known_backend(binary: Path) -> str | None:
    """The backend a binary was built for, from the build-info.json that `moe-l2 build-llama` writes
    next to its bin/; None for a binary from elsewhere."""
    info = binary.parent.parent / "build-info.json"
    try:
        data = json.loads(info.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if backend := data.get("backend"):
        return str(backend)
    return "vulkan" if "-DGGML_VULKAN=ON" in data.get("cmake_flags", []) else "cpu"


def build_backend(binary: Path) -> str:
    """known_backend, "cpu" for a binary from elsewhere: nothing says otherwise."""
    return known_backend(binary) or "cpu"
