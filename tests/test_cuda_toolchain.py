"""The CUDA compile check's toolchain (docs/test-bed.md, "CUDA compile check").

What makes `moe-l2 build-llama --cuda` link on a machine without a GPU: the libcuda stub exports
every driver function the pinned ggml-cuda calls, with the driver's soname; the flags handed to
CMake name files that exist; a bad --arch is one error line. The full CUDA build (30+ minutes on
2 cores when cold) runs with MOE_L2_TEST_CUDA_BUILD=1 (`make check-cuda`), or by itself when this
machine's ccache already holds a CUDA build for the architecture (then a patch edit costs minutes).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from moe_l2_llama import build as build_mod
from moe_l2_llama import cuda_toolchain as tc

BUILD_SCRIPT = Path(build_mod.__file__)


def toolkit_or_skip() -> tc.Toolkit:
    try:
        return tc.find_toolkit()
    except tc.ToolchainError as exc:
        pytest.skip(f"no CUDA toolkit here: {exc}")


@pytest.fixture(scope="module")
def toolkit() -> tc.Toolkit:
    return toolkit_or_skip()


def readelf_dynamic(path: Path) -> str:
    return subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout


def exported_symbols(lib: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}


def driver_calls_of_ggml_cuda(toolkit: tc.Toolkit) -> set[str]:
    """Driver API symbols the pinned ggml-cuda sources call: identifiers that cuda.h declares as
    driver functions, mapped through its `#define cuX cuX_v2` aliases to the linked names."""
    cuda_h = (toolkit.root / "include" / "cuda.h").read_text(errors="replace")
    declared = set(re.findall(r"^CUresult CUDAAPI (cu\w+)\(", cuda_h, re.M))
    aliases = dict(re.findall(r"^#\s*define (cu\w+)\s+(cu\w+_v\d+)\s*$", cuda_h, re.M))
    prefix = f"{build_mod.VENDOR_PREFIX}ggml/src/ggml-cuda/"
    called: set[str] = set()
    with tarfile.open(build_mod.fetch_sdist(build_mod.default_cache_dir())) as tar:
        for member in tar.getmembers():
            if member.name.startswith(prefix) and member.name.endswith((".cu", ".cuh", ".h")):
                text = tar.extractfile(member).read().decode(errors="replace")  # type: ignore[union-attr]
                called |= set(re.findall(r"\b(cu[A-Z]\w*)\s*\(", text))
    names = {aliases.get(name, name) for name in called}
    return names & (declared | set(aliases.values()))


def test_stub_exports_every_driver_call_with_the_driver_soname(tmp_path: Path, toolkit: tc.Toolkit) -> None:
    stub = tc.build_driver_stub(tmp_path, toolkit)
    assert f"Library soname: [{tc.STUB_SONAME}]" in readelf_dynamic(stub)
    needed = driver_calls_of_ggml_cuda(toolkit)
    # the VMM pool at least: if this set is empty the source scan itself is broken
    assert {"cuMemCreate", "cuMemMap", "cuDeviceGet"} <= needed
    missing = needed - exported_symbols(stub)
    assert not missing, f"add these to services/llama/cuda_stub/libcuda_stub.c: {sorted(missing)}"
    # a second call reuses the library; an edited source would get a new folder
    assert tc.build_driver_stub(tmp_path, toolkit) == stub


def test_flags_name_files_that_exist(toolkit: tc.Toolkit) -> None:
    # the user's cache: cuBLAS from PyPI is 570 MB, fetched once and shared with real builds
    flags = tc.cmake_flags(build_mod.default_cache_dir(), toolkit)
    values = dict(flag[2:].split("=", 1) for flag in flags)
    assert Path(values["CMAKE_CUDA_COMPILER"]).is_file()
    assert (Path(values["CUDAToolkit_ROOT"]) / "include" / "cuda_runtime.h").is_file()
    for name in ("CUDA_cublas_LIBRARY", "CUDA_cublasLt_LIBRARY", "CUDA_cuda_driver_LIBRARY"):
        if name in values:  # absent where the toolkit has its own, which CMake finds
            assert Path(values[name]).resolve().is_file(), name
    if "CUDA_cublas_LIBRARY" in values:
        assert Path(values["CUDA_cublas_LIBRARY"]).resolve().name == "libcublas.so.13"
        include = Path(values["CMAKE_CUDA_FLAGS"].removeprefix("-I"))
        assert (include / "cublas_v2.h").is_file()
    if "CUDA_cuda_driver_LIBRARY" in values:
        assert f"[{tc.STUB_SONAME}]" in readelf_dynamic(Path(values["CUDA_cuda_driver_LIBRARY"]))
    # where things are, not what is built: the build key stays the same on every machine
    assert not set(flags) & set(build_mod.BuildConfig(backend="cuda").cmake_flags())


def test_arch_values(toolkit: tc.Toolkit) -> None:
    assert tc.resolve_arch("90", toolkit) == "90"
    assert tc.resolve_arch(" 86;90a-real ", toolkit) == "86;90a-real"
    assert tc.resolve_arch("all-major", toolkit) == "all-major"
    native = tc.gpu_archs(toolkit)
    if native:
        assert tc.resolve_arch("native", toolkit) == native
    else:
        with pytest.raises(tc.ToolchainError, match="needs a GPU"):
            tc.resolve_arch("native", toolkit)


@pytest.mark.parametrize(
    ("arch", "message"),
    [
        ("9x", "error: unknown --arch value '9x'"),
        ("90;sm_80", "error: unknown --arch value 'sm_80'"),
        ("12", "error: --arch 12 is not supported by nvcc"),
    ],
)
def test_bad_arch_is_one_line(tmp_path: Path, toolkit: tc.Toolkit, arch: str, message: str) -> None:
    # run as the image runs it, a script next to cuda_toolchain.py; nothing is fetched or built
    env = {**os.environ, "MOE_L2_BUILD_CACHE_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, str(BUILD_SCRIPT), "--cuda", "--arch", arch],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr
    assert not any(tmp_path.iterdir())


def test_pip_failure_is_one_line(tmp_path: Path, toolkit: tc.Toolkit, monkeypatch: pytest.MonkeyPatch) -> None:
    if toolkit.major != tc.CUBLAS_CUDA_MAJOR:
        pytest.skip(f"cuBLAS is fetched only for CUDA {tc.CUBLAS_CUDA_MAJOR}")
    # a pip that can reach no index and no wheel folder: the real pip, failing for real
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(tc.ToolchainError) as info:
        tc.install_cublas(tmp_path / "cache", toolkit)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"pip cannot install nvidia-cublas=={tc.CUBLAS_VERSION}: ")
    assert not tc.cublas_dir(tmp_path / "cache").exists()


def test_an_installed_cublas_wheel_is_linked_offline(
    tmp_path: Path, toolkit: tc.Toolkit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lent GPU machine is offline but its PyTorch environment has a cuBLAS wheel: use that."""
    fetched = tc.cublas_dir(build_mod.default_cache_dir())
    if toolkit.major != tc.CUBLAS_CUDA_MAJOR or not (fetched / "nvidia" / "cu13" / "lib").is_dir():
        pytest.skip("no cuBLAS 13 wheel on this machine to stand for an installed one")
    # the wheel's layout, its files linked rather than copied (half a GB): sonames only, as installed
    site = tmp_path / "site-packages"
    (site / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    (site / "nvidia" / "cu13" / "include").symlink_to(fetched / "nvidia" / "cu13" / "include")
    for lib_file in (fetched / "nvidia" / "cu13" / "lib").glob("*.so.13"):
        (site / "nvidia" / "cu13" / "lib" / lib_file.name).symlink_to(lib_file)
    assert tc.installed_cublas(toolkit.major, [str(tmp_path), str(site)]) == (
        site / "nvidia" / "cu13" / "include",
        site / "nvidia" / "cu13" / "lib",
    )
    assert tc.installed_cublas(toolkit.major, [str(tmp_path)]) is None
    assert tc.installed_cublas(toolkit.major + 1, [str(site)]) is None

    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # nothing may be fetched
    include, lib = tc.install_cublas(tmp_path / "cache", toolkit)
    assert include == site / "nvidia" / "cu13" / "include"
    for name in ("libcublas.so", "libcublasLt.so", "libcublas.so.13", "libcublasLt.so.13"):
        assert (lib / name).resolve() == (site / "nvidia" / "cu13" / "lib" / f"{name.split('.so')[0]}.so.13").resolve()
    assert not tc.cublas_dir(tmp_path / "cache").exists()  # nothing was fetched


def warm_cuda_cache(arch: str, config: build_mod.BuildConfig) -> bool:
    """Whether the CUDA build for arch costs minutes here, not 30: its binary is cached, or an
    earlier CUDA build for arch went through ccache with the same patches to ggml/ (so every
    ggml-cuda object is a ccache hit). A build-info without `ggml_patches` (older builds) is cold."""
    cache = build_mod.default_cache_dir()
    patches = build_mod.patch_files(build_mod.default_patches_dir())
    if build_mod.cached_binary(cache, build_mod.build_key(config, patches)).is_file():
        return True
    if not (cache / "ccache").is_dir() and not os.environ.get("CCACHE_DIR"):
        return False
    wanted = build_mod.ggml_patches(patches)
    for info_path in (cache / "llama").glob("*/build-info.json"):
        try:
            info = json.loads(info_path.read_text())
        except (OSError, ValueError):
            continue
        flags = info.get("cmake_flags", [])
        if (
            info.get("backend") == "cuda"
            and info.get("ccache")
            and f"-DCMAKE_CUDA_ARCHITECTURES={arch}" in flags
            and info.get("ggml_patches") == wanted
        ):
            return True
    return False


@pytest.mark.cuda_build
def test_cuda_server_builds_and_links(toolkit: tc.Toolkit) -> None:
    """MOE_L2_TEST_CUDA_BUILD=1 runs it (make check-cuda), =0 never; unset, it runs on a warm cache."""
    arch = tc.resolve_arch(os.environ.get("MOE_L2_TEST_CUDA_ARCH", "90"), toolkit)
    config = build_mod.BuildConfig(backend="cuda", cuda_architectures=arch, native=False, test_hooks=True)
    wanted = os.environ.get("MOE_L2_TEST_CUDA_BUILD")
    if wanted == "0" or (wanted != "1" and not warm_cuda_cache(arch, config)):
        pytest.skip(f"CUDA build for --arch {arch}: 30+ min on a cold cache; run `make check-cuda`")
    binary = build_mod.build(config)
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf_dynamic(binary)))
    # the driver by its real soname (the stub's), cuBLAS and the runtime of this toolkit's major
    major = toolkit.major
    assert {"libcuda.so.1", f"libcublas.so.{major}", f"libcudart.so.{major}"} <= needed, needed
