"""The trimmed llama.cpp source: the pinned tree less what no build of llama-server reads.

Why it exists: a lent GPU machine is offline and takes at most 64 MiB with the working tree, and the
pinned sdist is 73 MiB (measured; 63 MB even recompressed with xz -9). Three quarters of the vendored
tree are tokenizer vocabularies (`models/`, 75 MB) and documentation (`docs/`, 38 MB); without them
and the CI, media and benchmark folders the tree is about 60 MB and about 9 MB as .tar.xz.

How it is trusted: the archive's first member is a manifest (`sha256  mode  path` per file, sorted),
and the sha256 of that manifest is pinned here. Extraction reads every file, hashes it and checks it
against the manifest, and every manifest entry must be present: a trimmed archive yields exactly the
files of the genuine sdist or nothing. The pin is a function of the pinned sdist and TRIMMED_DIRS;
tests/test_source_archive.py trims the genuine sdist and checks it.

Standard library only, like build.py: the llama image runs build.py as a script, in a bare builder stage.
"""

from __future__ import annotations

import hashlib
import io
import lzma
import tarfile
from collections.abc import Iterator
from pathlib import Path

MANIFEST_NAME = "MOE_L2_SOURCE_MANIFEST"
# Top-level folders of the vendored tree that no CMake file of the server build reads; the patches
# touch none of them (tests/test_source_archive.py checks both).
TRIMMED_DIRS = ("models", "docs", "media", ".github", ".devops", "benches")
MANIFEST_SHA256 = "05bceab16faa261dcaff88fb1550fe1af9a8d6b4ccbe871865440f372d1c4619"


class SourceArchiveError(Exception):
    """A trimmed archive that cannot be made or trusted; the message is one line."""


def _kept(relative: str) -> bool:
    top = relative.split("/", 1)[0]
    return bool(relative) and top not in TRIMMED_DIRS and "/.git/" not in f"/{relative}/"


def _sdist_files(sdist: Path, vendor_prefix: str) -> Iterator[tuple[str, bytes, bool]]:
    """(path in the tree, content, executable) of every kept file, in sorted order."""
    with tarfile.open(sdist) as tar:
        members = {}
        for member in tar.getmembers():
            if not member.name.startswith(vendor_prefix):
                continue
            relative = member.name[len(vendor_prefix) :]
            if not _kept(relative):
                continue
            if not member.isfile():
                raise SourceArchiveError(f"{sdist}: {member.name} is not a regular file; cannot trim it")
            members[relative] = member
        for relative in sorted(members):
            member = members[relative]
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            yield relative, data, bool(member.mode & 0o111)


def manifest_line(relative: str, data: bytes, executable: bool) -> str:
    return f"{hashlib.sha256(data).hexdigest()}  {'x' if executable else '-'}  {relative}\n"


def _tar_info(name: str, size: int, executable: bool) -> tarfile.TarInfo:
    # Fixed metadata: the same sdist always gives the same bytes, so archives can be compared.
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o755 if executable else 0o644
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def write_trimmed(sdist: Path, out: Path, vendor_prefix: str, preset: int = 9) -> tuple[int, str]:
    """Write the trimmed archive (.tar.xz) of a verified sdist; (file count, manifest sha256).
    preset 9: 8.1 MiB in 25 s on one core (measured); tests use 0 for speed."""
    files = list(_sdist_files(sdist, vendor_prefix))
    manifest = "".join(manifest_line(*f) for f in files).encode()
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    with lzma.open(tmp, "wb", preset=preset) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        tar.addfile(_tar_info(MANIFEST_NAME, len(manifest), False), io.BytesIO(manifest))
        for relative, data, executable in files:
            tar.addfile(_tar_info(relative, len(data), executable), io.BytesIO(data))
    tmp.replace(out)
    return len(files), hashlib.sha256(manifest).hexdigest()


def _parse_manifest(text: str) -> dict[str, tuple[str, bool]]:
    entries = {}
    for line in text.splitlines():
        digest, mode, relative = line.split("  ", 2)
        entries[relative] = (digest, mode == "x")
    return entries


def extract_verified(archive: Path, dest: Path, pinned: str = MANIFEST_SHA256) -> int:
    """Extract a trimmed archive into dest (which must not exist), checking every file; the count."""
    what = f"{archive} is not the trimmed pinned llama.cpp source"
    try:
        with tarfile.open(archive) as tar:
            first = tar.next()
            if first is None or first.name != MANIFEST_NAME or not first.isfile():
                raise SourceArchiveError(f"{what}: its first member is not {MANIFEST_NAME}")
            manifest = tar.extractfile(first).read()  # type: ignore[union-attr]
            digest = hashlib.sha256(manifest).hexdigest()
            if digest != pinned:
                raise SourceArchiveError(
                    f"{what}: manifest sha256 {digest[:12]}… does not match {pinned[:12]}…; "
                    "make it again with `moe-l2 build-llama --export-source`"
                )
            expected = _parse_manifest(manifest.decode())
            seen = set()
            for member in tar:
                if member is first:  # iteration starts again at the manifest
                    continue
                entry = expected.get(member.name)
                if entry is None or not member.isfile() or member.name in seen:
                    raise SourceArchiveError(f"{what}: {member.name} is not in its manifest")
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
                if hashlib.sha256(data).hexdigest() != entry[0]:
                    raise SourceArchiveError(f"{what}: {member.name} differs from its manifest")
                # The name is one the pinned manifest lists, so it stays inside dest.
                path = dest / member.name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
                path.chmod(0o755 if entry[1] else 0o644)
                seen.add(member.name)
    except (tarfile.TarError, EOFError, OSError, lzma.LZMAError, ValueError, UnicodeDecodeError) as exc:
        raise SourceArchiveError(f"cannot read {archive}: {exc}") from exc
    missing = sorted(set(expected) - seen)
    if missing:
        raise SourceArchiveError(f"{what}: {len(missing)} files are missing, e.g. {missing[0]}")
    return len(seen)
