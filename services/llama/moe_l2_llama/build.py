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

The steps live in their own modules, each importable alone: build_config (what is built, BuildConfig),
source (fetch, verify, extract), patching (the series), cmake_build (toolchain, configure, compile,
ccache), progress (the bar and the log lines) and build_cache (the key, the cache's contents). This
module runs them in order (build) and is the command line (`moe-l2 build-llama`, main); it re-exports
the names callers import from moe_l2_llama.build.

Standard library only, as is everything it imports: the llama image runs this file as a script
(`python3 services/llama/moe_l2_llama/build.py`) in a bare builder stage, with no package installed.
Run so, it runs itself as the package's module, as `python -m moe_l2_llama.build` would (the
folder above the package goes on the path), so that every module of the build imports its siblings
one way only, relatively.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # Run as a script, not as a module of its package: the package's folder, which Python put on the
    # path, gives way to the folder above it (no module is importable under a second name), and the
    # package's module runs in place of this one. The package's __init__ imports nothing.
    _package_dir = Path(__file__).resolve().parent
    sys.path[:] = [str(_package_dir.parent), *(p for p in sys.path if Path(p or ".").resolve() != _package_dir)]
    import importlib

    sys.exit(importlib.import_module(f"{_package_dir.name}.build").main())

from . import cuda_toolchain
from .build_cache import (
    BUILD_CACHE_ENV,
    OLD_BUILD_CACHE_ENV,
    CachedBuild,
    _complete,
    backend_ops_binary,
    build_key,
    built_binary,
    built_with_patch,
    built_with_test_hooks,
    cached_binary,
    cached_builds,
    cpu_isa,
    default_cache_dir,
    rpc_server_binary,
)
from .build_config import (
    BACKEND_OPS,
    BACKEND_OPS_BACKENDS,
    BACKENDS,
    BASE_CMAKE_FLAGS,
    CCACHE_MAX_SIZE,
    CUDA_ARCHITECTURES,
    DEFAULT_INDEX,
    LLAMA_ARCHS,
    LLAMA_ARCHS_BACKENDS,
    LLAMA_CPP_COMMIT,
    LLAMA_CPP_PYTHON_VERSION,
    RPC_SERVER,
    SDIST_NAME,
    SDIST_SHA256,
    VENDOR_PREFIX,
    BuildConfig,
    BuildError,
)
from .cmake_build import (
    VULKAN_APT_PACKAGES,
    VULKAN_BUILD_PACKAGES,
    ccache_env,
    check_toolchain,
    compile_server,
    cuda_flags,
    launcher_flags,
    missing_vulkan_packages,
    run_logged,
)
from .locking import file_lock
from .patching import apply_patches, default_patches_dir, ggml_patches, patch_files
from .progress import Progress, log
from .source import (
    download,
    export_source,
    extract_llama_cpp,
    extract_source,
    fetch_sdist,
    pip_download,
    sdist_url,
    sha256_file,
)

# what callers import from moe_l2_llama.build, wherever it is defined now
__all__ = [
    "BACKENDS",
    "BACKEND_OPS",
    "BACKEND_OPS_BACKENDS",
    "BASE_CMAKE_FLAGS",
    "BUILD_CACHE_ENV",
    "CCACHE_MAX_SIZE",
    "CUDA_ARCHITECTURES",
    "DEFAULT_INDEX",
    "LLAMA_ARCHS",
    "LLAMA_ARCHS_BACKENDS",
    "LLAMA_CPP_COMMIT",
    "LLAMA_CPP_PYTHON_VERSION",
    "OLD_BUILD_CACHE_ENV",
    "RPC_SERVER",
    "SDIST_NAME",
    "SDIST_SHA256",
    "VENDOR_PREFIX",
    "VULKAN_APT_PACKAGES",
    "VULKAN_BUILD_PACKAGES",
    "BuildConfig",
    "BuildError",
    "CachedBuild",
    "Progress",
    "apply_patches",
    "backend_ops_binary",
    "build",
    "build_key",
    "built_binary",
    "built_with_patch",
    "built_with_test_hooks",
    "cached_binary",
    "cached_builds",
    "ccache_env",
    "check_toolchain",
    "compile_server",
    "cpu_isa",
    "cuda_flags",
    "default_cache_dir",
    "default_patches_dir",
    "download",
    "export_source",
    "extract_llama_cpp",
    "extract_source",
    "fetch_sdist",
    "ggml_patches",
    "launcher_flags",
    "log",
    "main",
    "missing_vulkan_packages",
    "parse_args",
    "patch_files",
    "pip_download",
    "rpc_server_binary",
    "run_logged",
    "sdist_url",
    "sha256_file",
]


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
