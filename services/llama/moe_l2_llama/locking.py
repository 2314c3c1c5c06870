"""One process at a time on a shared cache entry (a llama build, cuBLAS, the libcuda stub).

Parallel callers (test workers, `moe-l2 up` twice, two builds of different keys preparing the same
toolchain) wait for the first and then find its result. Standard library only (the image's builder
stage runs build.py, which imports it, without site-packages).
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on path (created with its folder), held for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
