"""A benchmark's output: the machine it ran on (its CPUs, platform, load and memory), the JSON written whole, the
folder of its server logs, and a figure in a table."""

from __future__ import annotations

import json
import os
import platform
import shutil
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


def fresh_log_dir(out: Path, given: Path | None = None) -> Path:
    """`given`, else `<out>-logs` beside the JSON, emptied and made: kept after the run, since a failed start
    or request points there, and emptied so that no log of an earlier run is read for this one."""
    log_dir = given or out.parent / f"{out.stem}-logs"
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    return log_dir


def fmt_num(x: float | None, fmt: str) -> str:
    """A table's cell: `x` formatted, or "-" where nothing was measured."""
    return "-" if x is None else format(x, fmt)
