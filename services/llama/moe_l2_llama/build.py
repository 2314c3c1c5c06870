"""Build the patched llama-server from the pinned llama.cpp source.

The source is the llama.cpp tree vendored in the PyPI sdist of llama-cpp-python (a registry that
both developer machines and image builds can reach), verified by its sha256. The project's patch
series is applied in order on a clean copy, then only the `llama-server` target is built (and in the CPU,
Vulkan and RPC test builds upstream's `test-backend-ops`, which tests/test_backend_ops.py runs). The
result is cached under a key made of the source hash, the patch hashes and the build flags, so a
second call returns at once.

A build serves unless asked otherwise: `BuildConfig()` and `moe-l2 build-llama` leave the patch series'
test-only hooks out (what `moe-l2 up`, `make run` and the images serve). The test suite's builds ask for them
(`BuildConfig(test_hooks=True)` in tests/conftest.py, `--test-hooks` in `make test` and `make check-cuda`), and
so must anything that replays a route trace (the GPU check, bench/expert_offload.py, bench/ram_tier.py).

Backends: the CPU (default), Vulkan (`--vulkan`: on a machine without a GPU, Mesa's llvmpipe is a
Vulkan device that runs on the CPU, the project's test bed for the device path), CUDA, and RPC
(`--rpc`: the CPU build with ggml's RPC backend, plus `ggml-rpc-server`; a llama-server started with
`--rpc host:port` treats that server as a device, the test bed where llvmpipe faults). When
`ccache` is on PATH every compile goes through it, so a patch edit (a new key, a new work tree)
recompiles only what the edit touched.

Standard library only: the llama image runs this file as a script in a bare CUDA builder stage.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

try:
    from . import cuda_toolchain, source_archive
    from .locking import file_lock
except ImportError:  # run as a script (the image's builder stage): the modules sit next to this file
    import cuda_toolchain
    import source_archive
    from locking import file_lock

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
VENDOR_PREFIX = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
DEFAULT_INDEX = "https://pypi.org/simple"
CUDA_ARCHITECTURES = "61;75;86;89;90;120"
BACKENDS = ("cpu", "vulkan", "cuda", "rpc")
RPC_SERVER = "ggml-rpc-server"
# upstream's tests/test-backend-ops, with patch 0025's --expert-cache (tests/test_backend_ops.py runs it): kept next
# to llama-server in the test builds of the backends it is run on, the CPU, Vulkan (llvmpipe) and RPC ones (the RPC
# device's cases are the llvmpipe ones' twins, tests/ci_policy.py); the CUDA build leaves it out (its tests and the
# GPU check do not run it) and saves its compile (~1 min on 2 cores)
BACKEND_OPS = "test-backend-ops"
BACKEND_OPS_BACKENDS = ("cpu", "vulkan", "rpc")
# upstream's tests/test-llama-archs, with patch 0026's --n-expert/--n-expert-used: it writes the random models of
# every architecture that tests/test_llama_archs.py runs through the expert cache, on the RPC device
LLAMA_ARCHS = "test-llama-archs"
LLAMA_ARCHS_BACKENDS = ("rpc",)
CCACHE_MAX_SIZE = "5G"

# Offline: no web UI download, no TLS, nothing but the server.
BASE_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)


class BuildError(Exception):
    """A build that cannot proceed; the message is one line meant for the user."""


@dataclass(frozen=True)
class BuildConfig:
    backend: str = "cpu"  # one of BACKENDS
    cuda_architectures: str = CUDA_ARCHITECTURES
    # ggml's CPU code for this machine's CPU (GGML_NATIVE=ON, -march=native): with --cpu-moe it computes
    # the experts, on a GPU build too. Images and binaries carried to another machine turn it off
    # (`--portable`), and then get llama.cpp's x86-64 baseline (AVX2, no AVX-512 or AMX).
    native: bool = True
    # the patch series' test-only hooks (-DLLAMA_MOE_TEST_HOOKS: the route-trace override LLAMA_MOE_ROUTE_TRACE,
    # and upstream's test programs beside llama-server, see targets()). Off by default: the default is what
    # `moe-l2 up` and the images serve, and a serving binary has no use for a hook that overrides the router.
    # The tests and the trace-replaying benchmarks ask for them (test_hooks=True, `--test-hooks`). A CMake flag,
    # so a test build and a serving build have different keys and both stay cached.
    test_hooks: bool = False
    extra_flags: tuple[str, ...] = field(default_factory=tuple)

    def cmake_flags(self) -> list[str]:
        flags = list(BASE_CMAKE_FLAGS)
        if self.test_hooks:
            # upstream's tests configured (only the targets() are built): a test build's test-backend-ops
            flags[flags.index("-DLLAMA_BUILD_TESTS=OFF")] = "-DLLAMA_BUILD_TESTS=ON"
        flags.append(f"-DGGML_NATIVE={'ON' if self.native else 'OFF'}")
        flags.append(f"-DLLAMA_MOE_TEST_HOOKS={'ON' if self.test_hooks else 'OFF'}")
        if self.backend == "vulkan":
            flags.append("-DGGML_VULKAN=ON")
        if self.backend == "cuda":
            flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={self.cuda_architectures}"]
            # libcuda.so is only a stub in the devel image; the driver provides it at run time.
            flags.append("-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined")
        if self.backend == "rpc":
            # ggml's RPC client in llama-server (GGML_USE_RPC, a public define of ggml) and the target
            # ggml-rpc-server; the server side runs the CPU backend, the one a CPU build already has
            flags.append("-DGGML_RPC=ON")
        flags += list(self.extra_flags)
        return flags

    def targets(self) -> list[str]:
        """What is built and kept next to each other in bin/: the server, for RPC its device, and in the CPU and
        Vulkan test builds upstream's test-backend-ops."""
        targets = ["llama-server", RPC_SERVER] if self.backend == "rpc" else ["llama-server"]
        if self.test_hooks and self.backend in BACKEND_OPS_BACKENDS:
            targets.append(BACKEND_OPS)
        if self.test_hooks and self.backend in LLAMA_ARCHS_BACKENDS:
            targets.append(LLAMA_ARCHS)
        return targets


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


def default_patches_dir() -> Path:
    if env := os.environ.get("MOE_L2_PATCHES_DIR"):
        return Path(env)
    return Path(__file__).resolve().parent.parent / "patches"


def patch_files(patches_dir: Path) -> list[Path]:
    if not patches_dir.is_dir():
        raise BuildError(f"patch folder {patches_dir} does not exist")
    return sorted(patches_dir.glob("*.patch"))


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


class Progress:
    """A one-line progress bar on a terminal, a line every 10% elsewhere (CI logs)."""

    def __init__(self, label: str, stream=sys.stderr) -> None:  # noqa: ANN001
        self.label = label
        self.stream = stream
        self.tty = stream.isatty()
        self.last_decile = -1
        self.start = time.monotonic()

    def update(self, done: int, total: int) -> None:
        frac = done / total if total else 0.0
        elapsed = time.monotonic() - self.start
        if self.tty:
            width = 30
            filled = int(frac * width)
            bar = "#" * filled + "-" * (width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {done}/{total} {elapsed:5.0f}s")
            self.stream.flush()
        elif int(frac * 10) > self.last_decile:
            self.last_decile = int(frac * 10)
            self.stream.write(f"{self.label}: {done}/{total} ({frac:.0%}, {elapsed:.0f}s)\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def log(msg: str) -> None:
    print(f"[build-llama] {msg}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sdist_url(index: str) -> str:
    """The sdist's URL from the registry's simple index (PEP 691 JSON)."""
    req = urllib.request.Request(
        f"{index.rstrip('/')}/llama-cpp-python/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        files = json.load(resp)["files"]
    for entry in files:
        if entry["filename"] == SDIST_NAME:
            return entry["url"]
    raise BuildError(f"{SDIST_NAME} is not listed on {index}")


def download(url: str, dest: Path) -> None:
    tmp = dest.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=120) as resp, tmp.open("wb") as out:
        total = int(resp.headers.get("Content-Length") or 0)
        progress = Progress(f"downloading {SDIST_NAME}")
        done = 0
        while chunk := resp.read(1 << 20):
            out.write(chunk)
            done += len(chunk)
            progress.update(done >> 20, total >> 20)
        progress.close()
    tmp.replace(dest)


def pip_download(dest_dir: Path) -> None:
    """Fallback through pip, which honours the machine's own index configuration."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
    cmd += ["-d", str(dest_dir), f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(f"cannot download {SDIST_NAME}: {tail}")


def extract_source(cache: Path, dest: Path) -> None:
    """The llama.cpp tree into dest: from MOE_L2_LLAMA_SOURCE (a trimmed archive, verified file by
    file as it is extracted) where set, else from the verified sdist."""
    env = os.environ.get("MOE_L2_LLAMA_SOURCE")
    if not env:
        extract_llama_cpp(fetch_sdist(cache), dest)
        return
    archive = Path(env)
    if not archive.is_file():
        raise BuildError(f"MOE_L2_LLAMA_SOURCE={archive} does not exist")
    if dest.exists():
        shutil.rmtree(dest)
    try:
        count = source_archive.extract_verified(archive, dest)
    except source_archive.SourceArchiveError as exc:
        raise BuildError(str(exc)) from exc
    log(f"source: {archive.name}, {count} files verified against the pinned manifest")


def export_source(cache: Path, out: Path) -> Path:
    """Write the trimmed source archive (see source_archive.py) made from the verified sdist."""
    sdist = fetch_sdist(cache)
    log(f"trimming {sdist.name} into {out} (xz -9, about a minute)")
    try:
        count, digest = source_archive.write_trimmed(sdist, out, VENDOR_PREFIX)
    except (source_archive.SourceArchiveError, tarfile.TarError, OSError) as exc:
        raise BuildError(f"cannot write {out}: {exc}") from exc
    if digest != source_archive.MANIFEST_SHA256:
        out.unlink(missing_ok=True)
        stale = "source_archive.py's pin is stale"
        raise BuildError(f"the trimmed manifest's sha256 {digest[:12]}… is not the pinned one; {stale}")
    log(f"{count} files, {out.stat().st_size / 2**20:.1f} MiB; build from it with MOE_L2_LLAMA_SOURCE={out}")
    return out


def fetch_sdist(cache: Path) -> Path:
    """The verified source archive: MOE_L2_LLAMA_SDIST, else the cache, else the registry."""
    if env := os.environ.get("MOE_L2_LLAMA_SDIST"):
        archive = Path(env)
        if not archive.is_file():
            raise BuildError(f"MOE_L2_LLAMA_SDIST={archive} does not exist")
    else:
        archive = cache / "src" / SDIST_NAME
        if not archive.is_file():
            archive.parent.mkdir(parents=True, exist_ok=True)
            index = os.environ.get("MOE_L2_PYPI_INDEX", DEFAULT_INDEX)
            log(f"fetching {SDIST_NAME} (llama.cpp {LLAMA_CPP_COMMIT[:7]})")
            try:
                download(sdist_url(index), archive)
            except (OSError, KeyError, ValueError) as exc:
                log(f"direct download failed ({exc}); trying pip download")
                pip_download(archive.parent)
    actual = sha256_file(archive)
    if actual != SDIST_SHA256:
        if not os.environ.get("MOE_L2_LLAMA_SDIST"):
            archive.unlink(missing_ok=True)
            hint = "it was removed from the cache; run again to download it anew"
        else:
            hint = "replace it with the genuine archive"
        raise BuildError(f"{archive} is corrupted: sha256 {actual[:12]}… does not match {SDIST_SHA256[:12]}…; {hint}")
    return archive


def extract_llama_cpp(archive: Path, dest: Path) -> None:
    """Only the vendored llama.cpp tree, laid out as the root of dest."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    try:
        with tarfile.open(archive) as tar:
            members = []
            for member in tar.getmembers():
                if not member.name.startswith(VENDOR_PREFIX) or "/.git/" in member.name + "/":
                    continue
                member.name = member.name[len(VENDOR_PREFIX) :]
                if member.name:
                    members.append(member)
            extract_kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(dest, members=members, **extract_kwargs)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise BuildError(f"cannot extract {archive}: {exc}") from exc


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


def build(
    config: BuildConfig | None = None,
    *,
    cache: Path | None = None,
    patches_dir: Path | None = None,
    jobs: int | None = None,
    force: bool = False,
) -> Path:
    """Path of the patched llama-server, built now unless the cache has it."""
    config = config or BuildConfig()
    cache = cache or default_cache_dir()
    patches = patch_files(patches_dir or default_patches_dir())
    key = build_key(config, patches)
    binary = cached_binary(cache, key)
    if _complete(binary, config) and not force:
        return binary

    check_toolchain(config)  # a missing tool or package is one line before anything is written
    with file_lock(cache / "llama" / f"{key}.lock"):
        if _complete(binary, config) and not force:
            return binary
        toolchain_flags = cuda_flags(cache) if config.backend == "cuda" else []
        work = cache / "llama" / f"{key}.work"
        src, build_dir = work / "src", work / "build"
        log(f"building llama-server {key} ({config.backend}, {len(patches)} patches) in {work}")
        extract_source(cache, src)
        apply_patches(src, patches)
        log_path = work / "build.log"
        ccache = ccache_env(cache, work)
        if ccache is not None:
            log(f"compiling through ccache ({ccache['CCACHE_DIR']}, max {ccache['CCACHE_MAXSIZE']})")
        started = time.monotonic()
        built = compile_server(src, build_dir, config, jobs or os.cpu_count() or 2, log_path, ccache, toolchain_flags)
        elapsed = time.monotonic() - started

        out_dir = binary.parent
        out_dir.mkdir(parents=True, exist_ok=True)
        # llama-server last: its presence is what a second call checks first
        for target in reversed(config.targets()):
            shutil.copy2(built.parent / target, out_dir / f"{target}.tmp")
            (out_dir / f"{target}.tmp").replace(out_dir / target)
        info = {
            "key": key,
            "backend": config.backend,
            "llama_cpp_commit": LLAMA_CPP_COMMIT,
            "sdist_sha256": SDIST_SHA256,
            "patches": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in patches},
            "ggml_patches": ggml_patches(patches),
            "cmake_flags": config.cmake_flags(),
            "targets": config.targets(),
            "machine": platform.machine(),
            "native_cpu_isa": cpu_isa() if config.native else None,  # None: portable
            "ccache": ccache is not None,
            "compile_seconds": round(elapsed, 1),
        }
        (out_dir.parent / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
        # The tree and objects are 1+ GB; the binary is static and all that is kept.
        if not os.environ.get("MOE_L2_KEEP_BUILD_TREE"):
            shutil.rmtree(work, ignore_errors=True)
        log(f"built {binary} in {elapsed:.0f}s")
        return binary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="moe-l2 build-llama",
        description="Build llama-server from the pinned llama.cpp source with moe-l2's patches "
        "(cached: a second call returns at once).",
    )
    backend = parser.add_mutually_exclusive_group()
    backend.add_argument("--cuda", action="store_true", help="build the CUDA backend (needs nvcc)")
    backend.add_argument(
        "--vulkan",
        action="store_true",
        help="build the Vulkan backend (needs glslc, libvulkan-dev, spirv-headers; "
        "mesa-vulkan-drivers gives a software device on any machine)",
    )
    backend.add_argument(
        "--rpc",
        action="store_true",
        help=f"build the CPU backend with ggml's RPC backend, and {RPC_SERVER} next to llama-server: "
        f"`{RPC_SERVER} -p PORT` is a device for `llama-server --rpc 127.0.0.1:PORT` (the test bed)",
    )
    parser.add_argument(
        "--arch",
        "--cuda-architectures",
        dest="cuda_architectures",
        metavar="ARCH",
        default=CUDA_ARCHITECTURES,
        help=f"CUDA architectures for --cuda: 90, '86;90', or native on a machine with a GPU "
        f"(default {CUDA_ARCHITECTURES})",
    )
    parser.add_argument(
        "--portable",
        action="store_true",
        help="compile ggml's CPU code for any x86-64 CPU (GGML_NATIVE=OFF), not for this one: for images and "
        "binaries carried to another machine. Without it every backend's CPU code (which computes the experts "
        "with --cpu-moe) is tuned for this CPU",
    )
    parser.add_argument(
        "--test-hooks",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="build the test suite's binary: the patch series' test-only hooks (-DLLAMA_MOE_TEST_HOOKS, the "
        "LLAMA_MOE_ROUTE_TRACE replay) and, for the CPU, Vulkan and RPC backends, upstream's test programs next to "
        "llama-server (`make test` and `make check-cuda` pass it). Default: off, the build `moe-l2 up` serves",
    )
    parser.add_argument("--out", type=Path, help="also copy the binary to OUT/llama-server")
    parser.add_argument(
        "--cache-dir", type=Path, help="cache folder (default ~/.cache/moe-l2 or MOE_L2_BUILD_CACHE_DIR)"
    )
    parser.add_argument("--patches-dir", type=Path, help="patch series folder (default services/llama/patches)")
    parser.add_argument("-j", "--jobs", type=int, help="parallel compile jobs (default: all cores)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the cache has the binary")
    parser.add_argument(
        "--export-source",
        type=Path,
        metavar="FILE",
        help="write the trimmed, verifiable source archive (.tar.xz, ~9 MiB) for an offline machine "
        "and exit; build there with MOE_L2_LLAMA_SOURCE=FILE",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.export_source:
            print(export_source(args.cache_dir or default_cache_dir(), args.export_source))
            return 0
        # Checked against this nvcc before anything is fetched; `native` becomes this GPU's number.
        arch = cuda_toolchain.resolve_arch(args.cuda_architectures) if args.cuda else args.cuda_architectures
        config = BuildConfig(
            backend="cuda" if args.cuda else "vulkan" if args.vulkan else "rpc" if args.rpc else "cpu",
            cuda_architectures=arch,
            native=not args.portable,
            test_hooks=args.test_hooks,
        )
        binary = build(config, cache=args.cache_dir, patches_dir=args.patches_dir, jobs=args.jobs, force=args.force)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            for target in config.targets():
                shutil.copy2(binary.parent / target, args.out / target)
            binary = args.out / "llama-server"
    except (BuildError, cuda_toolchain.ToolchainError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: build interrupted", file=sys.stderr)
        return 130
    print(binary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
