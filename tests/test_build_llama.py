"""`moe-l2 build-llama`: cache hits, and one clear error line for each way a build cannot start."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from moe_l2_llama import build as build_mod
from moe_l2_llama import build_cache
from tests.conftest import engine_test_build

MOE = [sys.executable, "-m", "moe_l2_ops.cli", "build-llama"]
REPO = Path(__file__).resolve().parent.parent


def run_build(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MOE, *args], capture_output=True, text=True, env={**os.environ, **env}, timeout=600)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_cache_key_changes_with_patches_and_flags(tmp_path: Path) -> None:
    (tmp_path / "0001-a.patch").write_text("a")
    patches = build_mod.patch_files(tmp_path)
    cpu = build_mod.build_key(build_mod.BuildConfig(), patches)
    assert cpu == build_mod.build_key(build_mod.BuildConfig(), patches)
    assert cpu != build_mod.build_key(build_mod.BuildConfig(backend="cuda"), patches)
    (tmp_path / "0001-a.patch").write_text("b")
    assert cpu != build_mod.build_key(build_mod.BuildConfig(), build_mod.patch_files(tmp_path))
    assert cpu != build_mod.build_key(build_mod.BuildConfig(backend="vulkan"), patches)


def test_ccache_does_not_change_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the launchers go to the configure command only: a machine without ccache builds the same key
    config = build_mod.BuildConfig(backend="vulkan")
    launchers = build_mod.launcher_flags(config)
    assert launchers == ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    assert not set(launchers) & set(config.cmake_flags())
    assert "-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache" in build_mod.launcher_flags(build_mod.BuildConfig(backend="cuda"))
    monkeypatch.delenv("CCACHE_DIR", raising=False)
    monkeypatch.delenv("MOE_L2_CCACHE", raising=False)
    if shutil.which("ccache") is None:
        assert build_mod.ccache_env(tmp_path, tmp_path / "k.work") is None
        return
    env = build_mod.ccache_env(tmp_path, tmp_path / "k.work")
    assert env is not None
    # objects are shared between work trees (one per key) only with the tree's path out of the hash
    assert env["CCACHE_BASEDIR"] == str(tmp_path / "k.work")
    assert env["CCACHE_NOHASHDIR"] == "true"
    assert env["CCACHE_DIR"] == str(tmp_path / "ccache")
    monkeypatch.setenv("MOE_L2_CCACHE", "0")
    assert build_mod.ccache_env(tmp_path, tmp_path / "k.work") is None


def test_the_rpc_build_is_the_cpu_build_with_ggml_rpc_and_its_server(tmp_path: Path) -> None:
    (tmp_path / "0001-a.patch").write_text("a")
    patches = build_mod.patch_files(tmp_path)
    # the test builds (the RPC build is one only the tests use)
    cpu, rpc = build_mod.BuildConfig(test_hooks=True), build_mod.BuildConfig(backend="rpc", test_hooks=True)
    # its own key, so the CPU build (the service's) and the Vulkan and CUDA ones keep theirs
    assert rpc.cmake_flags() == [*cpu.cmake_flags(), "-DGGML_RPC=ON"]
    assert build_mod.build_key(rpc, patches) != build_mod.build_key(cpu, patches)
    assert not any(
        "RPC" in f for b in ("cpu", "vulkan", "cuda") for f in build_mod.BuildConfig(backend=b).cmake_flags()
    )
    # test-backend-ops: the llvmpipe cases' twins; test-llama-archs: every architecture's random model
    assert rpc.targets() == ["llama-server", "ggml-rpc-server", "test-backend-ops", "test-llama-archs"]
    assert cpu.targets() == ["llama-server", "test-backend-ops"]  # a test build's (tests/test_backend_ops.py)
    assert build_mod.BuildConfig(backend="rpc").targets() == ["llama-server", "ggml-rpc-server"]  # no test programs
    assert build_mod.rpc_server_binary(tmp_path / "bin" / "llama-server") == tmp_path / "bin" / "ggml-rpc-server"


def test_rpc_is_one_of_the_backends_the_cli_builds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    built: list[build_mod.BuildConfig] = []

    def fake_build(config: build_mod.BuildConfig, **_: object) -> Path:
        built.append(config)
        out = tmp_path / "cache" / "bin"
        out.mkdir(parents=True, exist_ok=True)
        for target in config.targets():
            (out / target).write_text(target)
        return out / "llama-server"

    monkeypatch.setattr(build_mod, "build", fake_build)
    assert build_mod.main(["--rpc", "--test-hooks", "--out", str(tmp_path / "out")]) == 0  # `make test`'s
    assert [c.backend for c in built] == ["rpc"]
    # a test build's RPC targets: the llvmpipe cases' twins (test-backend-ops), every architecture's model
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "ggml-rpc-server",
        "llama-server",
        "test-backend-ops",
        "test-llama-archs",
    ]
    with pytest.raises(SystemExit):
        build_mod.parse_args(["--rpc", "--vulkan"])  # one backend per build


def test_every_local_build_is_native_unless_portable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With --cpu-moe ggml's CPU code computes the experts, in a CUDA or Vulkan build too: a local build
    compiles it for this CPU; --portable (the images) for any x86-64 CPU."""
    built: list[build_mod.BuildConfig] = []

    def fake_build(config: build_mod.BuildConfig, **_: object) -> Path:
        built.append(config)
        return tmp_path / "llama-server"

    monkeypatch.setattr(build_mod, "build", fake_build)
    monkeypatch.setattr(build_mod.cuda_toolchain, "resolve_arch", lambda value: value)  # no nvcc asked
    for backend in ([], ["--cuda", "--arch", "90"], ["--vulkan"], ["--rpc"]):
        assert build_mod.main(backend) == 0
        assert build_mod.main([*backend, "--portable"]) == 0
    assert [(c.backend, c.native) for c in built] == [
        (b, native) for b in ("cpu", "cuda", "vulkan", "rpc") for native in (True, False)
    ]
    for config in built:
        assert f"-DGGML_NATIVE={'ON' if config.native else 'OFF'}" in config.cmake_flags()


def test_a_native_build_is_keyed_by_the_cpu_it_was_built_for(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A cache shared between hosts must not hand an AVX-512 binary to a CPU without it; a portable one
    runs anywhere, so its key ignores the CPU."""
    (tmp_path / "0001-a.patch").write_text("a")
    patches = build_mod.patch_files(tmp_path)
    native, portable = build_mod.BuildConfig(backend="cuda"), build_mod.BuildConfig(backend="cuda", native=False)
    assert build_mod.build_key(native, patches) != build_mod.build_key(portable, patches)
    keys, read_isa = {}, build_mod.cpu_isa
    for cpu, flags in {
        "avx2": "fpu sse4_2 avx avx2 fma constant_tsc",
        "avx512": "fpu sse4_2 avx avx2 fma avx512f",
    }.items():
        info = tmp_path / f"cpuinfo-{cpu}"
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        monkeypatch.setattr(build_cache, "cpu_isa", lambda info=info: read_isa(info))  # what build_key reads
        keys[cpu] = (build_mod.build_key(native, patches), build_mod.build_key(portable, patches))
    assert keys["avx2"][0] != keys["avx512"][0]
    assert keys["avx2"][1] == keys["avx512"][1]


def test_the_cpu_s_instruction_sets_are_what_a_native_key_reads(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    # the same ISA under another kernel (which names more power-management flags) keeps the key
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_int8 constant_tsc\nbugs\t\t: spectre_v1\n")
    assert build_mod.cpu_isa(info) == "amx_int8 avx2 avx512f"
    info.write_text("processor\t: 0\nflags\t\t: avx512f fpu user_shstk avx2 amx_int8\n")
    assert build_mod.cpu_isa(info) == "amx_int8 avx2 avx512f"
    info.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")  # aarch64
    assert build_mod.cpu_isa(info) == "asimd fp sve"
    assert build_mod.cpu_isa(tmp_path / "missing") == ""


@pytest.mark.llama
def test_second_call_is_a_cache_hit() -> None:
    # the test build `make test` made before pytest (built now if the suite started without it)
    llama_binary = build_mod.build(engine_test_build("cpu"))
    mtime = llama_binary.stat().st_mtime_ns
    result = run_build({}, "--test-hooks")
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == llama_binary
    assert "building" not in result.stderr
    assert llama_binary.stat().st_mtime_ns == mtime
    info = llama_binary.parent.parent / "build-info.json"
    assert build_mod.LLAMA_CPP_COMMIT in info.read_text()


def test_missing_cmake_is_one_clear_line(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    # Only the interpreter on PATH: no cmake, no compiler.
    (bare / "python").symlink_to(sys.executable)
    result = run_build({"PATH": str(bare), "MOE_L2_BUILD_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 1
    assert error_lines(result.stderr) == ["error: cmake not found on PATH: install it (e.g. `apt-get install cmake`)"]
    assert "Traceback" not in result.stderr


def test_missing_compiler_is_one_clear_line(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    cmake = shutil.which("cmake")
    assert cmake, "cmake is needed to build llama-server"
    (bare / "cmake").symlink_to(cmake)
    result = run_build({"PATH": str(bare), "CXX": "", "MOE_L2_BUILD_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 1
    assert len(error_lines(result.stderr)) == 1
    assert "no C++ compiler" in result.stderr


def test_corrupted_archive_is_one_clear_line(tmp_path: Path) -> None:
    bad = tmp_path / build_mod.SDIST_NAME
    bad.write_bytes(b"not a tarball" * 1000)
    result = run_build({"MOE_L2_LLAMA_SDIST": str(bad), "MOE_L2_BUILD_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 1
    lines = error_lines(result.stderr)
    assert len(lines) == 1
    assert "is corrupted: sha256" in lines[0]


def test_corrupted_cached_archive_is_removed(tmp_path: Path) -> None:
    cached = tmp_path / "cache" / "src" / build_mod.SDIST_NAME
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"\x1f\x8b truncated")
    result = run_build({"MOE_L2_BUILD_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 1
    assert "run again to download it anew" in error_lines(result.stderr)[0]
    assert not cached.exists()


@pytest.mark.llama
def test_patch_that_does_not_apply_is_one_clear_line(tmp_path: Path, llama_binary: Path) -> None:
    archive = build_mod.default_cache_dir() / "src" / build_mod.SDIST_NAME
    if not archive.is_file():
        pytest.skip("the source archive is not cached (MOE_L2_LLAMA_SDIST was used for the build)")
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "0001-bogus.patch").write_text(
        "--- a/include/llama.h\n+++ b/include/llama.h\n@@ -1,3 +1,3 @@\n-this line is not there\n+nor this\n"
    )
    result = run_build(
        {
            "MOE_L2_LLAMA_SDIST": str(archive),
            "MOE_L2_PATCHES_DIR": str(patches),
            "MOE_L2_BUILD_CACHE_DIR": str(tmp_path / "cache"),
        }
    )
    assert result.returncode == 1
    lines = error_lines(result.stderr)
    assert len(lines) == 1
    assert lines[0].startswith("error: patch 0001-bogus.patch does not apply to llama.cpp 0c1e570")


# The series in layers (docs/llama-fork.md): fixes meant for upstream, ggml, libllama (with common's
# parameters and flags), the server, and last the test-only hooks behind -DLLAMA_MOE_TEST_HOOKS.
SERIES = [
    "0001-server-blocking-disconnect.patch",
    "0002-mmap-prefetch-pieces.patch",
    "0003-vulkan-headers.patch",
    "0004-sched-expert-cache.patch",
    "0005-cpu-mul-mat-id-skip.patch",
    "0006-ubatch-seqs.patch",
    "0007-keep-moe-selection.patch",
    "0008-moe-willneed.patch",
    "0009-expert-cache.patch",
    "0010-expert-cache-renormalised-score.patch",
    "0011-expert-cache-profile.patch",
    "0012-expert-cache-prefetch.patch",
    "0013-expert-cache-domain-stats.patch",
    "0014-expert-cache-queries.patch",
    "0015-expert-cache-copy-stream.patch",
    "0016-expert-cache-preload.patch",
    "0017-expert-cache-prefill.patch",
    "0018-expert-cache-host-memory.patch",
    "0019-expert-cache-cpu-misses.patch",
    "0020-expert-cache-auto.patch",
    "0021-expert-cache-prompt-ahead.patch",
    "0022-routing-telemetry.patch",
    "0023-hot-set.patch",
    "0024-domain-tags.patch",
    "0025-admin-token.patch",
    "0026-server-draft-no-expert-cache.patch",
    "0027-server-expert-cache-domain.patch",
    "0028-server-expert-cache-metrics.patch",
    "0029-server-expert-cache-profile.patch",
    "0030-server-expert-cache-get.patch",
    "0031-server-hot-set-preload.patch",
    "0032-server-moe-transitions.patch",
    "0033-server-shutdown-drain.patch",
    "0034-route-trace.patch",
    "0035-test-backend-ops-expert-cache.patch",
    "0036-test-llama-archs-experts.patch",
]


def test_patch_series_applies_in_order() -> None:
    names = [p.name for p in build_mod.patch_files(build_mod.default_patches_dir())]
    assert names == sorted(names)
    assert names == SERIES


# Issue 47 split the two patches of several concerns into one patch per concern, the series renumbered around them
# (0010 -> 0010-0014, 0011-0021 -> 0015-0025, 0022 -> 0026-0031, 0023-0026 -> 0032-0035; the server's
# shutdown drain, new, then came in as 0033, the test-only patches after it). Each group of split
# patches does what the one patch did: the files it touches are, before the group and after it, what they were
# before and after the old patch in the 26-patch series (old 0001-0009 and 0001-0010, old 0001-0021 and 0001-0022
# applied to the pinned source), by the digest (tree_digest) recorded here. So no hunk moved out of a group, into
# a patch before or after it, and none moved in; with the final tree's manifest (below), the old and the new series
# differ only where one patch ends and the next begins. A later edit of a patch up to a group's end that changes
# those files changes the digests too: record them anew, on purpose, as for the manifest.
class Split(NamedTuple):
    old: str  # the patch of the 26-patch series the group split
    files: tuple[str, ...]  # what it touched
    before: str  # tree_digest of those files before it
    after: str  # and after it


SPLIT_GROUPS = {
    ("0010-expert-cache-renormalised-score.patch", "0014-expert-cache-queries.patch"): Split(
        "0010-expert-cache-profile.patch",
        (
            "common/arg.cpp",
            "include/llama.h",
            "src/llama-context.cpp",
            "src/llama-context.h",
            "src/llama-moe-cache.cpp",
            "src/llama-moe-cache.h",
        ),
        "a398ac91d95d32f28b1e3aecb936ded87ed8a1e3012a5a6c7f224c5d6f563f45",
        "fdbc837863d4127b72c2e8c2720884b7e2cc644acc14d655145f1d993a44f5b1",
    ),
    ("0026-server-draft-no-expert-cache.patch", "0031-server-hot-set-preload.patch"): Split(
        "0022-server-expert-cache.patch",
        (
            "tools/server/server-context.cpp",
            "tools/server/server-context.h",
            "tools/server/server-moe.cpp",
            "tools/server/server-moe.h",
            "tools/server/server.cpp",
        ),
        "5aa7ff780dda09e9cbd52f5ed2eaf2c4960d034295bf48da4756fcd307260f43",
        "03ffd877096a4dd80eda36c3d1ec2a61b7b274ae1656e4396d4d2c29f2388d2c",
    ),
}


def tree_digest(src: Path, paths: set[str]) -> str:
    """sha256 over `path NUL sha256(content)` lines of `paths` in src, sorted (an absent file hashes as empty)."""
    digest = build_mod.hashlib.sha256()
    for path in sorted(paths):
        data = (src / path).read_bytes() if (src / path).is_file() else b""
        digest.update(f"{path}\0{build_mod.hashlib.sha256(data).hexdigest()}\n".encode())
    return digest.hexdigest()


@pytest.mark.llama
def test_the_split_patches_do_what_the_patches_they_split_did(tmp_path: Path) -> None:
    """The series applied to the pinned source, one patch at a time: the files each group of split patches touches
    are, before the group and after it, what they were before and after the old patch it split."""
    patches = build_mod.patch_files(build_mod.default_patches_dir())
    names = [p.name for p in patches]
    src = tmp_path / "src"
    extract_files(src, set().union(*(touched_paths(p) for p in patches)))
    done = 0
    for (first, last), split in SPLIT_GROUPS.items():
        start, end = names.index(first), names.index(last) + 1
        files = set().union(*(touched_paths(p) for p in patches[start:end]))
        assert sorted(files) == list(split.files), f"{first}-{last} touch {sorted(files)}, not what {split.old} did"
        build_mod.apply_patches(src, patches[done:start])
        assert tree_digest(src, files) == split.before, f"before {first}, its files are not those before {split.old}"
        build_mod.apply_patches(src, patches[start:end])
        assert tree_digest(src, files) == split.after, f"the series up to {last} no longer makes what {split.old} made"
        done = end


# The tree the series makes: sha256 of every file it touches, recorded from the series of 2026-12-06 before
# it was relayered (27 patches in the order they were written). The relayered series must make the same
# tree but for these files, each of which may differ only by the lines that mention LLAMA_MOE_TEST_HOOKS
# and the `#else // LLAMA_MOE_TEST_HOOKS` branches they close: the route trace moved behind a CMake option.
SERIES_MANIFEST = Path(__file__).resolve().parent / "llama_series_manifest.json"
MOVED_BEHIND_TEST_HOOKS = {
    "CMakeLists.txt": "option(LLAMA_MOE_TEST_HOOKS ... OFF), defined for llama, common and the tools",
    "include/llama.h": "llama_get_ubatch_pos() is declared only with the test-only hooks",
    "src/llama-context.cpp": "llama_get_ubatch_pos() is defined only with the test-only hooks",
    "tools/server/server-moe-trace.h": "the route trace only with the hooks; without them a stub that replays nothing",
    "tools/server/server-moe-trace.cpp": "the route trace only with the hooks; without, its variable fails the load",
}


def without_test_hooks(text: bytes) -> bytes:
    """text less every line that mentions LLAMA_MOE_TEST_HOOKS and every `#else // LLAMA_MOE_TEST_HOOKS`
    branch up to its `#endif // LLAMA_MOE_TEST_HOOKS`: what the file was before the option."""
    kept, in_else = [], False
    for line in text.splitlines(keepends=True):
        if in_else:
            in_else = not line.startswith(b"#endif // LLAMA_MOE_TEST_HOOKS")
        elif line.startswith(b"#else // LLAMA_MOE_TEST_HOOKS"):
            in_else = True
        elif b"LLAMA_MOE_TEST_HOOKS" not in line:
            kept.append(line)
    return b"".join(kept)


def touched_paths(patch: Path) -> set[str]:
    return {line.split()[2][2:] for line in patch.read_text().splitlines() if line.startswith("diff --git a/")}


def tree_differences(src: Path, recorded: dict[str, str], touched: set[str]) -> list[str]:
    """How the tree in src differs from the recorded one, one line each; [] when it is the same."""
    sha = lambda data: build_mod.hashlib.sha256(data).hexdigest()  # noqa: E731
    problems = [f"{path}: touched, not in the manifest" for path in sorted(touched - set(recorded))]
    problems += [f"{path}: in the manifest, touched by no patch" for path in sorted(set(recorded) - touched)]
    for path in sorted(touched & set(recorded)):
        data = (src / path).read_bytes() if (src / path).is_file() else b""
        if path not in MOVED_BEHIND_TEST_HOOKS:
            if sha(data) != recorded[path]:
                problems.append(f"{path}: sha256 {sha(data)[:12]}, recorded {recorded[path][:12]}")
        elif sha(data) == recorded[path]:
            problems.append(f"{path}: listed as moved behind LLAMA_MOE_TEST_HOOKS, but unchanged")
        elif sha(without_test_hooks(data)) != recorded[path]:
            problems.append(f"{path}: differs by more than its LLAMA_MOE_TEST_HOOKS lines")
    return problems


@pytest.mark.llama
def test_the_series_makes_the_recorded_tree(tmp_path: Path) -> None:
    """The series applied to the pinned source gives, file by file, the tree recorded in
    tests/llama_series_manifest.json, except the listed moves. A dropped, reordered-into-conflict or
    edited patch fails here; so does an edit that belongs in the manifest (record it anew, on purpose)."""
    manifest = json.loads(SERIES_MANIFEST.read_text())
    assert manifest["llama_cpp_commit"] == build_mod.LLAMA_CPP_COMMIT, "the manifest is of another llama.cpp"
    patches = build_mod.patch_files(build_mod.default_patches_dir())
    touched = set().union(*(touched_paths(p) for p in patches))
    src = tmp_path / "src"
    extract_files(src, touched | set(manifest["files"]))
    build_mod.apply_patches(src, patches)
    assert tree_differences(src, manifest["files"], touched) == []


def extract_files(dest: Path, paths: set[str]) -> None:
    """Only `paths` of the pinned llama.cpp tree (those it has), from the verified sdist: a second or two."""
    import tarfile

    archive = build_mod.fetch_sdist(build_mod.default_cache_dir())
    dest.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        for member in tar:
            name = member.name[len(build_mod.VENDOR_PREFIX) :]
            if member.name.startswith(build_mod.VENDOR_PREFIX) and name in paths and member.isfile():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                (dest / name).write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]


def test_the_tree_check_catches_a_change_outside_the_moves(tmp_path: Path) -> None:
    """tree_differences on a small tree: equal, a moved file that differs only by its guards, an edit,
    a file the series no longer touches, and a moved file with one more line than its guards."""
    sha = lambda data: build_mod.hashlib.sha256(data).hexdigest()  # noqa: E731
    before = b"#include <a>\nint f();\n"
    guarded = (
        b"#include <a>\n#ifdef LLAMA_MOE_TEST_HOOKS\nint f();\n"
        b"#else // LLAMA_MOE_TEST_HOOKS\n// stub\n#endif // LLAMA_MOE_TEST_HOOKS\n"
    )
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "llama.h").write_bytes(guarded)
    (tmp_path / "x.cpp").write_bytes(b"x\n")
    recorded = {"include/llama.h": sha(before), "x.cpp": sha(b"x\n")}
    assert without_test_hooks(guarded) == before
    assert tree_differences(tmp_path, recorded, set(recorded)) == []
    (tmp_path / "x.cpp").write_bytes(b"y\n")
    edited = "x.cpp: sha256 " + sha(b"y\n")[:12] + ", recorded " + sha(b"x\n")[:12]
    assert tree_differences(tmp_path, recorded, set(recorded)) == [edited]
    assert tree_differences(tmp_path, recorded, {"include/llama.h"})[0] == "x.cpp: in the manifest, touched by no patch"
    (tmp_path / "include" / "llama.h").write_bytes(guarded + b"int g();\n")
    assert "include/llama.h: differs by more than its LLAMA_MOE_TEST_HOOKS lines" in tree_differences(
        tmp_path, recorded, set(recorded)
    )


def test_the_test_hooks_are_asked_for_and_never_in_a_serving_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The route trace (patch 0034) is built with -DLLAMA_MOE_TEST_HOOKS=ON only where asked for
    (BuildConfig(test_hooks=True), `--test-hooks`: the tests, `make check-cuda`, the trace-replaying benchmarks);
    BuildConfig's default and `moe-l2 build-llama`'s, with or without --portable, is the serving build."""
    assert "-DLLAMA_MOE_TEST_HOOKS=OFF" in build_mod.BuildConfig().cmake_flags()
    assert "-DLLAMA_MOE_TEST_HOOKS=ON" in build_mod.BuildConfig(test_hooks=True).cmake_flags()
    built: list[build_mod.BuildConfig] = []
    monkeypatch.setattr(build_mod, "build", lambda config, **_: built.append(config) or tmp_path / "llama-server")
    for args in ([], ["--portable"], ["--portable", "--test-hooks"], ["--test-hooks"], ["--no-test-hooks"]):
        assert build_mod.main(args) == 0
    assert [c.test_hooks for c in built] == [False, False, True, True, False]
    cmake = added_lines(build_mod.default_patches_dir() / "0034-route-trace.patch")["CMakeLists.txt"]
    option = [line for line in cmake if "option(" in line]
    assert len(option) == 1 and option[0].startswith("option(LLAMA_MOE_TEST_HOOKS ") and option[0].endswith(" OFF)")


def make_builds(target: str) -> list[list[str]]:
    """The arguments of each `$(MOE) build-llama` in a Makefile target's recipe."""
    text = (REPO / "Makefile").read_text()
    recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", text, re.MULTILINE)
    assert recipe, f"no `{target}` target in the Makefile"
    calls = []
    for args in re.findall(r"\$\(MOE\) build-llama(.*)", recipe[1]):
        args = args.split("&&")[0]
        while args.count(")") > args.count("("):  # the end of a $(if ...) around the call
            args = args[: args.rindex(")")]
        calls.append(shlex.split(args))
    return calls


def cli_configs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, calls: list[list[str]]) -> list[build_mod.BuildConfig]:
    """The BuildConfig `moe-l2 build-llama` builds for each call's arguments; nothing is compiled."""
    built: list[build_mod.BuildConfig] = []
    monkeypatch.setattr(build_mod, "build", lambda config, **_: built.append(config) or tmp_path / "llama-server")
    monkeypatch.setattr(build_mod.cuda_toolchain, "resolve_arch", lambda value: value)  # no nvcc asked
    for args in calls:
        assert build_mod.main(args) == 0, args
    return built


def test_make_test_prebuilds_the_builds_the_fixtures_use(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`make test` builds the engines before pytest, so their progress shows: the same configs as the fixtures
    (tests/conftest.py), key for key, or pytest would compile a second build of each. Both ask for the test hooks;
    `moe-l2 build-llama` alone builds the serving binary."""
    calls = make_builds("test")
    assert len(calls) == 3, calls
    assert cli_configs(monkeypatch, tmp_path, calls) == [engine_test_build(b) for b in ("cpu", "rpc", "vulkan")]


def test_make_check_cuda_builds_the_test_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """check-cuda's build is the one tests/test_cuda_toolchain.py links and inspects: portable, with the hooks."""
    (call,) = make_builds("check-cuda")
    (config,) = cli_configs(monkeypatch, tmp_path, [[arg.replace("$(ARCH)", "90") for arg in call]])
    assert (config.backend, config.native, config.test_hooks) == ("cuda", False, True)


def test_the_gpu_check_builds_with_the_test_hooks() -> None:
    """bench/gpu_check.sh replays a routing trace (LLAMA_MOE_ROUTE_TRACE, bench/expert_offload.py), which only
    a build with the test hooks has: its `python -m moe_l2_llama.build` asks for them."""
    text = (REPO / "bench" / "gpu_check.sh").read_text()
    (call,) = [line for line in text.splitlines() if "-m moe_l2_llama.build" in line and "BUILD_ARGS" in line]
    arrays = re.findall(r"BUILD_ARGS=\((.*)\)", text)
    assert arrays, "gpu_check.sh no longer sets BUILD_ARGS"
    assert "--test-hooks" in call or all("--test-hooks" in array for array in arrays), call


def test_test_backend_ops_is_built_where_it_runs_and_never_in_images() -> None:
    """Upstream's test-backend-ops (patch 0035's --expert-cache, tests/test_backend_ops.py) is configured in every
    test build and built in the CPU, Vulkan and RPC ones, where it runs; a build without the test hooks (the default:
    `moe-l2 up`'s, the images') keeps upstream's tests off, its flags and its targets as they were."""
    for backend in build_mod.BACKENDS:
        test_build = build_mod.BuildConfig(backend=backend, test_hooks=True)
        image = build_mod.BuildConfig(backend=backend, native=False)
        assert "-DLLAMA_BUILD_TESTS=ON" in test_build.cmake_flags()
        assert ("test-backend-ops" in test_build.targets()) == (backend in ("cpu", "vulkan", "rpc"))
        assert ("test-llama-archs" in test_build.targets()) == (backend == "rpc")
        assert "-DLLAMA_BUILD_TESTS=OFF" in image.cmake_flags() and "test-backend-ops" not in image.targets()
        assert "test-llama-archs" not in image.targets()
    assert build_mod.BuildConfig(native=False, test_hooks=False).cmake_flags()[: len(build_mod.BASE_CMAKE_FLAGS)] == [
        *build_mod.BASE_CMAKE_FLAGS
    ]


def test_every_patch_says_what_and_why() -> None:
    # one concern per patch, with a header a reviewer can read without the diff
    patches = build_mod.patch_files(build_mod.default_patches_dir())
    for i, patch in enumerate(patches, start=1):
        text = patch.read_text()
        header, sep, _ = text.partition("\n---\n")
        assert sep, f"{patch.name}: no '---' line between the message and the diff"
        subject = re.search(r"^Subject: \[PATCH (\d+)/(\d+)\] (.+)$", header, re.MULTILINE)
        assert subject, f"{patch.name}: no 'Subject: [PATCH i/n] ...' line"
        numbered = (int(subject[1]), int(subject[2]))
        assert numbered == (i, len(patches)), f"{patch.name}: numbered {numbered}, expected {(i, len(patches))}"
        body = header[subject.end() :].strip()
        assert len(body.split()) >= 30, f"{patch.name}: the message does not say what the patch does and why"


def added_lines(patch: Path) -> dict[str, list[str]]:
    """path -> the lines the patch adds to it."""
    added: dict[str, list[str]] = {}
    path = None
    for line in patch.read_text().splitlines():
        if line.startswith("diff --git a/"):
            path = line.split()[2][2:]
            added[path] = []
        elif path and line.startswith("+") and not line.startswith("+++ "):
            added[path].append(line[1:])
    return added


def test_the_libllama_changes_of_the_telemetry_are_patches_of_their_own() -> None:
    # 0006 and 0007 change libllama for any caller, 0022 is the server's use of them (and its flag, common's):
    # each reviewable alone
    patches = {p.name: added_lines(p) for p in build_mod.patch_files(build_mod.default_patches_dir())}
    assert set(patches["0006-ubatch-seqs.patch"]) == {"include/llama.h", "src/llama-context.cpp", "src/llama-context.h"}
    assert set(patches["0007-keep-moe-selection.patch"]) == {
        "include/llama.h",
        "src/llama-cparams.h",
        "src/llama-context.cpp",
        "common/common.h",
        "common/common.cpp",
    }
    assert all(
        path.startswith("tools/server/") or path in {"common/arg.cpp", "common/common.h"}
        for path in patches["0022-routing-telemetry.patch"]
    )


def test_the_server_takes_flags_not_variables() -> None:
    """Issue 47: the server's options are common/arg.cpp flags with LLAMA_ARG_* variables, as upstream's and the
    engine's; the server reads the environment only for the test-only route trace (0034) and, for one release,
    for the LLAMA_MOE_* variables it read before, each in one table with the variable and the flag it maps to."""
    getenv: dict[str, list[str]] = {}
    deprecated: dict[str, list[str]] = {}
    flags: dict[str, list[str]] = {}
    for patch in build_mod.patch_files(build_mod.default_patches_dir()):
        for path, lines in added_lines(patch).items():
            for line in lines:
                if path.startswith("tools/server/") and "getenv(" in line:
                    getenv.setdefault(patch.name[:4], []).append(line.strip())
                if path.startswith("tools/server/") and (found := re.match(r'\s*\{ "(LLAMA_MOE_\w+)", "(\w+)"', line)):
                    deprecated.setdefault(patch.name[:4], []).append(f"{found[1]} {found[2]}")
                flag = re.search(r'set_env\("(LLAMA_ARG_MOE_(?!CACHE)\w+)"\)', line)
                if path == "common/arg.cpp" and flag:
                    flags.setdefault(patch.name[:4], []).append(flag[1])
    assert getenv == {
        "0022": ["const char * val = std::getenv(var.name);", "if (std::getenv(var.arg_env) == nullptr) {"],
        "0034": ['const char * val = std::getenv("LLAMA_MOE_ROUTE_TRACE");'] * 2,
    }
    assert deprecated == {
        "0022": ["LLAMA_MOE_TELEMETRY LLAMA_ARG_MOE_TELEMETRY"],
        "0024": ["LLAMA_MOE_DOMAINS LLAMA_ARG_MOE_DOMAINS", "LLAMA_MOE_MAX_DOMAINS LLAMA_ARG_MOE_MAX_DOMAINS"],
        "0025": ["LLAMA_MOE_ADMIN_TOKEN LLAMA_ARG_MOE_ADMIN_TOKEN"],
        "0032": ["LLAMA_MOE_TRANSITIONS LLAMA_ARG_MOE_TRANSITIONS"],
    }
    assert flags == {
        "0008": ["LLAMA_ARG_MOE_WILLNEED"],
        "0022": ["LLAMA_ARG_MOE_TELEMETRY"],
        "0024": ["LLAMA_ARG_MOE_DOMAINS", "LLAMA_ARG_MOE_MAX_DOMAINS"],
        "0025": ["LLAMA_ARG_MOE_ADMIN_TOKEN", "LLAMA_ARG_MOE_ADMIN_TOKEN_FILE"],
        "0032": ["LLAMA_ARG_MOE_TRANSITIONS"],
    }


def test_libllama_and_ggml_read_no_environment_variable_of_ours() -> None:
    """What libllama and ggml do is set through their parameters (llama_context_params: the expert cache's
    access log, its copy stream), as upstream would have it; only the tools (common's flags, which read
    their LLAMA_ARG_* variables, and the server) read the environment."""
    readers = {}
    for patch in build_mod.patch_files(build_mod.default_patches_dir()):
        for path, lines in added_lines(patch).items():
            if path.startswith(("src/", "include/", "ggml/")) and any("getenv" in line for line in lines):
                readers.setdefault(patch.name, []).append(path)
    assert readers == {}


def test_the_moe_selection_is_kept_only_when_the_server_asks() -> None:
    """An installed eval callback (imatrix, llama-eval-callback, --verbose debugging) no longer keeps
    every layer's ffn_moe_argsort alive: only keep_moe_selection does, off by default, and only the
    server's MoE callback (telemetry, route trace, transitions) turns it on."""
    added: dict[str, list[str]] = {}
    for patch in build_mod.patch_files(build_mod.default_patches_dir()):
        for path, lines in added_lines(patch).items():
            added.setdefault(path, []).extend(lines)
    argsort = [line for line in added["src/llama-context.cpp"] if '"ffn_moe_argsort"' in line]
    assert argsort == ['        if (cparams.keep_moe_selection && strcmp(name, "ffn_moe_argsort") == 0) {']
    assert "        /*.keep_moe_selection          =*/ false," in added["src/llama-context.cpp"]
    assert any(re.match(r"\s*bool keep_moe_selection\s*=\s*false;", line) for line in added["common/common.h"])
    turned_on = {path for path, lines in added.items() if any("keep_moe_selection = true" in ln for ln in lines)}
    assert turned_on == {"tools/server/server-moe.cpp"}
    server_moe = added["tools/server/server-moe.cpp"]
    on = next(i for i, line in enumerate(server_moe) if "keep_moe_selection = true" in line)
    assert "params.cb_eval_user_data" in server_moe[on - 1], "set where the callback is installed, nowhere else"


def test_ggml_patches_are_the_patches_that_touch_ggml(tmp_path: Path) -> None:
    ggml_diff = "diff --git a/ggml/src/z.c b/ggml/src/z.c\n+int z;\n"
    (tmp_path / "0001-a.patch").write_text("Subject: [PATCH 1/3]\ndiff --git a/src/x.cpp b/src/x.cpp\n+x\n")
    (tmp_path / "0002-b.patch").write_text(f"Subject: [PATCH 2/3]\ndiff --git a/tools/y b/tools/y\n+y\n{ggml_diff}")
    (tmp_path / "0003-c.patch").write_text("a line that mentions diff --git a/ggml/ not at its start\n")
    touching = build_mod.ggml_patches(build_mod.patch_files(tmp_path))
    assert list(touching) == ["0002-b.patch"]
    before = touching["0002-b.patch"]
    # what is outside ggml/ does not count: a renumbered subject, another file's diff
    (tmp_path / "0002-b.patch").write_text(f"Subject: [PATCH 2/4]\ndiff --git a/tools/y b/tools/y\n+w\n{ggml_diff}")
    assert build_mod.ggml_patches(build_mod.patch_files(tmp_path)) == {"0002-b.patch": before}
    (tmp_path / "0002-b.patch").write_text(f"Subject: [PATCH 2/4]\n{ggml_diff}+int edit;\n")
    assert build_mod.ggml_patches(build_mod.patch_files(tmp_path))["0002-b.patch"] != before


def _fake_build(cache: Path, key: str, backend: str, patches: dict[str, str], flags: list[str]) -> Path:
    """A cache entry as build() leaves it: the binary (with the patch series' strings) and its build-info."""
    binary = cache / "llama" / key / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_bytes(b"\x7fELF ... moe_hot_hits_total ... /moe/hot-set ...")
    binary.chmod(0o755)
    info = {"key": key, "backend": backend, "sdist_sha256": build_mod.SDIST_SHA256, "patches": patches}
    (binary.parent.parent / "build-info.json").write_text(json.dumps({**info, "cmake_flags": flags}))
    return binary


def test_a_cuda_build_of_the_current_patches_is_current_whatever_its_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`build-llama --cuda --arch 90 --portable` builds for its own architectures and any CPU: doctor read
    the key with other defaults and called such a fresh build stale. It names the build `moe-l2 up`
    serves (here, with no GPU tool on PATH, the CPU one) and lists the others that are current."""
    from moe_l2_ops.doctor import check_llama_binary

    patches = build_mod.patch_files(build_mod.default_patches_dir())
    current = {p.name: build_mod.hashlib.sha256(p.read_bytes()).hexdigest() for p in patches}
    stale = {**current, patches[-1].name: "0" * 64}
    _fake_build(tmp_path, "aaaa", "cpu", stale, ["-DGGML_NATIVE=ON"])
    monkeypatch.setenv("MOE_L2_BUILD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))
    monkeypatch.delenv("MOE_L2_LLAMA_SERVER", raising=False)
    monkeypatch.delenv("MOE_L2_LLAMA_BACKEND", raising=False)
    check = check_llama_binary()
    assert check.status == "warn" and "the cache holds no build of the current patches" in check.detail

    _fake_build(tmp_path, "bbbb", "cuda", current, ["-DGGML_NATIVE=OFF", "-DCMAKE_CUDA_ARCHITECTURES=90"])
    builds = {b.key: b.current for b in build_mod.cached_builds(tmp_path, patches)}
    assert builds == {"aaaa": False, "bbbb": True}
    check = check_llama_binary()
    assert check.status == "warn" and check.detail.startswith("CPU build (no GPU: nvidia-smi not found")
    assert check.detail.endswith("(also current: cuda)") and "holds no build" not in check.detail


def test_the_experts_are_read_ahead_only_when_asked() -> None:
    """moe_willneed (patch 0008) is off by default, only the server's --moe-willneed turns it on, and the
    graph gains its node only then: off, llama.cpp's graph is unchanged."""
    added = added_lines(build_mod.default_patches_dir() / "0008-moe-willneed.patch")
    assert "        /*.moe_willneed                =*/ false," in added["src/llama-context.cpp"]
    assert any(re.match(r"\s*bool moe_willneed\s*=\s*false;", line) for line in added["common/common.h"])
    turned_on = [line.strip() for lines in added.values() for line in lines if "moe_willneed = true" in line]
    assert turned_on == ["params.moe_willneed = true;"]
    assert any('{"--moe-willneed"}' in line for line in added["common/arg.cpp"])
    graph = added["src/llama-graph.cpp"]
    built = [i for i, line in enumerate(graph) if "build_moe_willneed(selected_experts" in line]
    assert len(built) == 1 and graph[built[0] - 1].strip() == "if (cparams.moe_willneed) {"


def test_the_build_cache_s_old_variable_still_works_with_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """MOE_L2_CACHE_DIR read like a cache-manager setting (MOE_L2_CACHE_*): the build's is MOE_L2_BUILD_CACHE_DIR;
    the old name is read for one release, with one line, and the new one wins."""
    monkeypatch.delenv("MOE_L2_BUILD_CACHE_DIR", raising=False)
    monkeypatch.setenv("MOE_L2_CACHE_DIR", str(tmp_path / "old"))
    monkeypatch.setattr(build_cache, "_warned_old_cache_env", set())
    assert build_mod.default_cache_dir() == tmp_path / "old"
    assert build_mod.default_cache_dir() == tmp_path / "old"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["MOE_L2_CACHE_DIR is deprecated: set MOE_L2_BUILD_CACHE_DIR instead (the build cache)"]
    monkeypatch.setenv("MOE_L2_BUILD_CACHE_DIR", str(tmp_path / "new"))
    assert build_mod.default_cache_dir() == tmp_path / "new"
