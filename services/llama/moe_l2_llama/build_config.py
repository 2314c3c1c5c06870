"""What is built: the pinned llama.cpp source (the llama-cpp-python sdist and its sha256), the backends and
targets, the CMake flags, and BuildConfig, the choice of one build; BuildError, the one-line failure.

Separate from the steps of a build (source, patching, cmake_build) so that each of them, the cache's key
(build_cache) and `moe-l2 bump-llama` read one definition of what a build is.

Standard library only, like build.py: the llama image runs build.py as a script, in a bare builder stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
VENDOR_PREFIX = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
DEFAULT_INDEX = "https://pypi.org/simple"
CUDA_ARCHITECTURES = "61;75;86;89;90;120"
BACKENDS = ("cpu", "vulkan", "cuda", "rpc")
RPC_SERVER = "ggml-rpc-server"
# upstream's tests/test-backend-ops, with patch 0035's --expert-cache (tests/test_backend_ops.py runs it): kept next
# to llama-server in the test builds of the backends it is run on, the CPU, Vulkan (llvmpipe) and RPC ones (the RPC
# device's cases are the llvmpipe ones' twins, tests/ci_policy.py); the CUDA build leaves it out (its tests and the
# GPU check do not run it) and saves its compile (~1 min on 2 cores)
BACKEND_OPS = "test-backend-ops"
BACKEND_OPS_BACKENDS = ("cpu", "vulkan", "rpc")
# upstream's tests/test-llama-archs, with patch 0036's --n-expert/--n-expert-used: it writes the random models of
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
