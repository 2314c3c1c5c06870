"""`moe-l2 --version`: the package, the pinned llama.cpp commit and patch series, and the build `up` serves.

The build lookup is doctor's (serving_binary), on a fake PATH and a build cache planted as in
tests/test_llama_backend.py, so nothing is compiled and a GPU on the test machine changes nothing.
"""

from __future__ import annotations

import json
import shutil
from importlib import metadata
from pathlib import Path

import pytest

from moe_l2_llama import build as build_mod
from moe_l2_llama.build import LLAMA_CPP_COMMIT, BuildConfig
from moe_l2_ops.cli import COMMANDS, main
from moe_l2_ops.version import patch_series_hash
from tests.test_llama_backend import H100, PLAN_ENV, fake_tool, plant_build


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """As tests/test_llama_backend.py's: a PATH of fake tools only, an empty build cache, no backend or
    binary chosen by the caller."""
    path = tmp_path / "bin"
    path.mkdir()
    monkeypatch.setenv("PATH", str(path))
    monkeypatch.setenv("MOE_L2_BUILD_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("MOE_L2_LLAMA_BACKEND", "MOE_L2_LLAMA_SERVER", "MOE_L2_PATCHES_DIR", *PLAN_ENV):
        monkeypatch.setenv(name, "")  # recorded, so that what the test (or the plan) sets is undone
        monkeypatch.delenv(name)
    return path


def version_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert main(["--version"]) == 0
    return capsys.readouterr().out.splitlines()


def test_version_names_the_source_the_series_and_that_nothing_is_built(
    bin_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    patches = build_mod.patch_files(build_mod.default_patches_dir())
    lines = version_lines(capsys)
    assert lines[0] == f"moe-l2 {metadata.version('moe-l2')}"
    assert lines[1].startswith(f"llama.cpp {LLAMA_CPP_COMMIT} (from llama-cpp-python ")
    assert lines[1].endswith(f", patch series {patch_series_hash(patches)} ({len(patches)} patches)")
    assert lines[2] == "llama-server: not built (the cpu build; `moe-l2 up` or `moe-l2 build-llama`)"
    assert len(lines) == 3


def test_version_names_the_built_binary_and_its_backend(bin_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cpu = plant_build(BuildConfig())
    assert version_lines(capsys)[2] == f"llama-server: cpu build, {cpu}"
    # on a GPU machine `up` serves the CUDA build: that one is named, not the CPU build beside it
    fake_tool(bin_dir, "nvidia-smi", H100 + "\n")
    cuda = plant_build(BuildConfig(backend="cuda", cuda_architectures="90"))
    assert version_lines(capsys)[2] == f"llama-server: cuda build, {cuda}"


def test_version_says_a_given_binary_is_from_another_series(
    bin_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = plant_build(BuildConfig(backend="rpc"))
    monkeypatch.setenv("MOE_L2_LLAMA_SERVER", str(binary))
    assert version_lines(capsys)[2] == f"llama-server: rpc build, {binary} (MOE_L2_LLAMA_SERVER)"
    info_path = binary.parent.parent / "build-info.json"
    info = json.loads(info_path.read_text())
    info["patches"]["0001-older.patch"] = "0" * 64
    info_path.write_text(json.dumps(info))
    assert version_lines(capsys)[2].endswith("(MOE_L2_LLAMA_SERVER), built from another patch series")


def test_the_series_hash_follows_the_patches_as_the_build_key_does(
    bin_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    originals = build_mod.patch_files(build_mod.default_patches_dir())[:2]
    series = {}
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        series[name] = [Path(shutil.copy(p, folder / p.name)) for p in originals]
    config = BuildConfig()

    def both(patches: list[Path]) -> tuple[str, str]:
        return patch_series_hash(patches), build_mod.build_key(config, patches)

    same = both(series["a"])
    assert both(series["b"]) == same  # the bytes and names count, not the folder
    series["b"][1].write_bytes(series["b"][1].read_bytes() + b"\n")
    edited = both(series["b"])
    assert edited[0] != same[0] and edited[1] != same[1]
    renamed = series["a"][0].rename(series["a"][0].with_name("0000-renamed.patch"))
    moved = both(sorted([renamed, series["a"][1]]))
    assert moved[0] not in (same[0], edited[0]) and moved[1] not in (same[1], edited[1])

    monkeypatch.setenv("MOE_L2_PATCHES_DIR", str(tmp_path / "b"))
    assert version_lines(capsys)[1].endswith(f", patch series {edited[0]} (2 patches)")


def test_version_prints_what_it_can_without_the_patches(
    bin_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MOE_L2_PATCHES_DIR", str(tmp_path / "absent"))
    lines = version_lines(capsys)
    assert lines[0].startswith("moe-l2 ")
    assert lines[1].endswith(f"patch series unknown: patch folder {tmp_path / 'absent'} does not exist")
    assert lines[2].startswith("llama-server: unknown (BuildError: ")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_s_help_prints_its_usage(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`moe-l2 COMMAND --help` is the README's way to each command's options: it must print them, not a
    traceback (a help text with a bare % once made argparse raise on `moe-l2 bench --help`)."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "usage:" in out and "--help" in out, out
