"""The Dockerfiles without an engine: hadolint passes, every ignored rule says why, and the base
images are build arguments whose defaults are the public images the container test stands in for."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.containers.standins import PROMETHEUS, PYTHON, REDIS

REPO = Path(__file__).resolve().parent.parent
DOCKERFILES = sorted([*REPO.glob("services/*/Dockerfile"), *REPO.glob("tests/containers/standins/*.Dockerfile")])
SERVICE_DOCKERFILES = [p for p in DOCKERFILES if p.name == "Dockerfile"]
HADOLINT = shutil.which("hadolint") or str(REPO / ".venv" / "bin" / "hadolint")


def test_every_service_has_its_dockerfile() -> None:
    assert {p.parent.name for p in SERVICE_DOCKERFILES} == {"cache-manager", "llama", "predictor", "proxy"}


@pytest.mark.skipif(not Path(HADOLINT).is_file() and not shutil.which("hadolint"), reason="hadolint not installed")
def test_hadolint_passes() -> None:
    proc = subprocess.run(
        [HADOLINT, "--no-color", "--config", str(REPO / ".hadolint.yaml"), *map(str, DOCKERFILES)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_ignored_rule_says_why() -> None:
    for path in DOCKERFILES:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "hadolint ignore" in line:
                assert i > 0 and lines[i - 1].startswith("#") and "hadolint ignore" not in lines[i - 1], (
                    f"{path.relative_to(REPO)}:{i + 1}: an ignore without a reason on the line above"
                )
    config = (REPO / ".hadolint.yaml").read_text().splitlines()
    ignored = yaml.safe_load("\n".join(config))["ignored"]
    for rule in ignored:
        at = next(i for i, line in enumerate(config) if line.strip() == f"- {rule}")
        assert config[at - 1].strip().startswith("#"), f".hadolint.yaml: {rule} is ignored without a reason"


def _from_lines(text: str) -> list[str]:
    return [line.split()[1] for line in text.splitlines() if line.startswith("FROM ")]


def _arg_defaults(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+_IMAGE)=(\S+)$", text, flags=re.M))


@pytest.mark.parametrize("path", SERVICE_DOCKERFILES, ids=lambda p: p.parent.name)
def test_base_images_are_build_arguments(path: Path) -> None:
    text = path.read_text()
    defaults = _arg_defaults(text)
    for base in _from_lines(text):
        # a stage of the same file, or a base image named by a build argument
        stages = re.findall(r"^FROM \S+ AS (\S+)$", text, flags=re.M)
        if base in stages:
            continue
        match = re.fullmatch(r"\$\{(\w+)\}", base)
        assert match and match.group(1) in defaults, f"{path.parent.name}: FROM {base} is not a build argument"
    # the default is the public image the container test builds a stand-in for
    assert defaults.get("PYTHON_IMAGE") == PYTHON.image


def test_compose_uses_the_images_the_test_stands_in_for() -> None:
    doc = yaml.safe_load((REPO / "compose.yaml").read_text())
    assert doc["services"]["redis"]["image"] == REDIS.image
    assert doc["services"]["prometheus"]["image"] == PROMETHEUS.image


def test_the_readme_shows_what_the_container_test_runs() -> None:
    """README's compose commands are the ones tests/containers runs (with its override added)."""
    readme = (REPO / "README.md").read_text()
    for command in (
        "docker compose up",
        "docker compose up --scale predictor=3",
        "docker compose -f compose.yaml -f compose.cpu.yaml up",
        "`127.0.0.1:11435`",
    ):
        assert command in readme, command
    conftest = (REPO / "tests" / "containers" / "conftest.py").read_text()
    assert 'REPO / "compose.yaml", REPO / "compose.cpu.yaml", OVERRIDE' in conftest
    assert "PREDICTORS = 3" in conftest
