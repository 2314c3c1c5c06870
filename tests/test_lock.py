"""The lock files (requirements/*.txt, `make lock`) against pyproject.toml: every dependency the
project declares is pinned, within its range, with hashes, in the lock of each install that needs
it. A dependency added to pyproject.toml without `make lock` fails here."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
REQUIREMENTS = REPO / "requirements"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# Each lock and the extras it installs (requirements/lock.py writes them).
LOCKS = {
    "dev": ("all", "dev"),
    "run": ("all",),  # what `make run` installs: the stack without the development tools
    "proxy": ("proxy",),
    "cache": ("cache",),
    "predictor": ("predictor",),
}
# The Pythons the lock is used with: the venv here and the stand-in images (3.11, also the floor
# pyproject.toml allows: Debian 12's, and tomllib's), the public python:3.12 image.
PYTHONS = ("3.11", "3.12")


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    marker: Marker | None
    hashes: tuple[str, ...]

    def applies(self, python: str) -> bool:
        """On Linux x86-64 and CPython `python` (3.12 or 3.12.8)."""
        full = python if python.count(".") == 2 else f"{python}.0"
        minor = ".".join(full.split(".")[:2])
        env = {"python_version": minor, "python_full_version": full, "sys_platform": "linux"}
        env |= {"platform_machine": "x86_64", "platform_system": "Linux", "platform_python_implementation": "CPython"}
        return self.marker is None or self.marker.evaluate(env)


def parse_lock(text: str) -> list[Pin]:
    """The entries of a hashed requirements file: `name==version [; marker] \\` then `--hash` lines."""
    pins = []
    for m in re.finditer(r"^(\S+)==(\S+?)(?: ; (.+?))? \\\n((?:    --hash=sha256:\w+(?: \\)?\n)+)", text, flags=re.M):
        hashes = tuple(re.findall(r"--hash=sha256:(\w+)", m.group(4)))
        pins.append(Pin(canonicalize_name(m.group(1)), m.group(2), Marker(m.group(3)) if m.group(3) else None, hashes))
    return pins


def lock(name: str) -> list[Pin]:
    return parse_lock((REQUIREMENTS / f"{name}.txt").read_text())


def declared(pyproject: dict, extras: tuple[str, ...]) -> list[Requirement]:
    """What an install of `.[extras]` asks for: the base dependencies, the extras' (moe-l2's own
    extras expanded) and the build backend (the locks hold it: the wheel is built offline)."""
    project = pyproject["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + pyproject["build-system"]["requires"]]
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for raw in project["optional-dependencies"][extra]:
            req = Requirement(raw)
            if canonicalize_name(req.name) == canonicalize_name(project["name"]):
                todo += sorted(req.extras)
            else:
                reqs.append(req)
    return reqs


def uncovered(reqs: list[Requirement], pins: list[Pin], python: str) -> list[str]:
    """The requirements that no pin applying on `python` satisfies."""
    by_name: dict[str, list[Pin]] = {}
    for pin in pins:
        if pin.applies(python):
            by_name.setdefault(pin.name, []).append(pin)
    out = []
    for req in reqs:
        found = by_name.get(canonicalize_name(req.name), [])
        if len(found) != 1 or not req.specifier.contains(found[0].version, prereleases=True):
            out.append(f"{req} (locked: {', '.join(p.version for p in found) or 'nothing'})")
    return out


@pytest.mark.parametrize("name", sorted(LOCKS))
@pytest.mark.parametrize("python", PYTHONS)
def test_every_declared_dependency_is_locked(name: str, python: str) -> None:
    missing = uncovered(declared(PYPROJECT, LOCKS[name]), lock(name), python)
    assert not missing, f"requirements/{name}.txt lacks, on Python {python}: {missing}; run `make lock`"


def test_a_dependency_added_without_make_lock_is_caught() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pyproject["project"]["optional-dependencies"]["proxy"].append("not-a-locked-package>=1")
    pyproject["project"]["dependencies"].append("numpy>=999")  # a range the lock's pin is outside
    missing = uncovered(declared(pyproject, LOCKS["proxy"]), lock("proxy"), "3.12")
    assert {"numpy>=999", "not-a-locked-package>=1"} <= {m.split(" ")[0] for m in missing}


@pytest.mark.parametrize("name", [*sorted(LOCKS), "torch-cuda"])
def test_every_entry_is_pinned_and_hashed(name: str) -> None:
    text = (REQUIREMENTS / f"{name}.txt").read_text()
    requirement_lines = [line for line in text.splitlines() if line and not line.startswith((" ", "#"))]
    pins = parse_lock(text)
    # every requirement line parsed as a pin: nothing unpinned or unhashed slips through
    assert len(pins) == len(requirement_lines) > 0, name
    assert all(pin.hashes for pin in pins)
    assert "make lock" in text.splitlines()[1], "the header names the command that refreshes it"


@pytest.mark.parametrize("name", sorted(set(LOCKS) - {"dev"}))
def test_the_images_run_what_the_venv_tests(name: str) -> None:
    """An image's lock is resolved under dev.txt: the same version of every package it shares."""
    dev = {(p.name, str(p.marker)): p.version for p in lock("dev")}
    for pin in lock(name):
        assert dev.get((pin.name, str(pin.marker))) == pin.version, f"{name}.txt: {pin.name}=={pin.version}"


def _torch_pin() -> str:
    match = re.search(r"^torch==(\S+)$", (REQUIREMENTS / "torch.in").read_text(), flags=re.M)
    assert match
    return match.group(1)


def test_torch_and_its_cuda_libraries() -> None:
    version = _torch_pin()
    for name in ("dev", "predictor"):
        assert [p.version for p in lock(name) if p.name == "torch"] == [version], name
    cuda = {p.name for p in lock("torch-cuda")}
    assert {"triton", "nvidia-cublas", "nvidia-cuda-runtime"} <= cuda
    # the CPU build needs none of them: they are kept out of every other lock
    for name in LOCKS:
        assert not cuda & {p.name for p in lock(name)}, name


def test_the_local_torch_build_verifies() -> None:
    """pip prefers a local build of the pinned torch in its find-links (here the +cpu wheel `make
    install` and the container test use): the lock must hold its hash, or hash-checking refuses it."""
    version = _torch_pin()
    spec = importlib.util.spec_from_file_location("lock", REQUIREMENTS / "lock.py")
    assert spec and spec.loader
    lock_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lock_py)
    wheels = lock_py.local_torch_wheels(version)
    if not wheels:
        pytest.skip(f"no local build of torch {version} in pip's find-links")
    for name in ("dev", "predictor"):
        (torch,) = [p for p in lock(name) if p.name == "torch"]
        for wheel in wheels:
            assert hashlib.sha256(wheel.read_bytes()).hexdigest() in torch.hashes, f"{name}.txt: {wheel.name}"


def test_make_install_installs_from_the_lock() -> None:
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    installs = [line.strip() for line in recipe.splitlines() if "pip install" in line]
    assert "--require-hashes -r $(LOCK)" in installs[0] and "LOCK := requirements/dev.txt" in makefile
    # after the lock, nothing is resolved: the project alone, built by the locked setuptools
    assert all("--no-deps --no-build-isolation" in line for line in installs[1:]), installs
    assert "requirements/lock.py" in makefile.split("\nlock:", 1)[1].split("\n\n", 1)[0]
