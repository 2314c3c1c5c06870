"""The packages' import direction: pyproject.toml's import-linter contracts hold, and break when broken.

The layers (docs/architecture.md, "Packages"): moe_l2_ops above the four services, the services
(independent of each other) above moe_l2_domains and moe_l2_gguf, moe_l2_contracts at the bottom.
Within the packages, no import cycle among the modules (tests/import_cycles.py, which lists them).
import-linter reads every import, function-local ones included, so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

from .import_cycles import AcyclicModulesContract, find_cycles

REPO = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
PACKAGE_ROOTS = ["shared", "ops", "services/llama", "services/proxy", "services/predictor", "services/cache-manager"]


def _lint_imports(cwd: Path, pythonpath: list[Path] | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="500")  # rich wraps at 80 columns otherwise: one cycle, one line
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
    """The project's packages (their .py files), pyproject.toml and the cycles contract, copied under tmp_path."""
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").touch()
    shutil.copy(REPO / "tests" / "import_cycles.py", tmp_path / "tests" / "import_cycles.py")
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


def test_the_contracts_are_kept() -> None:
    """The layers, and no import cycle: what `make lint` checks."""
    result = _lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no import cycles among the modules KEPT" in result.stdout
    assert "2 kept, 0 broken" in result.stdout


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


def _graph(*imports: str) -> grimp.ImportGraph:
    """A graph of modules `pkg.<name>` from "a>b" pairs: a imports b."""
    graph = grimp.ImportGraph()
    for pair in imports:
        importer, imported = (f"pkg.{name}" for name in pair.split(">"))
        graph.add_import(importer=importer, imported=imported, line_number=3, line_contents=f"import {imported}")
    return graph


def test_every_cycle_is_found() -> None:
    """Each elementary cycle once, from its smallest module, shortest first; the acyclic rest adds none."""
    graph = _graph("a>b", "b>a", "b>c", "c>a", "c>d", "d>b", "e>e", "f>a", "a>g", "g>h")
    assert find_cycles(graph) == [
        ["pkg.e"],
        ["pkg.a", "pkg.b"],
        ["pkg.a", "pkg.b", "pkg.c"],
        ["pkg.b", "pkg.c", "pkg.d"],
    ]
    assert find_cycles(_graph("a>b", "b>c", "a>c", "c>d")) == []


def test_the_contract_lists_each_cycle_with_its_imports() -> None:
    contract = AcyclicModulesContract("no cycles", {}, {})
    check = contract.check(_graph("a>b", "b>c", "c>a", "c>d"), verbose=False)
    assert not check.kept
    assert check.metadata["cycles"] == [
        {
            "modules": ["pkg.a", "pkg.b", "pkg.c"],
            "imports": ["pkg.a:3  import pkg.b", "pkg.b:3  import pkg.c", "pkg.c:3  import pkg.a"],
        }
    ]
    assert contract.check(_graph("a>b", "b>c"), verbose=False).kept


@pytest.mark.parametrize(
    ("module", "line", "cycles"),
    [
        # the three cycles grimp found (issue 34), each planted back
        (
            "ops/moe_l2_ops/python_service.py",
            "import moe_l2_ops.stack",
            [
                "moe_l2_ops.python_service -> moe_l2_ops.stack -> moe_l2_ops.python_service",
                "moe_l2_ops.llama_replicas -> moe_l2_ops.python_service -> moe_l2_ops.stack -> "
                "moe_l2_ops.llama_replicas",
                "moe_l2_ops.predictor_replicas -> moe_l2_ops.python_service -> moe_l2_ops.stack -> "
                "moe_l2_ops.predictor_replicas",
            ],
        ),
        # hidden behind TYPE_CHECKING, as it was
        (
            "services/cache-manager/moe_l2_cache/service.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from moe_l2_cache.app import create_app",
            [
                "moe_l2_cache.app -> moe_l2_cache.service -> moe_l2_cache.app",
                "moe_l2_cache.app -> moe_l2_cache.metrics -> moe_l2_cache.service -> moe_l2_cache.app",
            ],
        ),
        # hidden in a function
        (
            "shared/moe_l2_gguf/vocabulary.py",
            "def _f():\n    from moe_l2_gguf import demo_model",
            [
                "moe_l2_gguf.demo_model -> moe_l2_gguf.vocabulary -> moe_l2_gguf.demo_model",
                "moe_l2_gguf.demo_model -> moe_l2_gguf.model_shapes -> moe_l2_gguf.vocabulary -> "
                "moe_l2_gguf.demo_model",
            ],
        ),
    ],
)
def test_a_planted_cycle_breaks_the_build(tmp_path: Path, module: str, line: str, cycles: list[str]) -> None:
    """`lint-imports` (make lint) fails on a cycle and lists every cycle the import closes, nothing else."""
    roots = _copy_tree(tmp_path)
    target = tmp_path / module
    target.write_text(target.read_text() + "\n\n" + line + "\n")
    result = _lint_imports(tmp_path, roots)
    assert result.returncode != 0
    assert "1 kept, 1 broken" in result.stdout, result.stdout + result.stderr  # the layers still hold
    assert f"{len(cycles)} import cycles among the modules," in result.stdout, result.stdout
    for cycle in cycles:
        assert cycle in result.stdout, result.stdout
