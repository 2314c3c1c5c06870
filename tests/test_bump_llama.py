"""`moe-l2 bump-llama` on two small sdists made here: one patch of each kind the survey tells apart.

The pinned tree has four files and the series one patch for each. The "newer" sdist moves the first
file's hunk down (clean: git finds it at an offset), changes a line next to the second one's hunk (merged:
only the three-way merge takes it), changes the very line the third patch changes (conflict), and removes
the fourth file (fails). The real survey, on the registry's sdists, is in docs/llama-fork.md.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from moe_l2_llama import bump

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

BODY = [f"line {i}" for i in range(1, 31)]


def sdist(path: Path, version: str, files: dict[str, list[str]]) -> dict:
    """A llama-cpp-python-shaped sdist with `files` under vendor/llama.cpp, as an index entry."""
    with tarfile.open(path, "w:gz") as tar:
        for name, lines in files.items():
            data = ("\n".join(lines) + "\n").encode()
            info = tarfile.TarInfo(f"llama_cpp_python-{version}/vendor/llama.cpp/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"filename": path.name, "url": path.as_uri(), "hashes": {"sha256": digest}}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def series(pinned: dict[str, list[str]], edits: dict[str, tuple[int, str]], out: Path) -> list[Path]:
    """One patch per edited file (line number -> new text), made with git format-patch on the pinned tree."""
    repo = out / "repo"
    repo.mkdir(parents=True)
    git(repo, "init", "-q")
    for name, lines in pinned.items():
        (repo / name).write_text("\n".join(lines) + "\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    for name, (line, text) in edits.items():
        lines = (repo / name).read_text().splitlines()
        lines[line - 1] = text
        (repo / name).write_text("\n".join(lines) + "\n")
        git(repo, "commit", "-qam", f"edit {name}: what and why")
    git(repo, "format-patch", "-q", "-o", str(out / "patches"), "HEAD~4")
    made = sorted((out / "patches").glob("*.patch"))
    named = []
    for i, (patch, name) in enumerate(zip(made, edits, strict=True), 1):
        named.append(patch.rename(patch.with_name(f"{i:04d}-{Path(name).stem}.patch")))
    return named


@pytest.fixture
def world(tmp_path: Path) -> dict:
    pinned = {name: BODY for name in ("offset.c", "nearby.c", "same.c", "gone.c")}
    newer = {
        "offset.c": ["// five lines", "// upstream", "// added", "// at the", "// top", *BODY],
        "nearby.c": [*BODY[:12], "line 13 (upstream)", *BODY[13:]],
        "same.c": [*BODY[:14], "line 15 (upstream)", *BODY[15:]],
    }
    edits = {name: (15, "line 15 (ours)") for name in pinned}
    (tmp_path / "cache" / "src").mkdir(parents=True)
    pinned_sdist = tmp_path / "llama_cpp_python-1.0.tar.gz"
    sdist(pinned_sdist, "1.0", pinned)
    newer_entry = sdist(tmp_path / "llama_cpp_python-1.1.tar.gz", "1.1", newer)
    return {
        "patches": series(pinned, edits, tmp_path / "series"),
        "pinned": ("1.0", pinned_sdist),
        "files": [newer_entry],
        "cache": tmp_path / "cache",
        "work": tmp_path / "work",
    }


def test_each_patch_is_sorted_by_what_it_needs(world: dict) -> None:
    result = bump.survey("1.1", world["files"], pinned=world["pinned"], patches=world["patches"],
                         cache=world["cache"], work=world["work"])  # fmt: skip
    assert [(p.name, p.status) for p in result.patches] == [
        ("0001-offset.patch", "clean"),
        ("0002-nearby.patch", "merged"),
        ("0003-same.patch", "conflict"),
        ("0004-gone.patch", "fails"),
    ]
    assert result.counts() == {"clean": 1, "merged": 1, "conflict": 1, "fails": 1}
    (hunk,) = result.patches[2].hunks
    assert (hunk.file, hunk.upstream, hunk.patch) == ("same.c", ["line 15 (upstream)"], ["line 15 (ours)"])
    assert "gone.c" in result.patches[3].error
    # lines upstream changed in each touched file: 5 added; 1 changed (-1 +1) twice; 30 removed
    assert {f: s["upstream_lines"] for f, s in result.surface.items()} == {
        "gone.c": 30,
        "nearby.c": 2,
        "offset.c": 5,
        "same.c": 2,
    }
    report = bump.render(result)
    assert "1 clean, 1 merged (fuzz), 1 with conflicts, 1 failing" in report
    assert "0003-same.patch                          conflict" in report and "same.c:15" in report


def test_a_refreshed_series_is_written_only_when_nothing_needs_work(world: dict, tmp_path: Path) -> None:
    args = {"pinned": world["pinned"], "cache": world["cache"], "work": world["work"]}
    with pytest.raises(bump.BumpError, match=r"0003-same\.patch, 0004-gone\.patch need work first"):
        bump.survey("1.1", world["files"], patches=world["patches"], out=tmp_path / "refused", **args)
    assert not (tmp_path / "refused").exists()

    out = tmp_path / "refreshed"
    result = bump.survey("1.1", world["files"], patches=world["patches"][:2], out=out, **args)
    assert [p.status for p in result.patches] == ["clean", "merged"]
    assert sorted(p.name for p in out.iterdir()) == ["0001-offset.patch", "0002-nearby.patch"]
    # the refreshed patches apply as they are, without a merge, to the newer tree
    tree = tmp_path / "newer"
    bump.extract_tree(Path(world["files"][0]["url"].removeprefix("file://")), "1.1", tree)
    for patch in sorted(out.iterdir()):
        subprocess.run(["git", "apply", str(patch)], cwd=tree, check=True)
    assert (tree / "nearby.c").read_text().splitlines()[12:15] == ["line 13 (upstream)", "line 14", "line 15 (ours)"]


def test_a_sdist_whose_checksum_is_not_the_index_s_is_refused(world: dict) -> None:
    entry = {**world["files"][0], "hashes": {"sha256": "0" * 64}}
    with pytest.raises(bump.BumpError, match="sha256 does not match the index's"):
        bump.fetch("1.1", [entry], world["cache"])
    with pytest.raises(bump.BumpError, match=r"llama_cpp_python-9.9.tar.gz is not on the index \(newest: 1.1\)"):
        bump.fetch("9.9", world["files"], world["cache"])


def test_the_newest_version_skips_release_candidates() -> None:
    names = ["0.3.9", "0.3.36", "0.3.10", "0.4.0rc1"]
    assert bump.newest([{"filename": f"llama_cpp_python-{v}.tar.gz"} for v in names]) == "0.3.36"


def test_bumping_to_the_pinned_version_says_there_is_nothing_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    assert bump.main([bump.build.LLAMA_CPP_PYTHON_VERSION]) == 0
    assert "is the pinned version: nothing to bump" in capsys.readouterr().out
