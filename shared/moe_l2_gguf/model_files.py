"""Writing a generated model file (demo_model.py, model_shapes.py): its one error, its folder, its atomic replace."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


class DemoModelError(Exception):
    """A generated model (the demo model, a shape model) could not be written; the message is one line."""


def ensure_parent(path: Path) -> None:
    # mkdir reports a regular file in the way as "File exists"; name the real problem instead.
    for ancestor in path.parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise DemoModelError(f"cannot write demo model to {path}: {ancestor} is not a directory")
            break
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DemoModelError(f"cannot write demo model to {path}: {e.strerror or e}") from e


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Write through a temporary file in the same folder, so a reader never sees half a file."""
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise DemoModelError(f"cannot write demo model to {path}: {e.strerror or e}") from e
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        tmp.chmod(0o644)
        tmp.replace(path)
    except OSError as e:
        raise DemoModelError(f"cannot write demo model to {path}: {e.strerror or e}") from e
    finally:
        tmp.unlink(missing_ok=True)
