"""The build cache: where it is (MOE_L2_BUILD_CACHE_DIR), the key a build is kept under (source, patches,
flags, machine and, for a native build, the CPU's instruction sets), and what it holds: a config's cached
binary, every build with its build-info.json, and what a binary was built with.

Separate from the build steps: `moe-l2 doctor`, `moe-l2 version`, the backend choice and the tests read
the cache without building anything.

Standard library only, like build.py: the llama image runs build.py as a script, in a bare builder stage.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .build_config import BACKEND_OPS, RPC_SERVER, SDIST_SHA256, BuildConfig
from .patching import default_patches_dir, patch_files

BUILD_CACHE_ENV = "MOE_L2_BUILD_CACHE_DIR"
# its old name, read for one release: MOE_L2_CACHE_* are the cache-manager's settings, which it read like one
OLD_BUILD_CACHE_ENV = "MOE_L2_CACHE_DIR"
_warned_old_cache_env: set[str] = set()


def default_cache_dir() -> Path:
    """The build cache (the built llama-servers, the source, Mesa's warm stamps): MOE_L2_BUILD_CACHE_DIR,
    else $XDG_CACHE_HOME/moe-l2 (~/.cache/moe-l2)."""
    if env := os.environ.get(BUILD_CACHE_ENV):
        return Path(env)
    if env := os.environ.get(OLD_BUILD_CACHE_ENV):
        if env not in _warned_old_cache_env:
            _warned_old_cache_env.add(env)
            print(
                f"{OLD_BUILD_CACHE_ENV} is deprecated: set {BUILD_CACHE_ENV} instead (the build cache)", file=sys.stderr
            )
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moe-l2"


# The instruction-set extensions in /proc/cpuinfo that -march=native turns into compiler flags (x86);
# the rest of the flags line (power management, kernel features) changes with kernels, not code.
_ISA_FLAG_RE = re.compile(r"^(sse|ssse|avx|amx|fma|f16c|bmi|popcnt|movbe|v?aes|v?pclmul|gfni|sha|adx|abm|lzcnt)")


def cpu_isa(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This CPU's instruction-set extensions, sorted ("" where /proc/cpuinfo is unreadable): what a
    native build is compiled for. x86 lists them as `flags`, ARM as `Features` (all of which count)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return " ".join(sorted(f for f in set(value.split()) if _ISA_FLAG_RE.match(f)))
        if name.strip() == "Features":
            return " ".join(sorted(set(value.split())))
    return ""


def build_key(config: BuildConfig, patches: list[Path]) -> str:
    """Hash of everything that changes the binary: source, patches, flags, machine, and for a native
    build the CPU's instruction sets, so that a cache shared between hosts (a network home, a cache
    volume) never hands an AVX-512 binary to a CPU without AVX-512."""
    h = hashlib.sha256()
    h.update(SDIST_SHA256.encode())
    for patch in patches:
        h.update(patch.name.encode())
        h.update(hashlib.sha256(patch.read_bytes()).digest())
    h.update(json.dumps(config.cmake_flags()).encode())
    h.update(platform.machine().encode())
    if config.native:
        h.update(cpu_isa().encode())
    return h.hexdigest()[:16]


def cached_binary(cache: Path, key: str) -> Path:
    return cache / "llama" / key / "bin" / "llama-server"


def rpc_server_binary(binary: Path) -> Path:
    """The ggml-rpc-server an RPC build keeps next to its llama-server."""
    return binary.parent / RPC_SERVER


def backend_ops_binary(binary: Path) -> Path:
    """The test-backend-ops a CPU or Vulkan test build keeps next to its llama-server."""
    return binary.parent / BACKEND_OPS


def _complete(binary: Path, config: BuildConfig) -> bool:
    return all((binary.parent / target).is_file() for target in config.targets())


def built_binary(config: BuildConfig, cache: Path | None = None, patches_dir: Path | None = None) -> Path | None:
    """The cached llama-server that build(config) would return at once, None if it would compile."""
    patches = patch_files(patches_dir or default_patches_dir())
    binary = cached_binary(cache or default_cache_dir(), build_key(config, patches))
    return binary if _complete(binary, config) else None


@dataclass(frozen=True)
class CachedBuild:
    key: str
    backend: str
    binary: Path
    current: bool  # built from the pinned source and exactly these patches


def cached_builds(cache: Path, patches: list[Path]) -> list[CachedBuild]:
    """Every build in the cache, newest first, each read from its build-info.json.

    Whether a build is current is read from what it was built from (the source's hash and each
    patch's), not recomputed from a BuildConfig: its flags (CUDA architectures, -march=native or
    portable) are the builder's choice, and a key recomputed with other defaults would call a fresh
    build stale."""
    wanted = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in patches}
    found = []
    for info_path in (cache / "llama").glob("*/build-info.json"):
        binary = info_path.parent / "bin" / "llama-server"
        try:
            info = json.loads(info_path.read_text())
        except (OSError, ValueError):
            continue
        if not binary.is_file() or not isinstance(info, dict):
            continue
        current = info.get("sdist_sha256") == SDIST_SHA256 and info.get("patches") == wanted
        found.append(CachedBuild(info_path.parent.name, str(info.get("backend", "?")), binary, current))
    return sorted(found, key=lambda b: b.binary.stat().st_mtime, reverse=True)


def built_with_patch(binary: Path, wanted: Callable[[Path], bool]) -> bool:
    """Whether `binary` was built with a patch that `wanted` picks from the patch folder: its
    build-info.json (next to a cached build) lists the patches it was built with; a binary from
    elsewhere is judged by the patch folder alone."""
    patches = [p for p in patch_files(default_patches_dir()) if wanted(p)]
    try:
        names = json.loads((binary.parent.parent / "build-info.json").read_text())["patches"]
    except (OSError, ValueError, KeyError):
        return bool(patches)
    return any(p.name in names for p in patches)


def built_with_test_hooks(binary: Path) -> bool:
    """False only where the binary's build-info.json says it was built without the series' test-only
    hooks (-DLLAMA_MOE_TEST_HOOKS=OFF: a serving build, `moe-l2 build-llama` without `--test-hooks`, the
    images), which hold the route-trace replay; a binary from elsewhere is given the benefit of the doubt
    (it fails at load, in one line, if wrong)."""
    try:
        flags = json.loads((binary.parent.parent / "build-info.json").read_text())["cmake_flags"]
    except (OSError, ValueError, KeyError):
        return True
    return "-DLLAMA_MOE_TEST_HOOKS=OFF" not in flags
