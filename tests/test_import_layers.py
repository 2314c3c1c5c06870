"""The packages' import direction: pyproject.toml's import-linter contract holds, and breaks when broken.

The layers (docs/architecture.md, "Packages"): moe_l2_ops above the four services, the services
(independent of each other) above moe_l2_domains and moe_l2_gguf, moe_l2_contracts at the bottom.
import-linter reads every import, function-local ones included, so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
PACKAGE_ROOTS = ["shared", "ops", "services/llama", "services/proxy", "services/predictor", "services/cache-manager"]


def _lint_imports(cwd: Path, pythonpath: list[Path] | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:
        # PYTHONPATH's entries come before the editable install's finder: the copies are analysed
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(cwd / "pyproject.toml"), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy_tree(tmp_path: Path) -> list[Path]:
    """The project's packages (their .py files) and pyproject.toml, copied under tmp_path."""
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    roots = []
    for root in PACKAGE_ROOTS:
        for package in sorted((REPO / root).glob("moe_l2_*")):
            shutil.copytree(package, tmp_path / root / package.name, ignore=shutil.ignore_patterns("__pycache__"))
        roots.append(tmp_path / root)
    return roots


def test_every_package_is_in_a_layer() -> None:
    """A new package outside the contract would escape it: every moe_l2_* folder is listed."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    found = {p.name for root in PACKAGE_ROOTS for p in (REPO / root).glob("moe_l2_*") if (p / "__init__.py").exists()}
    assert found == set(config["root_packages"])
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    in_layers = {name.strip() for layer in layers for name in layer.split("|")}
    assert in_layers == found


def test_the_layers_contract_is_kept() -> None:
    result = _lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "why"),
    [
        # a contract importing a library above it
        ("shared/moe_l2_contracts/domains.py", "from moe_l2_domains import taxonomy", "moe_l2_contracts is not"),
        # a library importing a service, hidden in a function as the old cycle was
        (
            "shared/moe_l2_gguf/index.py",
            "def _f():\n    import moe_l2_cache.settings",
            "moe_l2_gguf is not allowed",
        ),
        # one service importing another
        ("services/proxy/moe_l2_proxy/settings.py", "import moe_l2_predictor.settings", "moe_l2_proxy is not allowed"),
        # a service importing the operations layer
        ("services/predictor/moe_l2_predictor/app.py", "import moe_l2_ops.supervisor", "moe_l2_predictor is not"),
    ],
)
def test_an_upward_import_breaks_the_build(tmp_path: Path, module: str, line: str, why: str) -> None:
    roots = _copy_tree(tmp_path)
    target = tmp_path / module
    target.write_text(target.read_text() + "\n\n" + line + "\n")
    result = _lint_imports(tmp_path, roots)
    assert result.returncode != 0
    assert why in result.stdout, result.stdout + result.stderr
