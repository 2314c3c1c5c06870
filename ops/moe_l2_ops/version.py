"""`moe-l2 --version`: the package's version, the llama.cpp source and patch series the engine is built
from, and the llama-server build `moe-l2 up` would serve with.

A bug report needs all three: the same moe-l2 release serves whatever build the cache holds for this
machine, and the patch series (services/llama/patches) changes between releases.
"""

from __future__ import annotations

import hashlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def patch_series_hash(patches: list[Path]) -> str:
    """The patch series' share of the build key (moe_l2_llama.build.build_key hashes each patch's name and
    the sha256 of its bytes, in order, among the flags): 16 hex digits, as the key. build.py has no
    function for the series alone, and a build key mixes in the flags and this machine's CPU, so it
    cannot name the series; this hashes the same inputs the same way."""
    h = hashlib.sha256()
    for patch in patches:
        h.update(patch.name.encode())
        h.update(hashlib.sha256(patch.read_bytes()).digest())
    return h.hexdigest()[:16]


def package_line() -> str:
    try:
        return f"moe-l2 {version('moe-l2')}"
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "moe-l2 (not installed)"


def source_line() -> str:
    """The pinned llama.cpp commit and the patch series applied on it."""
    from moe_l2_llama.build import (
        LLAMA_CPP_COMMIT,
        LLAMA_CPP_PYTHON_VERSION,
        BuildError,
        default_patches_dir,
        patch_files,
    )

    source = f"llama.cpp {LLAMA_CPP_COMMIT} (from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}'s sdist)"
    try:
        patches = patch_files(default_patches_dir())
    except BuildError as exc:  # an install without the patch folder
        return f"{source}, patch series unknown: {exc}"
    return f"{source}, patch series {patch_series_hash(patches)} ({len(patches)} patches)"


def binary_line() -> str:
    """The llama-server `moe-l2 up` would serve with (doctor's lookup): its backend and path, or that it
    is not built yet."""
    from moe_l2_llama.build_info import known_backend
    from moe_l2_ops.doctor import serving_binary

    plan, binary = serving_binary()
    if binary is None:
        return f"llama-server: not built (the {plan.choice.backend} build; `moe-l2 up` or `moe-l2 build-llama`)"
    # build-info.json beside a built binary says what it was built for; MOE_L2_LLAMA_SERVER's may lack it
    backend = known_backend(binary)
    what = f"{backend} build" if backend else "a build of unknown backend (no build-info.json beside it)"
    given = " (MOE_L2_LLAMA_SERVER)" if plan.given is not None else ""
    return f"llama-server: {what}, {binary}{given}{_stale(binary)}"


def _stale(binary: Path) -> str:
    """A cached build from another patch series (MOE_L2_LLAMA_SERVER may name an old one) says so."""
    from moe_l2_llama.build import cached_builds, default_cache_dir, default_patches_dir, patch_files

    builds = cached_builds(default_cache_dir(), patch_files(default_patches_dir()))
    old = any(build.binary == binary and not build.current for build in builds)
    return ", built from another patch series" if old else ""


def version_text() -> str:
    lines = [package_line()]
    for name, line in (("llama.cpp", source_line), ("llama-server", binary_line)):
        try:
            lines.append(line())
        except Exception as exc:  # --version must print what it can, never a traceback
            lines.append(f"{name}: unknown ({type(exc).__name__}: {exc})")
    return "\n".join(lines)
