"""The llama.cpp source a build starts from: the llama-cpp-python sdist fetched from the registry (or pip, or
MOE_L2_LLAMA_SDIST), verified by its sha256 and extracted, or the trimmed archive of MOE_L2_LLAMA_SOURCE
(source_archive.py), which export_source writes for an offline machine.

Separate from the patching and the compile: everything here runs before the first patch, and only here
does the build reach the network.

Standard library only, like build.py: the llama image runs build.py as a script, in a bare builder stage.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

from . import source_archive
from .build_config import (
    DEFAULT_INDEX,
    LLAMA_CPP_COMMIT,
    LLAMA_CPP_PYTHON_VERSION,
    SDIST_NAME,
    SDIST_SHA256,
    VENDOR_PREFIX,
    BuildError,
)
from .progress import Progress, log


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sdist_url(index: str) -> str:
    """The sdist's URL from the registry's simple index (PEP 691 JSON)."""
    req = urllib.request.Request(
        f"{index.rstrip('/')}/llama-cpp-python/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        files = json.load(resp)["files"]
    for entry in files:
        if entry["filename"] == SDIST_NAME:
            return entry["url"]
    raise BuildError(f"{SDIST_NAME} is not listed on {index}")


def download(url: str, dest: Path) -> None:
    tmp = dest.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=120) as resp, tmp.open("wb") as out:
        total = int(resp.headers.get("Content-Length") or 0)
        progress = Progress(f"downloading {SDIST_NAME}")
        done = 0
        while chunk := resp.read(1 << 20):
            out.write(chunk)
            done += len(chunk)
            progress.update(done >> 20, total >> 20)
        progress.close()
    tmp.replace(dest)


def pip_download(dest_dir: Path) -> None:
    """Fallback through pip, which honours the machine's own index configuration."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
    cmd += ["-d", str(dest_dir), f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(f"cannot download {SDIST_NAME}: {tail}")


def extract_source(cache: Path, dest: Path) -> None:
    """The llama.cpp tree into dest: from MOE_L2_LLAMA_SOURCE (a trimmed archive, verified file by
    file as it is extracted) where set, else from the verified sdist."""
    env = os.environ.get("MOE_L2_LLAMA_SOURCE")
    if not env:
        extract_llama_cpp(fetch_sdist(cache), dest)
        return
    archive = Path(env)
    if not archive.is_file():
        raise BuildError(f"MOE_L2_LLAMA_SOURCE={archive} does not exist")
    if dest.exists():
        shutil.rmtree(dest)
    try:
        count = source_archive.extract_verified(archive, dest)
    except source_archive.SourceArchiveError as exc:
        raise BuildError(str(exc)) from exc
    log(f"source: {archive.name}, {count} files verified against the pinned manifest")


def export_source(cache: Path, out: Path) -> Path:
    """Write the trimmed source archive (see source_archive.py) made from the verified sdist."""
    sdist = fetch_sdist(cache)
    log(f"trimming {sdist.name} into {out} (xz -9, about a minute)")
    try:
        count, digest = source_archive.write_trimmed(sdist, out, VENDOR_PREFIX)
    except (source_archive.SourceArchiveError, tarfile.TarError, OSError) as exc:
        raise BuildError(f"cannot write {out}: {exc}") from exc
    if digest != source_archive.MANIFEST_SHA256:
        out.unlink(missing_ok=True)
        stale = "source_archive.py's pin is stale"
        raise BuildError(f"the trimmed manifest's sha256 {digest[:12]}… is not the pinned one; {stale}")
    log(f"{count} files, {out.stat().st_size / 2**20:.1f} MiB; build from it with MOE_L2_LLAMA_SOURCE={out}")
    return out


def fetch_sdist(cache: Path) -> Path:
    """The verified source archive: MOE_L2_LLAMA_SDIST, else the cache, else the registry."""
    if env := os.environ.get("MOE_L2_LLAMA_SDIST"):
        archive = Path(env)
        if not archive.is_file():
            raise BuildError(f"MOE_L2_LLAMA_SDIST={archive} does not exist")
    else:
        archive = cache / "src" / SDIST_NAME
        if not archive.is_file():
            archive.parent.mkdir(parents=True, exist_ok=True)
            index = os.environ.get("MOE_L2_PYPI_INDEX", DEFAULT_INDEX)
            log(f"fetching {SDIST_NAME} (llama.cpp {LLAMA_CPP_COMMIT[:7]})")
            try:
                download(sdist_url(index), archive)
            except (OSError, KeyError, ValueError) as exc:
                log(f"direct download failed ({exc}); trying pip download")
                pip_download(archive.parent)
    actual = sha256_file(archive)
    if actual != SDIST_SHA256:
        if not os.environ.get("MOE_L2_LLAMA_SDIST"):
            archive.unlink(missing_ok=True)
            hint = "it was removed from the cache; run again to download it anew"
        else:
            hint = "replace it with the genuine archive"
        raise BuildError(f"{archive} is corrupted: sha256 {actual[:12]}… does not match {SDIST_SHA256[:12]}…; {hint}")
    return archive


def extract_llama_cpp(archive: Path, dest: Path) -> None:
    """Only the vendored llama.cpp tree, laid out as the root of dest."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    try:
        with tarfile.open(archive) as tar:
            members = []
            for member in tar.getmembers():
                if not member.name.startswith(VENDOR_PREFIX) or "/.git/" in member.name + "/":
                    continue
                member.name = member.name[len(VENDOR_PREFIX) :]
                if member.name:
                    members.append(member)
            extract_kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(dest, members=members, **extract_kwargs)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise BuildError(f"cannot extract {archive}: {exc}") from exc
