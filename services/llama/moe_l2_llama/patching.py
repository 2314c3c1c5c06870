"""The project's patch series: where it is (services/llama/patches, or MOE_L2_PATCHES_DIR), the patches in
order, the share of them that touches ggml/ (what decides whether ccache keeps a CUDA rebuild cheap), and
applying them to a fresh source tree (git apply, or patch where git is absent).

Separate from the source and the compile: the series changes with every engine feature, the pin rarely.

Standard library only, like build.py: the llama image runs build.py as a script, in a bare builder stage.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from .build_config import LLAMA_CPP_COMMIT, BuildError
from .progress import log


def default_patches_dir() -> Path:
    if env := os.environ.get("MOE_L2_PATCHES_DIR"):
        return Path(env)
    return Path(__file__).resolve().parent.parent / "patches"


def patch_files(patches_dir: Path) -> list[Path]:
    if not patches_dir.is_dir():
        raise BuildError(f"patch folder {patches_dir} does not exist")
    return sorted(patches_dir.glob("*.patch"))


def ggml_patches(patches: list[Path]) -> dict[str, str]:
    """name -> sha256 of the file diffs under ggml/ of the patches that have any. Equal between two
    builds, their ggml trees are equal, and so are the inputs of every ggml-cuda object (they include
    only ggml headers): the measure of whether ccache makes a CUDA rebuild cheap (32 s after an edit
    outside ggml/, measured) or a cold one (28 min after a ggml-backend.h edit). Only the ggml/ diffs
    count, so a renumbered subject line or an edit elsewhere in the patch keeps it warm."""
    touching = {}
    for patch in patches:
        sections = re.split(rb"^(?=diff --git )", patch.read_bytes(), flags=re.MULTILINE)
        ggml = [s for s in sections if s.startswith(b"diff --git a/ggml/")]
        if ggml:
            touching[patch.name] = hashlib.sha256(b"".join(ggml)).hexdigest()
    return touching


def apply_patches(src: Path, patches: list[Path]) -> None:
    for patch in patches:
        if shutil.which("git"):
            cmd = ["git", "apply", "--whitespace=nowarn", str(patch)]
            check = [*cmd[:2], "--check", *cmd[2:]]
        else:
            cmd = ["patch", "-p1", "--forward", "--batch", "-i", str(patch)]
            check = [*cmd, "--dry-run"]
        # Never let git discover an enclosing repository (a cache inside a checkout).
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(src.parent)}
        result = subprocess.run(check, cwd=src, capture_output=True, text=True, env=env)
        if result.returncode != 0:
            reason = (result.stderr.strip() or result.stdout.strip()).splitlines()
            first = reason[0] if reason else "unknown reason"
            raise BuildError(f"patch {patch.name} does not apply to llama.cpp {LLAMA_CPP_COMMIT[:7]}: {first}")
        subprocess.run(cmd, cwd=src, check=True, capture_output=True, env=env)
        log(f"applied {patch.name}")
