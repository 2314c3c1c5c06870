"""The Python setup of `make bench-gpu` on a machine without the project's venv: standard library only,
so that any python3 of 3.11 or later runs it, the bare interpreter of a lent GPU machine included.

    python3 bench/gpu_setup.py roots                    the package roots, one per line (pyproject.toml)
    python3 bench/gpu_setup.py install SITE WHEELS...   unpack the wheels this interpreter can use and
                                                        whose packages it cannot import yet into SITE
    python3 bench/gpu_setup.py check                    import every module the check runs; exit 1
                                                        naming the ones that fail

Why: the check of 2026-12-04 died on the H200 because gpu_check.sh's PYTHONPATH named two of the six
package roots by hand (`ops/` and `services/cache-manager/` were missing), so `make-demo-model` and
the profile fit could not import. The roots are now read from the one list there is,
`[tool.setuptools.packages.find] where` in pyproject.toml.

Why unpack instead of `pip install`: a wheel is a zip of importable files; unpacking needs no pip
(a venv made `--without-pip` has none) and no index, and it is the same code here and there. Only
wheels whose tags fit this interpreter are taken (cp311 and cp312 builds may lie side by side), and
a distribution whose top-level packages already import is skipped, so the machine's own numpy (the
one its torch was built against) is never shadowed.
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
import re
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Every module the GPU check imports, directly or in a subprocess: bench/expert_offload.py (its
# servers, the ESFT trace and the profile fit), `moe-l2 make-demo-model`, bench/gpu_identity.py and
# bench/gpu_facts.py's gauges (moe_l2_cache.gpu: prometheus_client; pynvml on a GPU machine).
REQUIRED = (
    "moe_l2_llama.build",
    "moe_l2_llama.settings",
    "moe_l2_llama.route_trace",
    "moe_l2_gguf.index",
    "moe_l2_gguf.model_shapes",
    "moe_l2_ops.cli",
    "moe_l2_ops.llama_service",
    "moe_l2_ops.stats",
    "moe_l2_ops.supervisor",
    "moe_l2_cache.policy.profile",
    "moe_l2_cache.policy.replay",
    "moe_l2_cache.gpu",
    "moe_l2_contracts.schemas.llama",
    "gguf",
    "numpy",
    "httpx",
    "yaml",
    "tqdm",
)
OPTIONAL = ("pynvml", "torch")  # the gauges and the H2D constants; without them the JSON says why


def package_roots(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """`[tool.setuptools.packages.find] where`: the folders holding the moe_l2_* packages."""
    import tomllib

    with pyproject.open("rb") as f:
        return list(tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["where"])


_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<ver>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")


def wheel_fits(filename: str, version: tuple[int, int] = sys.version_info[:2], machine: str = "") -> bool:
    """Whether this interpreter (CPython `version` on Linux `machine`) can import the wheel's files."""
    m = _WHEEL.match(filename)
    if not m:
        return False
    machine = machine or platform.machine()
    plat_ok = any(p == "any" or (p.endswith(machine) and "linux" in p) for p in m["plat"].split("."))
    ours = f"cp{version[0]}{version[1]}"
    pys, abis = m["py"].split("."), m["abi"].split(".")
    if "none" in abis:  # pure Python (py3) or no ABI dependence
        py_ok = any(p in ("py3", f"py{version[0]}{version[1]}", ours) for p in pys)
    elif "abi3" in abis:  # the stable ABI: built for cp3X, good for every later 3.Y
        py_ok = any(p.startswith("cp3") and int(p[3:]) <= version[1] for p in pys)
    else:
        py_ok = ours in pys and ours in abis
    return plat_ok and py_ok


def top_level(wheel: zipfile.ZipFile) -> set[str]:
    """The importable top-level names a wheel brings (packages and modules)."""
    names = set()
    for entry in wheel.namelist():
        first = entry.split("/", 1)[0]
        if first.endswith((".dist-info", ".data")):
            continue
        names.add(first[:-3] if first.endswith(".py") else first.split(".", 1)[0])
    return names


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def install(site: Path, wheels: list[Path]) -> list[str]:
    """Unpack into `site` every fitting wheel whose top-level packages do not all import already;
    `.data/purelib` and `.data/platlib` are moved up, as an installer does. Returns what was taken."""
    site.mkdir(parents=True, exist_ok=True)
    taken = []
    for path in sorted(wheels):
        if not wheel_fits(path.name):
            continue
        with zipfile.ZipFile(path) as wheel:
            tops = top_level(wheel)
            if tops and all(importable(t) for t in tops):
                continue
            for info in wheel.infolist():
                parts = info.filename.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue  # scripts and headers: nothing an import needs
                    info.filename = "/".join(parts[2:])
                wheel.extract(info, site)
        taken.append(path.name)
    importlib.invalidate_caches()
    return taken


def check(modules: tuple[str, ...] = REQUIRED) -> dict[str, str]:
    """{module: the error} of every module that does not import."""
    failed = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # any import-time failure counts, not just ImportError
            failed[name] = f"{type(exc).__name__}: {exc}"
    return failed


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("roots", "install", "check"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "roots":
        print("\n".join(package_roots()))
        return 0
    if argv[0] == "install":
        if len(argv) < 2:
            print("error: install SITE WHEELS...", file=sys.stderr)
            return 2
        taken = install(Path(argv[1]), [Path(w) for w in argv[2:]])
        print(f"unpacked {len(taken)} wheels into {argv[1]}: {' '.join(taken) or 'none needed'}")
        return 0
    failed = check()
    for name in OPTIONAL:
        print(f"{name}: {'yes' if importable(name) else 'no (its part of the JSON says why)'}")
    for name, why in failed.items():
        print(f"error: {name} does not import: {why}", file=sys.stderr)
    ok = len(REQUIRED) - len(failed)
    print(f"python {platform.python_version()} at {sys.executable}: {ok} of {len(REQUIRED)} modules import")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
