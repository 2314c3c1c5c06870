"""A benchmark's JSON: the machine it ran on (its CPUs, platform, load and memory), and the file written whole."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def machine() -> dict[str, object]:
    """What every result names of its machine: CPUs, platform, and the load average at the time (a shared
    development machine's other work shows there, and explains a noisy run)."""
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()}


def meminfo_bytes(key: str) -> int:
    """A /proc/meminfo figure in bytes (MemTotal, MemAvailable, Mlocked, ...); 0 where it is absent or unreadable."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def write_json(path: Path, doc: object, indent: int = 2) -> None:
    """`doc` as JSON at `path` (its folder made), ending in a newline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent) + "\n")
