"""build.py run as the llama image's builder stages run it: a script (`python3 services/llama/moe_l2_llama/build.py`)
in a copy of what the stage copies, laid out as the stage lays it out, with no package installed and an
interpreter without site-packages (`-S`), so that an import from outside the standard library fails here as it
would in the bare builder stage. Nothing is compiled: --help, and the CPU stage's RUN line on a cache hit."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_l2_llama import build as build_mod
from tests.compose.dockerfiles import Stage, parse_dockerfile

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "services" / "llama" / "Dockerfile"


def _build_run(stage: Stage) -> str | None:
    """The stage's RUN line that runs build.py, its flags (--mount=...) left out."""
    runs = [rest for instr, rest in stage.instructions if instr == "RUN" and "build.py" in rest]
    return re.sub(r"^(--\S+\s+)+", "", runs[0]) if runs else None


BUILDERS = [s for s in parse_dockerfile(DOCKERFILE.read_text()) if _build_run(s)]


def _builder_context(stage: Stage, root: Path) -> Path:
    """The stage's COPY lines done under root (the stage's /); returns its WORKDIR there."""
    workdir = root
    for instr, rest in stage.instructions:
        if instr == "WORKDIR":
            workdir = root / rest.lstrip("/")
        elif instr == "COPY":
            assert not rest.startswith("--"), f"{stage.name}: a COPY this test does not reproduce: {rest}"
            src, dst = rest.split()
            # what .dockerignore keeps out of the build context
            ignore = shutil.ignore_patterns("__pycache__", "*.py[cod]", "Dockerfile", ".pytest_cache", ".ruff_cache")
            shutil.copytree(REPO / src, workdir / dst, ignore=ignore)
    return workdir


def _script(stage: Stage) -> str:
    run = _build_run(stage)
    assert run is not None
    match = re.match(r"python3 (\S+/build\.py) ", run)
    assert match, f"{stage.name}: the RUN line does not start with python3 .../build.py: {run}"
    return match.group(1)


def test_the_builder_stages_run_build_py() -> None:
    assert {s.name for s in BUILDERS} == {"build-cpu", "build-cuda"}


@pytest.mark.parametrize("flags", [["-S"], ["-I", "-S"]], ids=["script-dir-on-path", "isolated"])
@pytest.mark.parametrize("stage", BUILDERS, ids=lambda s: s.name)
def test_help_with_the_standard_library_only(tmp_path: Path, stage: Stage, flags: list[str]) -> None:
    workdir = _builder_context(stage, tmp_path)
    script = workdir / _script(stage)
    result = subprocess.run(
        [sys.executable, *flags, "-X", "importtime", _script(stage), "--help"],
        cwd=workdir,
        env={},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: moe-l2 build-llama"), result.stdout
    # every module of the build is imported once, as the package's: none under its bare name (importtime
    # logs import statements, not build.py's importlib.import_module of itself)
    timings = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    imported = {line.rsplit("|", 1)[1].strip() for line in timings}
    package = script.parent.name
    siblings = {p.stem for p in script.parent.glob("*.py")}
    assert {f"{package}.source", f"{package}.cmake_build", f"{package}.build_cache"} <= imported, sorted(imported)
    assert not imported & siblings, f"imported under a bare name: {sorted(imported & siblings)}"


def test_the_cpu_stage_run_line_on_a_cache_hit(tmp_path: Path) -> None:
    stage = next(s for s in BUILDERS if "--cuda" not in (_build_run(s) or ""))
    run = _build_run(stage)
    assert run is not None
    workdir = _builder_context(stage, tmp_path)
    # The stage's cache mount (/root/.cache/moe-l2) holding the build its flags ask for: the same key as
    # build.py computes from the copied patch series, the binaries stand-ins.
    assert "--portable --no-test-hooks" in run and not re.search(r"--(cuda|vulkan|rpc)\b", run), run
    config = build_mod.BuildConfig(native=False, test_hooks=False)
    patches = build_mod.patch_files(workdir / Path(_script(stage)).parent.parent / "patches")
    cached = build_mod.cached_binary(tmp_path / "root" / ".cache" / "moe-l2", build_mod.build_key(config, patches))
    cached.parent.mkdir(parents=True)
    for target in config.targets():
        (cached.parent / target).write_text("#!/bin/sh\n")
        (cached.parent / target).chmod(0o755)
    # The RUN line itself, by a shell whose PATH has nothing on it: no compiler, no cmake, no network tool
    # is needed on a cache hit. /opt/llama is under tmp_path; BUILD_JOBS is unset, as by default.
    command = run.replace("/opt/llama", str(tmp_path / "opt" / "llama"))
    command = f"{shlex.quote(sys.executable)} -S {command.removeprefix('python3 ')}"
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    sh = shutil.which("sh")
    assert sh
    result = subprocess.run(
        [sh, "-c", command],
        cwd=workdir,
        env={"HOME": str(tmp_path / "root"), "PATH": str(empty)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    out = tmp_path / "opt" / "llama" / "bin"
    assert result.stdout.strip() == str(out / "llama-server")
    assert sorted(os.listdir(out)) == sorted(config.targets())
    assert "Traceback" not in result.stderr
