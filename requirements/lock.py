"""Writes the lock files under requirements/ (`make lock`): every version pinned, every file hashed.

One lock per install: dev.txt for the developer's venv (`.[all,dev]`), run.txt for the stack alone
(`make run`: `.[all]`, no dev tools), proxy.txt, cache.txt and predictor.txt for the images (their
extra), and torch-cuda.txt, the NVIDIA libraries PyPI's torch for Linux needs. Each holds the build
backend too ([build-system] requires), so that the project's own wheel is built offline
(--no-build-isolation) by a pinned setuptools.

- universal (uv's --universal): one lock for every Python pyproject.toml allows and every platform,
  with markers where versions differ: the venv here and the stand-in images run Python 3.11, the
  public python:3.12 image 3.12;
- run.txt and the image locks are resolved under dev.txt as a constraint: the stack runs what the
  tests ran;
- torch's CUDA libraries are kept out of the other locks: the CPU build of torch needs none of them
  (gigabytes), and PyPI's torch for Linux gets them from torch-cuda.txt;
- torch's entry also carries the hashes of the local builds of the pinned version found in pip's
  find-links folders (PIP_FIND_LINKS and pip's configuration's: a +cpu wheel here), and torch-cpu.txt names that build's
  version: a constraint with which pip installs it rather than PyPI's (see write_cpu_constraint).

Existing pins are kept unless --upgrade (then every package takes its newest version).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HERE = REPO / "requirements"
# The torch version, pinned: the one whose CPU build lies in find-links (see torch.in).
TORCH_IN = HERE / "torch.in"
# A lock per install, and the extras it holds; dev.txt first, the others are resolved under it.
LOCKS = {
    "dev": ("all", "dev"),
    "run": ("all",),
    "proxy": ("proxy",),
    "cache": ("cache",),
    "predictor": ("predictor",),
}
CUDA_LOCK = "torch-cuda"
CPU_CONSTRAINT = "torch-cpu"
HEADER_COMMAND = "make lock"


def uv() -> str:
    found = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if not found:
        sys.exit("uv not found: `make install` puts it in .venv (the dev extra)")
    return found


def compile_(*args: str, output: Path | None = None, env: dict[str, str] | None = None) -> str:
    """`uv pip compile` against PyPI alone (pip's find-links and local mirrors are not asked). With
    `output`, the pins already there are kept (unless --upgrade) and the file is rewritten."""
    cmd = [uv(), "pip", "compile", "--quiet", "--no-config", "--custom-compile-command", HEADER_COMMAND, *args]
    if output:
        cmd += ["--output-file", str(output.relative_to(REPO))]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False, env={**os.environ, **(env or {})})
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)}\n{proc.stderr}")
    return output.read_text() if output else proc.stdout


def names(lock: str) -> set[str]:
    return {m.group(1).lower() for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", lock, flags=re.M)}


def cuda_packages() -> set[str]:
    """What PyPI's torch needs on Linux and not on macOS, whose wheel is a CPU build: CUDA's libraries."""
    linux = compile_(str(TORCH_IN), "--python-platform", "x86_64-manylinux_2_28", "--no-header")
    # torch's macOS wheels need macOS 14: uv's default target is 13
    macos = compile_(
        str(TORCH_IN),
        "--python-platform",
        "aarch64-apple-darwin",
        "--no-header",
        env={"MACOSX_DEPLOYMENT_TARGET": "14.0"},
    )
    return names(linux) - names(macos)


def torch_pin() -> str:
    match = re.search(r"^torch==(\S+)$", TORCH_IN.read_text(), flags=re.M)
    assert match, f"{TORCH_IN}: no torch==VERSION line"
    return match.group(1)


def find_links() -> list[Path]:
    """pip's find-links folders, as `make install` reads them: the environment's and pip's config's."""
    config = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True, check=False
    )
    found = os.environ.get("PIP_FIND_LINKS", "").split() + config.stdout.split()
    return [Path(p) for p in dict.fromkeys(found) if Path(p).is_dir()]


def local_torch_wheels(version: str) -> list[Path]:
    """Local builds of torch `version` (e.g. 2.13.0+cpu) in pip's find-links folders."""
    folders = find_links()
    return sorted(w for f in folders for w in f.glob(f"torch-{version}+*.whl"))


def add_hashes(lock: str, package: str, wheels: list[Path]) -> str:
    """Appends the wheels' sha256 to `package`'s entry (its --hash lines end where `# via` starts)."""
    entry = re.search(rf"^{re.escape(package)}==\S+.*\\\n(?:    --hash=\S+ \\\n)*    --hash=\S+\n", lock, flags=re.M)
    assert entry, f"no hashed entry for {package}"
    known = set(re.findall(r"--hash=sha256:(\w+)", entry.group(0)))
    extra = [hashlib.sha256(w.read_bytes()).hexdigest() for w in wheels]
    lines = [f"    --hash=sha256:{h}" for h in extra if h not in known]
    if not lines:
        return lock
    block = entry.group(0).rstrip("\n") + " \\\n" + " \\\n".join(lines) + "\n"
    return lock[: entry.start()] + block + lock[entry.end() :]


def write_cpu_constraint(wheels: list[Path]) -> None:
    """torch-cpu.txt: the local build's exact version, as a constraint. pip's hash-checking mode
    prefers a file whose hash the index states (PyPI's) to one it must download to check (a
    find-links wheel), whatever their versions; the constraint leaves it the local build alone."""
    out = HERE / f"{CPU_CONSTRAINT}.txt"
    versions = sorted({w.name.split("-")[1] for w in wheels})
    if len(versions) > 1:
        sys.exit(f"several local builds of torch: {versions}; keep one in pip's find-links")
    if not versions:
        print(f"no local build of torch: {out.relative_to(REPO)} removed, installs take PyPI's and torch-cuda.txt")
        out.unlink(missing_ok=True)
        return
    out.write_text(
        "# Written by `make lock`: the local CPU build of torch found in pip's find-links. Given as a\n"
        "# constraint (-c) where that build is at hand (make install, TORCH_FIND_LINKS in the predictor's\n"
        "# image), it makes pip take it over PyPI's CUDA build; its hash is in the locks' torch entry.\n"
        f"torch=={versions[0]}\n"
    )
    print(f"{out.relative_to(REPO)}: torch=={versions[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upgrade", action="store_true", help="take every package's newest version")
    args = parser.parse_args()

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    floor = re.fullmatch(r">=\s*(\d+\.\d+)", pyproject["project"]["requires-python"])
    assert floor, "requires-python is not of the form >=X.Y"
    cuda = sorted(cuda_packages())
    version = torch_pin()
    wheels = local_torch_wheels(version)
    print(f"torch {version}; its CUDA libraries, locked apart: {', '.join(cuda)}")
    print(f"local torch builds hashed too: {', '.join(w.name for w in wheels) or 'none'}")

    common = ["--universal", "--python-version", floor.group(1), "--generate-hashes"]
    common += ["--upgrade"] if args.upgrade else []
    with tempfile.TemporaryDirectory() as tmp:
        # [build-system] requires, as a requirements file uv can read; named so in the lock's `# via`
        build = Path(tmp) / "build-system.in"
        build.write_text("\n".join(pyproject["build-system"]["requires"]) + "\n")
        for name, extras in LOCKS.items():
            out = HERE / f"{name}.txt"
            constraints = ["-c", str(TORCH_IN)] + ([] if name == "dev" else ["-c", "requirements/dev.txt"])
            lock = compile_(
                "pyproject.toml",
                str(build),
                *(a for e in extras for a in ("--extra", e)),
                *constraints,
                *(a for p in cuda for a in ("--no-emit-package", p)),
                *common,
                output=out,
            )
            lock = lock.replace(str(build), "build-system (pyproject.toml)")
            if "torch==" in lock:
                lock = add_hashes(lock, "torch", wheels)
            out.write_text(lock)
            print(f"{out.relative_to(REPO)}: {len(names(lock))} packages")
        write_cpu_constraint(wheels)
        # The CUDA libraries alone: the rest of torch's closure is in predictor.txt.
        out = HERE / f"{CUDA_LOCK}.txt"
        rest = names(compile_(str(TORCH_IN), "--universal", "--no-header")) - set(cuda)
        lock = compile_(
            str(TORCH_IN),
            "-c",
            "requirements/predictor.txt",
            *(a for p in sorted(rest) for a in ("--no-emit-package", p)),
            *common,
            output=out,
        )
        print(f"{out.relative_to(REPO)}: {len(names(lock))} packages")


if __name__ == "__main__":
    main()
