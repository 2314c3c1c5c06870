"""What a CUDA build of llama-server needs beyond nvcc, found or made on the build machine.

A machine can compile CUDA code without being able to link it: ggml-cuda links cuBLAS (a separate
download from the compiler) and calls the driver library libcuda.so directly (a part of the GPU
driver, absent without a GPU). This module finds the toolkit, fetches cuBLAS from PyPI into the
moe-l2 cache when the toolkit lacks it, builds a link-only stub of libcuda.so.1, and checks the
`--arch` value, so that `moe-l2 build-llama --cuda --arch 90` works on a CPU-only machine and in the
image's CUDA builder stage alike. Everything is passed to CMake as -D flags (nothing through the
environment), so the configure line in build.log shows exactly what was used.

Standard library only: the image's builder stage runs build.py, which imports it, without site-packages.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .locking import file_lock

# cuBLAS for CUDA 13 from PyPI: headers plus libcublas.so.13 and libcublasLt.so.13.
CUBLAS_PACKAGE = "nvidia-cublas"
CUBLAS_VERSION = "13.1.1.3"
CUBLAS_CUDA_MAJOR = 13
STUB_SOURCE = Path(__file__).resolve().parent.parent / "cuda_stub" / "libcuda_stub.c"
STUB_SONAME = "libcuda.so.1"
# CMake's own values for CMAKE_CUDA_ARCHITECTURES besides explicit numbers.
CMAKE_ARCH_KEYWORDS = ("all", "all-major")
_ARCH_RE = re.compile(r"^(\d+)([af]?)(-real|-virtual)?$")


class ToolchainError(Exception):
    """The CUDA toolchain cannot be completed; the message is one line meant for the user."""


@dataclass(frozen=True)
class Toolkit:
    nvcc: Path
    root: Path  # bin/nvcc and include/cuda_runtime.h live under it
    version: str  # "13.0"

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])


def _toolkit_candidates() -> Iterator[Path]:
    """nvcc paths in order of preference: what the user named, then the usual places."""
    if env := os.environ.get("CUDACXX"):
        yield Path(env)
    for var in ("CUDAToolkit_ROOT", "CUDA_HOME", "CUDA_PATH"):
        if env := os.environ.get(var):
            yield Path(env) / "bin" / "nvcc"
    yield Path("/usr/local/cuda/bin/nvcc")
    if found := shutil.which("nvcc"):
        yield Path(found)


def find_toolkit() -> Toolkit:
    """The first nvcc whose toolkit has its headers next to it (a wrapper script on PATH does not)."""
    seen_nvcc = None
    for candidate in _toolkit_candidates():
        if not candidate.is_file():
            continue
        seen_nvcc = seen_nvcc or candidate
        nvcc = candidate.resolve()
        root = nvcc.parent.parent
        if (root / "include" / "cuda_runtime.h").is_file():
            return Toolkit(nvcc=nvcc, root=root, version=_nvcc_version(nvcc))
    if seen_nvcc:
        raise ToolchainError(f"{seen_nvcc} has no CUDA headers next to it: set CUDA_HOME to the toolkit's folder")
    raise ToolchainError("no nvcc found (the CUDA toolkit): install it or set CUDA_HOME to its folder")


def _nvcc_version(nvcc: Path) -> str:
    result = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True)
    if m := re.search(r"release (\d+\.\d+)", result.stdout):
        return m.group(1)
    raise ToolchainError(f"{nvcc} --version does not say its release (exit {result.returncode})")


def supported_archs(toolkit: Toolkit) -> list[int]:
    """The compute capabilities this nvcc compiles for, e.g. [75, 80, ..., 121] for CUDA 13."""
    result = subprocess.run([str(toolkit.nvcc), "--list-gpu-arch"], capture_output=True, text=True)
    archs = sorted({int(m) for m in re.findall(r"compute_(\d+)", result.stdout)})
    if not archs:
        raise ToolchainError(f"{toolkit.nvcc} --list-gpu-arch lists no architectures (exit {result.returncode})")
    return archs


def gpu_archs(toolkit: Toolkit) -> str | None:
    """This machine's GPUs as CMake architectures ("90"), or None without a GPU and its driver.

    __nvcc_device_query is the helper CMake itself runs for `native`; without a driver it fails,
    and CMake would then fall back to a guess that compiles for no GPU of this machine."""
    query = toolkit.root / "bin" / "__nvcc_device_query"
    if not query.is_file():
        return None
    try:
        result = subprocess.run([str(query)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    archs = set(re.split(r"[,;\s]+", result.stdout.strip())) - {""}
    if result.returncode != 0 or not archs or not all(a.isdigit() for a in archs):
        return None
    return ";".join(sorted(archs, key=int))


def resolve_arch(value: str, toolkit: Toolkit | None = None) -> str:
    """CMAKE_CUDA_ARCHITECTURES for an --arch value, checked against this nvcc.

    `native` becomes this machine's own numbers, so the build key names what was compiled for.
    """
    toolkit = toolkit or find_toolkit()
    value = value.strip()
    if value == "native":
        if archs := gpu_archs(toolkit):
            return archs
        raise ToolchainError("--arch native needs a GPU and its driver on this machine; name one, e.g. --arch 90")
    if value in CMAKE_ARCH_KEYWORDS:
        return value
    supported = supported_archs(toolkit)
    items = [item.strip() for item in value.split(";")]
    for item in items:
        m = _ARCH_RE.match(item)
        if not m:
            raise ToolchainError(
                f"unknown --arch value {item!r}: use compute capabilities such as 90 or '86;90' "
                f"(optionally 90a, 90-real, 90-virtual), native, all or all-major"
            )
        if int(m.group(1)) not in supported:
            listed = " ".join(str(a) for a in supported)
            raise ToolchainError(f"--arch {item} is not supported by nvcc {toolkit.version} (it supports {listed})")
    return ";".join(items)


def _find_cublas(toolkit: Toolkit) -> bool:
    """Whether the toolkit itself carries cuBLAS (every full install and the devel images do)."""
    headers = (toolkit.root / "include" / "cublas_v2.h").is_file()
    lib_dirs = [toolkit.root / d for d in ("lib64", "lib")] + list((toolkit.root / "targets").glob("*/lib"))
    return headers and any((d / "libcublas.so").exists() for d in lib_dirs)


def cublas_dir(cache: Path) -> Path:
    return cache / "cuda" / f"cublas-{CUBLAS_VERSION}"


def installed_cublas(major: int, search: list[str] | None = None) -> tuple[Path, Path] | None:
    """(include dir, lib dir) of a cuBLAS wheel of this CUDA major already installed for this Python
    (PyTorch's environments carry one): what an offline machine such as a lent GPU machine links."""
    for entry in search if search is not None else sys.path:
        for layout in (f"cu{major}", "cublas"):  # CUDA 13 wheels, then the CUDA 12 ones
            root = Path(entry or ".") / "nvidia" / layout
            if (root / "include" / "cublas_v2.h").is_file() and (root / "lib" / f"libcublas.so.{major}").is_file():
                return root / "include", root / "lib"
    return None


def _linkable(cache: Path, lib: Path, major: int) -> Path:
    """A folder of links to lib's cuBLAS: the unversioned names the linker looks for (wheels ship only
    the sonames, and an installed package's folder is not ours to write to), and the sonames, which
    the binary then finds at run time through the RUNPATH CMake gives it."""
    links = cache / "cuda" / "cublas-links" / hashlib.sha256(str(lib).encode()).hexdigest()[:16]
    links.mkdir(parents=True, exist_ok=True)
    for name in ("libcublas.so", "libcublasLt.so"):
        for link in (links / name, links / f"{name}.{major}"):
            if not link.exists():
                link.unlink(missing_ok=True)
                link.symlink_to(lib / f"{name}.{major}")
    return links


def install_cublas(cache: Path, toolkit: Toolkit) -> tuple[Path, Path]:
    """(include dir, lib dir) of cuBLAS: an installed wheel of the toolkit's major, else the pinned
    wheel from PyPI under the cache, installed on first use."""
    if found := installed_cublas(toolkit.major):
        include, lib = found
        print(f"[build-llama] linking the installed cuBLAS in {lib}", file=sys.stderr)
        return include, _linkable(cache, lib, toolkit.major)
    if toolkit.major != CUBLAS_CUDA_MAJOR:
        raise ToolchainError(
            f"the CUDA {toolkit.version} toolkit at {toolkit.root} has no cuBLAS, and only cuBLAS for "
            f"CUDA {CUBLAS_CUDA_MAJOR} is fetched automatically: install the toolkit's libcublas-dev"
        )
    target = cublas_dir(cache)
    # The wheel lays CUDA 13 libraries out as nvidia/cu13/{include,lib}.
    include, lib = target / "nvidia" / "cu13" / "include", target / "nvidia" / "cu13" / "lib"
    with file_lock(target.with_name(target.name + ".lock")):
        if not (lib / "libcublas.so.13").is_file():
            partial = target.with_name(target.name + ".part")
            shutil.rmtree(partial, ignore_errors=True)
            cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile"]
            cmd += ["--target", str(partial), f"{CUBLAS_PACKAGE}=={CUBLAS_VERSION}"]
            print(f"[build-llama] fetching {CUBLAS_PACKAGE}=={CUBLAS_VERSION} into {target}", file=sys.stderr)
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                shutil.rmtree(partial, ignore_errors=True)
                tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
                raise ToolchainError(f"pip cannot install {CUBLAS_PACKAGE}=={CUBLAS_VERSION}: {tail}")
            shutil.rmtree(target, ignore_errors=True)
            partial.rename(target)
        # The linker looks for the unversioned names; the wheel ships only the sonames.
        for name in ("libcublas.so", "libcublasLt.so"):
            link = lib / name
            if not link.exists():
                link.unlink(missing_ok=True)
                link.symlink_to(f"{name}.13")
    if not (include / "cublas_v2.h").is_file():
        raise ToolchainError(f"{CUBLAS_PACKAGE}=={CUBLAS_VERSION} installed without cublas_v2.h under {include}")
    return include, lib


def _toolkit_has_driver_stub(toolkit: Toolkit) -> bool:
    """Full toolkits ship their own link stub of libcuda.so, which CMake finds by itself."""
    stub_dirs = [toolkit.root / d / "stubs" for d in ("lib64", "lib")]
    stub_dirs += list((toolkit.root / "targets").glob("*/lib/stubs"))
    return any((d / "libcuda.so").exists() for d in stub_dirs)


def _c_compiler() -> str:
    cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if not cc or not shutil.which(cc):
        raise ToolchainError("no C compiler found on PATH to build the libcuda stub: install one (e.g. gcc)")
    return cc


def build_driver_stub(cache: Path, toolkit: Toolkit) -> Path:
    """libcuda.so (soname libcuda.so.1) from cuda_stub/libcuda_stub.c, rebuilt when the source changes."""
    source = STUB_SOURCE.read_bytes()
    digest = hashlib.sha256(source + toolkit.version.encode()).hexdigest()[:16]
    out_dir = cache / "cuda" / "stub" / digest
    stub = out_dir / "libcuda.so"
    with file_lock(cache / "cuda" / "stub.lock"):
        if stub.is_file():
            return stub
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / "libcuda.so.tmp"
        cmd = [_c_compiler(), "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror"]
        cmd += [f"-I{toolkit.root / 'include'}", f"-Wl,-soname,{STUB_SONAME}", "-o", str(tmp), str(STUB_SOURCE)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            first = (result.stderr.strip().splitlines() or ["no output"])[0]
            raise ToolchainError(f"cannot build the libcuda stub from {STUB_SOURCE.name}: {first}")
        tmp.replace(stub)
    return stub


def cmake_flags(cache: Path, toolkit: Toolkit | None = None) -> list[str]:
    """The -D flags that let CMake configure and link ggml-cuda with this machine's toolkit.

    They say where things are, not what is built, so build.py keeps them out of the build key.
    """
    toolkit = toolkit or find_toolkit()
    flags = [f"-DCMAKE_CUDA_COMPILER={toolkit.nvcc}", f"-DCUDAToolkit_ROOT={toolkit.root}"]
    if not _find_cublas(toolkit):
        include, lib = install_cublas(cache, toolkit)
        # FindCUDAToolkit searches only the toolkit's folders; name the libraries, and give nvcc the
        # headers (only .cu files include cublas_v2.h).
        flags += [
            f"-DCUDA_cublas_LIBRARY={lib / 'libcublas.so'}",
            f"-DCUDA_cublasLt_LIBRARY={lib / 'libcublasLt.so'}",
            f"-DCMAKE_CUDA_FLAGS=-I{include}",
        ]
    if not _toolkit_has_driver_stub(toolkit):
        flags.append(f"-DCUDA_cuda_driver_LIBRARY={build_driver_stub(cache, toolkit)}")
    return flags
