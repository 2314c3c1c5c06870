"""`moe-l2 bump-llama`: the patch series replayed on another llama-cpp-python sdist, patch by patch.

A bump is a rebase of the series onto a newer llama.cpp. This does the mechanical part and reports the
rest: it builds a git repository whose first commit is the pinned tree (so that every patch's `index`
lines name blobs it has), a second commit that replaces it with the other version's tree, and applies
the series there one patch at a time, each sorted into

- **clean**: `git apply` takes it as it is (hunks may have moved: git finds them at an offset);
- **merged**: only a three-way merge against the pinned blobs takes it (upstream changed the lines around
  a hunk, not the hunk): llama.cpp's word for it is fuzz, and the refreshed patch is correct but should
  be read;
- **conflict**: the merge leaves conflicts: the patch needs work. Its conflicting hunks (file, line and
  the lines of both sides) are reported, and the survey goes on with the patch's side of those files, so
  one conflict does not hide the state of the patches after it (whose result in those files is then
  optimistic: upstream's change there was set aside);
- **fails**: not even a merge can start (a file the patch edits was removed or renamed upstream).

It also measures the conflict surface: for every file the series touches, the lines upstream changed in
it between the two versions and the patches that touch it.

When every patch is clean or merged, `--out DIR` writes the refreshed series (`git format-patch`, the
same names), ready to replace services/llama/patches. The pin itself (build_config.py's version, sdist sha256
and llama.cpp commit, tests/llama_series_manifest.json) is then moved by hand: docs/llama-fork.md,
"Bumping llama.cpp", lists the steps.

Standard library only (plus git), like build.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import build

PACKAGE = "llama-cpp-python"
GIT_IDENTITY = ("-c", "user.name=moe-l2", "-c", "user.email=moe-l2@users.noreply.github.com")


class BumpError(Exception):
    """A bump that cannot proceed; the message is one line meant for the user."""


@dataclass
class Hunk:
    """One conflict a patch left in a file: where, and the two sides (upstream's, the patch's)."""

    file: str
    line: int
    upstream: list[str]
    patch: list[str]


@dataclass
class PatchResult:
    name: str
    status: str  # clean | merged | conflict | fails
    files: list[str]
    added: int
    removed: int
    hunks: list[Hunk] = field(default_factory=list)
    error: str = ""


@dataclass
class Survey:
    version_from: str
    version_to: str
    patches: list[PatchResult]
    surface: dict[str, dict[str, object]]  # file -> {"upstream_lines": n, "patches": [...]}
    seconds: float

    def counts(self) -> dict[str, int]:
        out = {"clean": 0, "merged": 0, "conflict": 0, "fails": 0}
        for p in self.patches:
            out[p.status] += 1
        return out


def sdist_files(index: str) -> list[dict]:
    """The package's files on a PEP 691 simple index (JSON)."""
    req = urllib.request.Request(
        f"{index.rstrip('/')}/{PACKAGE}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return [f for f in json.load(resp)["files"] if f["filename"].endswith(".tar.gz")]
    except (OSError, ValueError, KeyError) as exc:
        raise BumpError(f"cannot list {PACKAGE} on {index}: {exc}") from exc


def _version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.+-]", version))


def sdist_version(filename: str) -> str:
    return filename.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")


def newest(files: list[dict]) -> str:
    versions = [sdist_version(f["filename"]) for f in files if not f.get("yanked")]
    plain = [v for v in versions if re.fullmatch(r"[0-9.]+", v)]  # no release candidates
    if not plain:
        raise BumpError(f"no {PACKAGE} sdist on the index")
    return max(plain, key=_version_key)


def fetch(version: str, files: list[dict], cache: Path) -> Path:
    """The sdist of `version` in the cache, checked against the sha256 the index gives for it."""
    name = f"llama_cpp_python-{version}.tar.gz"
    entry = next((f for f in files if f["filename"] == name), None)
    if entry is None:
        raise BumpError(f"{name} is not on the index (newest: {newest(files)})")
    want = entry.get("hashes", {}).get("sha256")
    dest = cache / "src" / name
    if not dest.is_file() or (want and build.sha256_file(dest) != want):
        dest.parent.mkdir(parents=True, exist_ok=True)
        build.log(f"fetching {name}")
        tmp = dest.with_suffix(".part")
        try:
            with urllib.request.urlopen(entry["url"], timeout=120) as resp, tmp.open("wb") as out:
                total = int(resp.headers.get("Content-Length") or 0)
                progress, done = build.Progress(f"downloading {name}"), 0
                while chunk := resp.read(1 << 20):
                    out.write(chunk)
                    done += len(chunk)
                    progress.update(done >> 20, total >> 20)
                progress.close()
        except OSError as exc:
            raise BumpError(f"cannot download {name}: {exc}") from exc
        tmp.replace(dest)
    if want and build.sha256_file(dest) != want:
        dest.unlink(missing_ok=True)
        raise BumpError(f"{name}: sha256 does not match the index's; removed, run again")
    return dest


def extract_tree(archive: Path, version: str, dest: Path) -> None:
    """The sdist's vendor/llama.cpp as the root of dest (its .git link left out)."""
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name[len(prefix) :] if m.name.startswith(prefix) else ""
            if rel and rel != ".git" and not rel.startswith(".git/"):
                m.name = rel
                members.append(m)
        if not members:
            raise BumpError(f"{archive.name} has no vendor/llama.cpp tree")
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, members=members, **kwargs)


def git(repo: Path, *args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(repo.parent), "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z"}
    result = subprocess.run(
        ["git", *GIT_IDENTITY, *args], cwd=repo, capture_output=True, text=True, env=env, input=stdin
    )
    if check and result.returncode != 0:
        raise BumpError(f"git {args[0]} failed: {(result.stderr or result.stdout).strip().splitlines()[-1:]}")
    return result


def replace_tree(repo: Path, archive: Path, version: str) -> None:
    """The work tree of repo becomes the sdist's llama.cpp tree, committed."""
    for child in repo.iterdir():
        if child.name != ".git":
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    extract_tree(archive, version, repo)
    git(repo, "add", "-A", "-f")
    git(repo, "commit", "-q", "--allow-empty", "-m", f"llama.cpp of llama-cpp-python {version}")


def patch_stats(patch: Path) -> tuple[list[str], int, int]:
    files, added, removed = [], 0, 0
    for line in patch.read_text().splitlines():
        if line.startswith("diff --git a/"):
            files.append(line.split()[2][2:])
        elif line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed += 1
    return files, added, removed


def conflict_hunks(repo: Path, path: str) -> list[Hunk]:
    """The conflict blocks `git apply -3` left in a file: upstream's side, then the patch's."""
    hunks: list[Hunk] = []
    lines = (repo / path).read_text(errors="replace").splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("<<<<<<< "):
            i += 1
            continue
        start, ours, theirs, side = i + 1, [], [], "ours"
        i += 1
        while i < len(lines) and not lines[i].startswith(">>>>>>> "):
            if lines[i].startswith("=======") and side == "ours":
                side = "theirs"
            elif side == "ours":
                ours.append(lines[i])
            else:
                theirs.append(lines[i])
            i += 1
        hunks.append(Hunk(path, start, ours, theirs))
        i += 1
    return hunks


def apply_one(repo: Path, patch: Path) -> PatchResult:
    files, added, removed = patch_stats(patch)
    result = PatchResult(patch.name, "clean", files, added, removed)
    p = str(patch)
    if git(repo, "apply", "--check", "--whitespace=nowarn", p, check=False).returncode == 0:
        git(repo, "apply", "--index", "--whitespace=nowarn", p)
    else:
        merged = git(repo, "apply", "-3", "--index", "--whitespace=nowarn", p, check=False)
        conflicted = git(repo, "diff", "--name-only", "--diff-filter=U").stdout.split()
        if merged.returncode == 0 and not conflicted:
            result.status = "merged"
        elif conflicted:
            result.status = "conflict"
            for path in conflicted:
                result.hunks += conflict_hunks(repo, path)
                # go on with the patch's side, so that the patches after it are surveyed too
                git(repo, "checkout", "--theirs", "--", path)
                git(repo, "add", "--", path)
        else:
            result.status = "fails"
            result.error = (merged.stderr.strip().splitlines() or ["unknown reason"])[0]
            git(repo, "reset", "-q", "--hard")
            return result
    git(repo, "commit", "-q", "--allow-empty", "-m", patch.stem)
    return result


def surface(repo: Path, base: str, upstream: str, results: list[PatchResult]) -> dict[str, dict[str, object]]:
    """For each file the series touches: lines upstream changed in it between the versions, and by whom
    of the series it is touched."""
    touched: dict[str, list[str]] = {}
    for r in results:
        for f in r.files:
            touched.setdefault(f, []).append(r.name.split("-", 1)[0])
    numstat = git(repo, "diff", "--numstat", base, upstream, "--", *touched).stdout.splitlines()
    changed = {}
    for line in numstat:
        a, d, path = line.split("\t", 2)
        changed[path] = (0 if a == "-" else int(a)) + (0 if d == "-" else int(d))
    return {f: {"upstream_lines": changed.get(f, 0), "patches": touched[f]} for f in sorted(touched)}


def survey(
    target: str,
    files: list[dict],
    *,
    pinned: tuple[str, Path],
    patches: list[Path],
    cache: Path,
    work: Path,
    out: Path | None = None,
) -> Survey:
    """The series (`patches`, made on the `pinned` (version, sdist)) replayed on the sdist of `target`, one
    of the index's `files`, in a git repository under `work`; `out`: write the refreshed series there."""
    started = time.monotonic()
    if work.exists():
        shutil.rmtree(work)
    repo = work / "tree"
    repo.mkdir(parents=True)
    git(repo, "init", "-q")
    build.log(f"the pinned tree ({pinned[0]}) and the tree of {target}")
    extract_tree(pinned[1], pinned[0], repo)
    git(repo, "add", "-A", "-f")
    git(repo, "commit", "-q", "-m", f"llama.cpp of llama-cpp-python {pinned[0]}")
    git(repo, "tag", "pinned")
    replace_tree(repo, fetch(target, files, cache), target)
    git(repo, "tag", "upstream")
    results = []
    for i, patch in enumerate(patches, 1):
        r = apply_one(repo, patch)
        results.append(r)
        build.log(f"[{i}/{len(patches)}] {patch.name}: {r.status}" + (f" ({len(r.hunks)} hunks)" if r.hunks else ""))
    result = Survey(pinned[0], target, results, surface(repo, "pinned", "upstream", results), 0.0)
    if out is not None:
        write_series(repo, result, out)
    result.seconds = round(time.monotonic() - started, 1)
    return result


def write_series(repo: Path, result: Survey, out: Path) -> None:
    blocked = [p.name for p in result.patches if p.status in ("conflict", "fails")]
    if blocked:
        raise BumpError(f"not writing a refreshed series: {', '.join(blocked)} need work first")
    tmp = repo.parent / "format-patch"
    git(repo, "format-patch", "-q", "--zero-commit", "--no-signature", "--abbrev=7", "-o", str(tmp), "upstream..HEAD")
    out.mkdir(parents=True, exist_ok=True)
    for made, p in zip(sorted(tmp.glob("*.patch")), result.patches, strict=True):
        shutil.copy(made, out / p.name)
    build.log(f"refreshed series in {out}")


def render(result: Survey) -> str:
    c = result.counts()
    lines = [
        f"llama-cpp-python {result.version_from} -> {result.version_to}: {len(result.patches)} patches, "
        f"{c['clean']} clean, {c['merged']} merged (fuzz), {c['conflict']} with conflicts, {c['fails']} failing "
        f"({result.seconds:.0f}s)",
        "",
        f"{'patch':<40} {'status':<9} {'+lines':>7} {'-lines':>7}  conflicts",
    ]
    for p in result.patches:
        where = ", ".join(f"{h.file}:{h.line}" for h in p.hunks) or p.error
        lines.append(f"{p.name:<40} {p.status:<9} {p.added:>7} {p.removed:>7}  {where}")
    lines += ["", "conflict surface: lines upstream changed in each file the series touches"]
    for f, s in sorted(result.surface.items(), key=lambda kv: -int(kv[1]["upstream_lines"])):  # type: ignore[call-overload]
        lines.append(f"  {s['upstream_lines']:>6}  {f}  (patches {' '.join(s['patches'])})")  # type: ignore[arg-type]
    for p in result.patches:
        for h in p.hunks:
            lines += ["", f"--- {p.name}: {h.file}:{h.line}", "upstream:"]
            lines += [f"  {x}" for x in h.upstream[:12]] + (["  ..."] if len(h.upstream) > 12 else [])
            lines += ["patch:"] + [f"  {x}" for x in h.patch[:12]] + (["  ..."] if len(h.patch) > 12 else [])
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="moe-l2 bump-llama",
        description="Replay the llama.cpp patch series on another llama-cpp-python sdist and report, patch by "
        "patch, what applies clean, what needs a merge (fuzz) and what conflicts, with the conflicting hunks.",
    )
    parser.add_argument("version", nargs="?", default="latest", help="llama-cpp-python version, or latest (default)")
    parser.add_argument("--out", type=Path, help="write the refreshed series here when no patch needs work")
    parser.add_argument("--json", type=Path, help="also write the survey as JSON")
    parser.add_argument("--work", type=Path, help="the git repository's folder (default: CACHE/bump/VERSION)")
    parser.add_argument(
        "--cache-dir", type=Path, help="cache folder (default ~/.cache/moe-l2 or MOE_L2_BUILD_CACHE_DIR)"
    )
    parser.add_argument("--patches-dir", type=Path, help="patch series folder (default services/llama/patches)")
    parser.add_argument("--index", default=os.environ.get("MOE_L2_PYPI_INDEX", build.DEFAULT_INDEX))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cache = args.cache_dir or build.default_cache_dir()
    if shutil.which("git") is None:
        print("moe-l2 bump-llama: git is needed (apt-get install git)", file=sys.stderr)
        return 2
    try:
        if args.version == build.LLAMA_CPP_PYTHON_VERSION:
            print(f"llama-cpp-python {args.version} is the pinned version: nothing to bump")
            return 0
        files = sdist_files(args.index)
        version = newest(files) if args.version == "latest" else args.version
        if args.version == "latest":
            if version == build.LLAMA_CPP_PYTHON_VERSION:
                print(f"the pinned llama-cpp-python {version} is the newest on {args.index}: nothing to bump")
                return 0
        result = survey(
            version,
            files,
            pinned=(build.LLAMA_CPP_PYTHON_VERSION, build.fetch_sdist(cache)),
            patches=build.patch_files(args.patches_dir or build.default_patches_dir()),
            cache=cache,
            work=args.work or cache / "bump" / version,
            out=args.out,
        )
    except (BumpError, build.BuildError) as exc:
        print(f"moe-l2 bump-llama: {exc}", file=sys.stderr)
        return 2
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps({**asdict(result), "counts": result.counts()}, indent=1) + "\n")
    return 0 if result.counts()["conflict"] + result.counts()["fails"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
