"""The trimmed llama.cpp source archive (`moe-l2 build-llama --export-source`, MOE_L2_LLAMA_SOURCE):
exactly the genuine tree less TRIMMED_DIRS, enough to configure the patched server, and refused with
one line when any byte differs from the pinned manifest."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from moe_l2_llama import build as build_mod
from moe_l2_llama import source_archive as sa

MOE = [sys.executable, "-m", "moe_l2_ops.cli", "build-llama"]


def genuine_sdist() -> Path:
    archive = build_mod.default_cache_dir() / "src" / build_mod.SDIST_NAME
    if not archive.is_file():
        pytest.skip("the sdist is not cached (the llama builds download it; MOE_L2_LLAMA_SDIST was used instead)")
    return archive


@pytest.fixture(scope="module")
def trimmed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trimmed") / "llama-src.tar.xz"
    count, digest = sa.write_trimmed(genuine_sdist(), out, build_mod.VENDOR_PREFIX, preset=0)
    assert count > 3000
    assert digest == sa.MANIFEST_SHA256, "TRIMMED_DIRS or the sdist changed: pin the new manifest's sha256"
    return out


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow  # trims the genuine sdist (module fixture): 5-40 s on 2 cores
def test_the_trimmed_tree_is_the_genuine_tree_less_the_trimmed_folders(trimmed: Path, tmp_path: Path) -> None:
    full, small = tmp_path / "full", tmp_path / "small"
    build_mod.extract_llama_cpp(genuine_sdist(), full)
    assert sa.extract_verified(trimmed, small) > 3000
    expected = {k: v for k, v in files_under(full).items() if k.split("/", 1)[0] not in sa.TRIMMED_DIRS}
    assert files_under(small) == expected
    # executables stay executable (scripts the build may run)
    for name in expected:
        assert os.access(small / name, os.X_OK) == os.access(full / name, os.X_OK), name
    assert {k.split("/", 1)[0] for k in files_under(full)} >= set(sa.TRIMMED_DIRS) - {".devops"}


@pytest.mark.slow  # trims the genuine sdist (module fixture): 5-40 s on 2 cores
def test_it_fits_a_device_call_with_room_to_spare(trimmed: Path) -> None:
    # The shipped archive is xz -9 (8.1 MiB measured); this one is preset 0, larger still.
    assert trimmed.stat().st_size < 24 * 2**20


def test_no_patch_touches_a_trimmed_folder() -> None:
    for patch in build_mod.patch_files(build_mod.default_patches_dir()):
        for line in patch.read_text().splitlines():
            if line.startswith("diff --git a/"):
                path = line.split()[2][2:]
                assert path.split("/", 1)[0] not in sa.TRIMMED_DIRS, (patch.name, path)


@pytest.mark.slow  # trims the genuine sdist (module fixture): 5-40 s on 2 cores
@pytest.mark.skipif(not shutil.which("cmake"), reason="cmake is not installed")
def test_the_patched_trimmed_tree_configures_the_server(trimmed: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    sa.extract_verified(trimmed, src)
    build_mod.apply_patches(src, build_mod.patch_files(build_mod.default_patches_dir()))
    result = subprocess.run(
        ["cmake", "-S", str(src), "-B", str(tmp_path / "build"), *build_mod.BuildConfig(test_hooks=True).cmake_flags()],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "build" / "tools" / "server" / "Makefile").exists() or any(
        (tmp_path / "build").glob("build.ninja")
    )


# -- verification, on small archives made here with their own pin ---------------------------------


def make_archive(path: Path, files: dict[str, bytes], manifest_files: dict[str, bytes] | None = None) -> str:
    listed = files if manifest_files is None else manifest_files
    manifest = "".join(sa.manifest_line(name, data, False) for name, data in sorted(listed.items())).encode()
    with tarfile.open(path, "w:xz") as tar:
        for name, data in [(sa.MANIFEST_NAME, manifest), *sorted(files.items())]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(manifest).hexdigest()


FILES = {"CMakeLists.txt": b"project(x)\n", "src/a.cpp": b"int a;\n", "src/b.cpp": b"int b;\n"}


def test_a_faithful_archive_extracts(tmp_path: Path) -> None:
    pin = make_archive(tmp_path / "ok.tar.xz", FILES)
    assert sa.extract_verified(tmp_path / "ok.tar.xz", tmp_path / "out", pin) == 3
    assert files_under(tmp_path / "out") == FILES


@pytest.mark.parametrize(
    ("files", "manifest_files", "says"),
    [
        ({**FILES, "src/a.cpp": b"int evil;\n"}, FILES, "src/a.cpp differs from its manifest"),
        ({**FILES, "src/c.cpp": b"int c;\n"}, FILES, "src/c.cpp is not in its manifest"),
        ({k: v for k, v in FILES.items() if k != "src/b.cpp"}, FILES, "1 files are missing, e.g. src/b.cpp"),
        ({**FILES, "../escape": b"x"}, {**FILES, "../escape": b"x"}, "manifest sha256"),
    ],
    ids=["changed", "added", "removed", "other-manifest"],
)
def test_any_difference_is_refused(
    tmp_path: Path, files: dict[str, bytes], manifest_files: dict[str, bytes], says: str
) -> None:
    pin = make_archive(tmp_path / "faithful.tar.xz", FILES)
    make_archive(tmp_path / "bad.tar.xz", files, manifest_files)
    with pytest.raises(sa.SourceArchiveError, match=says):
        sa.extract_verified(tmp_path / "bad.tar.xz", tmp_path / "out", pin)


@pytest.mark.slow  # trims the genuine sdist (module fixture): 5-40 s on 2 cores
def test_a_tampered_archive_is_one_line_from_build_llama(trimmed: Path, tmp_path: Path) -> None:
    # The real pin: the trimmed archive with one file's bytes changed.
    bad = tmp_path / "bad.tar.xz"
    with tarfile.open(trimmed) as src, tarfile.open(bad, "w:xz") as dst:
        for member in src:
            data = src.extractfile(member).read()  # type: ignore[union-attr]
            if member.name == "src/llama.cpp":
                data += b"\n// one more line\n"
                member.size = len(data)
            dst.addfile(member, io.BytesIO(data))
    env = {**os.environ, "MOE_L2_LLAMA_SOURCE": str(bad), "MOE_L2_BUILD_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run(MOE, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    what = f"error: {bad} is not the trimmed pinned llama.cpp source: src/llama.cpp differs from its manifest"
    assert errors == [what]


def test_a_missing_source_archive_is_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "MOE_L2_LLAMA_SOURCE": str(tmp_path / "nope.tar.xz"), "MOE_L2_BUILD_CACHE_DIR": str(tmp_path)}
    result = subprocess.run(MOE, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1
    missing = tmp_path / "nope.tar.xz"
    assert result.stderr.strip().splitlines()[-1] == f"error: MOE_L2_LLAMA_SOURCE={missing} does not exist"
