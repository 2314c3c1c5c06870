"""`pip install moe-l2` without extras: `moe-l2 doctor` and `moe-l2 stats` still run.

doctor is what a user runs when something is wrong, an install without the services' extras
included. A fresh venv per test run would cost a minute of installs; instead the commands run in a
subprocess whose import system refuses every module that only the extras bring (the distributions
pyproject.toml's extras require, and theirs, that the base dependencies do not), so an import of one
fails exactly as it would on a bare install.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _closure(names: list[str]) -> set[str]:
    """The distributions names require, transitively (unconditional requirements only)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return seen


def extras_only_modules() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = _closure([_name(r) for r in project["dependencies"]])
    extras = [_name(r) for key, reqs in project["optional-dependencies"].items() if key != "dev" for r in reqs]
    extra = _closure([n for n in extras if n != "moe-l2"]) - base
    modules = set()
    for module, dists in metadata.packages_distributions().items():
        normalized = {d.lower().replace("_", "-") for d in dists}
        if normalized & extra and not normalized & base:
            modules.add(module)
    return modules


BLOCKER = """
import sys
BLOCKED = set(sys.argv.pop(1).split(","))

class Bare:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not in a bare install)", name=name)
        return None

sys.meta_path.insert(0, Bare())
from moe_l2_ops.cli import main
sys.argv[0] = "moe-l2"
sys.exit(main())
"""


def run_bare(*args: str) -> subprocess.CompletedProcess[str]:
    blocked = ",".join(sorted(extras_only_modules()))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(REPO), "MOE_L2_OPS_TIMEOUT_S": "1"}
    return subprocess.run(
        [sys.executable, "-c", BLOCKER, blocked, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )


def test_the_blocker_refuses_what_only_the_extras_bring() -> None:
    modules = extras_only_modules()
    assert {"fastapi", "redis", "sentence_transformers"} <= modules
    assert not {"httpx", "pydantic", "numpy", "prometheus_client"} & modules
    # and an import of one fails in the subprocess, as on a bare install
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            BLOCKER.replace("from moe_l2_ops.cli", "import fastapi\nfrom moe_l2_ops.cli"),
            "fastapi",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "not in a bare install" in proc.stderr


def test_doctor_runs_on_a_bare_install() -> None:
    proc = run_bare("doctor", "--json")
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    checks = {c["name"]: c["status"] for c in json.loads(proc.stdout)}
    assert {"python", "packages", "llama-server"} <= set(checks)
    # nothing runs here: one `stack` line says so, a warning; only a failing check of the machine is exit 1
    assert checks["stack"] == "warn" and "redis" not in checks
    assert proc.returncode == (1 if "fail" in checks.values() else 0), proc.stderr[-3000:]


def test_stats_runs_on_a_bare_install() -> None:
    proc = run_bare("stats", "--json")
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("error: no moe-l2 service answered")
