"""Configure and compile a patched source tree with CMake: the toolchain this machine needs first (cmake, a
C++ compiler, nvcc for CUDA, the Vulkan packages), ccache's settings and launchers, the CUDA libraries'
flags, and ninja's or make's output turned into a progress bar with the full log kept.

Separate from the source and the patching: the only step that needs a compiler, and what
moe_l2_llama.backend asks (check_toolchain) before it picks a GPU build.

Standard library only, like build.py: the llama image runs build.py as a script, in a bare builder stage.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

from . import cuda_toolchain
from .build_config import CCACHE_MAX_SIZE, BuildConfig, BuildError
from .progress import Progress

# What the Vulkan backend's CMake needs (find_package(Vulkan COMPONENTS glslc), SPIRV-Headers), by
# the Debian package that provides it; mesa-vulkan-drivers (llvmpipe) is needed only to run it.
VULKAN_BUILD_PACKAGES = ("glslc", "libvulkan-dev", "spirv-headers")
VULKAN_APT_PACKAGES = "glslc libvulkan-dev spirv-headers mesa-vulkan-drivers"


def _include_dirs() -> list[Path]:
    dirs = [Path("/usr/include"), Path("/usr/local/include")]
    if sdk := os.environ.get("VULKAN_SDK"):
        dirs.insert(0, Path(sdk) / "include")
    return dirs


def _vulkan_loader_present() -> bool:
    """The unversioned libvulkan.so that links (libvulkan-dev), not only the runtime's .so.1."""
    lib_dirs = [Path("/usr/lib") / f"{platform.machine()}-linux-gnu", Path("/usr/lib"), Path("/usr/local/lib")]
    if sdk := os.environ.get("VULKAN_SDK"):
        lib_dirs.insert(0, Path(sdk) / "lib")
    return any((d / "libvulkan.so").exists() for d in lib_dirs)


def missing_vulkan_packages() -> list[str]:
    """The packages of VULKAN_BUILD_PACKAGES this machine lacks, checked before anything compiles."""
    missing = []
    if not shutil.which("glslc"):
        missing.append("glslc")
    has_hpp = any((d / "vulkan" / "vulkan.hpp").is_file() for d in _include_dirs())
    if not has_hpp or not _vulkan_loader_present():
        missing.append("libvulkan-dev")
    if not any((d / "spirv" / "unified1" / "spirv.hpp").is_file() for d in _include_dirs()):
        missing.append("spirv-headers")
    return missing


def check_toolchain(config: BuildConfig) -> str | None:
    """Returns the CMake generator to use; raises on a missing tool."""
    if not shutil.which("cmake"):
        raise BuildError("cmake not found on PATH: install it (e.g. `apt-get install cmake`)")
    cxx = os.environ.get("CXX") or next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if not cxx or not shutil.which(cxx):
        raise BuildError("no C++ compiler found on PATH: install one (e.g. `apt-get install g++`)")
    if config.backend == "cuda" and not shutil.which("nvcc") and not Path("/usr/local/cuda/bin/nvcc").exists():
        raise BuildError("the CUDA backend needs nvcc (the CUDA toolkit); none found")
    if config.backend == "vulkan" and (missing := missing_vulkan_packages()):
        raise BuildError(
            f"the Vulkan backend needs {', '.join(missing)}, not found: install the packages "
            f"(e.g. `apt-get install {VULKAN_APT_PACKAGES}`)"
        )
    if shutil.which("ninja"):
        return "Ninja"
    if shutil.which("make"):
        return None
    raise BuildError("neither ninja nor make found on PATH: install one (e.g. `apt-get install ninja-build`)")


_PROGRESS_RE = re.compile(r"^\[(\d+)/(\d+)\]|^\[\s*(\d+)%\]")


def ccache_env(cache: Path, work: Path) -> dict[str, str] | None:
    """ccache's settings for one build, or None without ccache (or with MOE_L2_CCACHE=0).

    Every build key has its own work tree, so the objects are shared between keys only when the
    tree's path is left out of the hash: CCACHE_BASEDIR makes the paths under it relative and
    CCACHE_NOHASHDIR drops the working directory. Release builds carry no debug info, so an object
    compiled in another tree is byte-identical. A user's own CCACHE_DIR/CCACHE_MAXSIZE win.
    """
    if os.environ.get("MOE_L2_CCACHE", "1") == "0" or not shutil.which("ccache"):
        return None
    return {
        "CCACHE_DIR": os.environ.get("CCACHE_DIR") or str(cache / "ccache"),
        "CCACHE_MAXSIZE": os.environ.get("CCACHE_MAXSIZE") or CCACHE_MAX_SIZE,
        "CCACHE_BASEDIR": str(work),
        "CCACHE_NOHASHDIR": "true",
    }


def launcher_flags(config: BuildConfig) -> list[str]:
    """Compiler launchers for ccache. Not part of cmake_flags(): they do not change the binary, so
    they stay out of the build key (a machine with and without ccache builds the same key)."""
    languages = ["C", "CXX", *(["CUDA"] if config.backend == "cuda" else [])]
    return [f"-DCMAKE_{lang}_COMPILER_LAUNCHER=ccache" for lang in languages]


def run_logged(cmd: list[str], log_path: Path, label: str, env: dict[str, str] | None = None) -> None:
    """Runs cmd with its output in log_path and a progress bar from ninja's/make's counters."""
    progress = Progress(label)
    with log_path.open("a") as log_file:
        log_file.write(f"$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
        )
        assert proc.stdout is not None
        outer_total = 0
        for line in proc.stdout:
            log_file.write(line)
            if m := _PROGRESS_RE.match(line):
                if m.group(1):
                    # nested builds (the Vulkan shader generator) print their own, smaller counters
                    done, total = int(m.group(1)), int(m.group(2))
                    if total >= outer_total:
                        outer_total = total
                        progress.update(done, total)
                else:
                    progress.update(int(m.group(3)), 100)
        rc = proc.wait()
    progress.close()
    if rc != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
        for line in tail:
            print(f"    {line}", file=sys.stderr)
        raise BuildError(f"{label} failed (exit {rc}); full log: {log_path}")


def compile_server(
    src: Path,
    build_dir: Path,
    config: BuildConfig,
    jobs: int,
    log_path: Path,
    ccache: dict[str, str] | None = None,
    toolchain_flags: list[str] | None = None,
) -> Path:
    generator = check_toolchain(config)
    configure = ["cmake", "-S", str(src), "-B", str(build_dir), *config.cmake_flags(), *(toolchain_flags or [])]
    if ccache is not None:
        configure += launcher_flags(config)
    if generator:
        configure[1:1] = ["-G", generator]
    run_logged(configure, log_path, "configuring llama.cpp", ccache)
    targets = config.targets()
    run_logged(
        ["cmake", "--build", str(build_dir), "--target", *targets, "-j", str(jobs)],
        log_path,
        f"building {' and '.join(targets)}",
        ccache,
    )
    for target in targets:
        if not (build_dir / "bin" / target).is_file():
            raise BuildError(f"the build finished but {build_dir / 'bin' / target} is missing; see {log_path}")
    return build_dir / "bin" / "llama-server"


def cuda_flags(cache: Path) -> list[str]:
    """Where cuBLAS and a libcuda to link against are (fetched or built on first use); not in the
    build key: they say where things are, not what is built."""
    try:
        return cuda_toolchain.cmake_flags(cache)
    except cuda_toolchain.ToolchainError as exc:
        raise BuildError(str(exc)) from exc
