"""The CI policy plugin (tests/ci_policy.py): planted skips in a pytest session of their own, with CI set
and not, against an allowlist of the test's own; the repository's allowlist and area table themselves."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.ci_policy import ALLOWLIST, AREAS, AllowlistError, area_of, load_allowlist

ROOT = Path(__file__).resolve().parent.parent

PLANTED = textwrap.dedent(
    """
    import pytest

    def test_runs():
        pass

    def test_needs_data():
        pytest.skip("routing data absent at /nowhere")

    def test_needs_a_gpu():
        pytest.skip("no GPU on this machine")

    @pytest.mark.xfail(reason="a known fault", strict=True)
    def test_known_fault():
        raise RuntimeError
    """
)

ALLOW_GPU = """
[[allow]]
test = "test_planted.py::test_needs_a_gpu"
reason = "^no GPU"
why = "CI machines have none"
"""
ALLOW_BOTH = (
    ALLOW_GPU
    + """
[[allow]]
test = "test_planted.py::test_needs_*"
reason = "routing data absent"
why = "planted"
"""
)


def session(
    tmp_path: Path, allowlist: str, *args: str, ci: bool, tests: str = PLANTED
) -> subprocess.CompletedProcess[str]:
    """pytest on the planted module with only this plugin, CI set or not."""
    (tmp_path / "test_planted.py").write_text(tests)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "allow.toml").write_text(allowlist)
    # the plugin alone: the environment's own pytest plugins (hypothesis, schemathesis) cost 3 s a session
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {
        "PYTHONPATH": str(ROOT),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    if ci:
        env["CI"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "tests.ci_policy",
         "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "t"),
         "--skip-allowlist", str(tmp_path / "allow.toml"), *args,
         *([] if any("::" in a and not a.startswith("-") for a in args) else [str(tmp_path / "test_planted.py")])],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_ci_fails_on_a_skip_the_allowlist_does_not_name(tmp_path: Path) -> None:
    run = session(tmp_path, ALLOW_GPU, ci=True)
    assert run.returncode == 1, run.stdout
    assert "1 passed, 2 skipped, 1 xfailed" in run.stdout  # pytest's own count is unchanged
    assert "skips CI does not allow" in run.stdout
    refused = [line.strip() for line in run.stdout.splitlines() if line.startswith("  test_planted.py::")]
    # the allowlisted skip is not named, the xfail is no skip
    assert refused == ["test_planted.py::test_needs_data: routing data absent at /nowhere"], run.stdout


def test_ci_passes_when_every_skip_is_allowlisted(tmp_path: Path) -> None:
    run = session(tmp_path, ALLOW_BOTH, ci=True)
    assert run.returncode == 0, run.stdout
    assert "skips CI" not in run.stdout
    # each allowlisted skip is named with its reason and the entry's why
    assert (
        "allowlisted skip: test_planted.py::test_needs_a_gpu: no GPU on this machine (why: CI machines have none)"
        in (run.stdout)
    )


def test_the_reason_must_match_as_well_as_the_test(tmp_path: Path) -> None:
    allowlist = ALLOW_GPU.replace("^no GPU", "^no TPU")
    run = session(tmp_path, allowlist, ci=True)
    assert run.returncode == 1 and "test_needs_a_gpu: no GPU on this machine" in run.stdout, run.stdout


def test_outside_ci_the_same_skips_pass_and_are_listed(tmp_path: Path) -> None:
    run = session(tmp_path, ALLOW_GPU, ci=False)
    assert run.returncode == 0, run.stdout
    assert "skips CI would refuse" in run.stdout and "test_needs_data: routing data absent" in run.stdout


def test_a_module_skipped_while_collected_is_a_skip_too(tmp_path: Path) -> None:
    guarded = 'import pytest\n\npytest.importorskip("no_such_module_here")\n\ndef test_x():\n    pass\n'
    run = session(tmp_path, ALLOW_GPU, ci=True, tests=guarded)
    assert run.returncode == 1, run.stdout
    assert "test_planted.py: could not import 'no_such_module_here'" in run.stdout, run.stdout


def test_a_failing_run_keeps_its_failure(tmp_path: Path) -> None:
    failing = PLANTED + "\ndef test_fails():\n    assert False\n"
    run = session(tmp_path, ALLOW_GPU, ci=True, tests=failing)
    assert run.returncode == 1 and "1 failed" in run.stdout and "skips CI does not allow" in run.stdout


def test_the_summary_counts_per_area(tmp_path: Path) -> None:
    run = session(tmp_path, ALLOW_BOTH, ci=True)
    # the planted file is in no area of the table: "other"
    assert re.search(r"^  other +2 ran, 1 passed, 2 skipped, 1 xfailed$", run.stdout, re.M), run.stdout


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('[[allow]]\ntest = "t.py::x"\nreason = "r"\n', "exactly the keys test, reason and why"),
        ('[[allow]]\ntest = "t.py::x"\nreason = "r"\nwhy = " "\n', "non-empty strings"),
        ('[[allow]]\ntest = "t.py::x"\nreason = "("\nwhy = "w"\n', "not a regular expression"),
        ('[[skip]]\ntest = "t.py::x"\n', "unknown keys ['skip']"),
        ("[[allow]\n", "Expected"),
    ],
)
def test_a_bad_allowlist_is_a_usage_error(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "allow.toml"
    path.write_text(text)
    with pytest.raises(AllowlistError, match=re.escape(problem)):
        load_allowlist(path)
    if problem == "Expected":  # one session is enough to see the error stop pytest, CI or not
        run = session(tmp_path, text, ci=False)
        assert run.returncode == 4 and f"skip allowlist: {path}" in run.stderr, run.stderr


# Vulkan tests and their RPC twins (issue 42): a device-parametrized test (its `rpc_device` case is the twin)
# and a test with an `rpc_twin` mark; the Vulkan cases skip for a device fault as tests/conftest.py's
# fixture does when the probe finds one. TWIN_FAILS plants a failing twin; --deselect removes one.
TWINS = textwrap.dedent(
    """
    import os
    import pytest

    FAULT = "llvmpipe fault (docs/test-bed.md; their RPC twins must pass): EPYC; Mesa 22.3.6; planted"

    @pytest.mark.parametrize("device", ["rpc_device", pytest.param("vulkan_device", marks=pytest.mark.vulkan)])
    @pytest.mark.parametrize("model", ["demo", "ds"])
    def test_tokens(device, model):
        if device == "vulkan_device":
            pytest.skip(FAULT)
        assert not (os.environ.get("TWIN_FAILS") and model == "ds")

    def test_auto_on_rpc():
        pass

    @pytest.mark.vulkan
    @pytest.mark.rpc_twin("test_planted.py::test_auto_on_rpc")
    def test_auto_on_llvmpipe():
        pytest.skip(FAULT)
    """
)
TWINLESS = TWINS + textwrap.dedent(
    """
    @pytest.mark.vulkan
    def test_pinned_memory_on_llvmpipe():
        pytest.skip(FAULT)
    """
)


def test_a_device_fault_passes_ci_where_every_twin_passed(tmp_path: Path) -> None:
    run = session(tmp_path, "", ci=True, tests=TWINS)
    assert run.returncode == 0, run.stdout
    assert "3 passed, 3 skipped" in run.stdout
    assert "vulkan: 3 skipped (llvmpipe fault: EPYC; Mesa 22.3.6; planted); their RPC twins: 3 passed" in run.stdout
    for vulkan, rpc in [
        ("test_tokens[demo-vulkan_device]", "test_tokens[demo-rpc_device]"),
        ("test_tokens[ds-vulkan_device]", "test_tokens[ds-rpc_device]"),
        ("test_auto_on_llvmpipe", "test_auto_on_rpc"),
    ]:
        assert f"  test_planted.py::{vulkan} <- twin test_planted.py::{rpc} passed" in run.stdout, run.stdout
    assert "skips CI does not allow" not in run.stdout


def test_a_twin_that_fails_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWIN_FAILS", "1")
    run = session(tmp_path, "", ci=True, tests=TWINS)
    assert run.returncode == 1, run.stdout
    assert "their RPC twins: 2 passed, 1 not" in run.stdout
    twin = "test_planted.py::test_tokens[ds-rpc_device]"
    assert f"test_planted.py::test_tokens[ds-vulkan_device]: its RPC twin {twin} failed" in run.stdout


def test_a_twin_that_did_not_run_fails_the_run_in_ci_only(tmp_path: Path) -> None:
    removed = "--deselect=test_planted.py::test_auto_on_rpc"
    run = session(tmp_path, "", removed, ci=True, tests=TWINS)
    assert run.returncode == 1, run.stdout
    assert "test_auto_on_llvmpipe: its RPC twin test_planted.py::test_auto_on_rpc did not run" in run.stdout
    assert session(tmp_path, "", removed, ci=False, tests=TWINS).returncode == 0


def test_a_vulkan_test_run_alone_names_its_twin_that_did_not_run(tmp_path: Path) -> None:
    """Run by its node id, the Vulkan case's twin is not collected at all: it is still named, and missing."""
    (tmp_path / "test_planted.py").write_text(TWINS)
    alone = str(tmp_path / "test_planted.py") + "::test_tokens[ds-vulkan_device]"
    run = session(tmp_path, "", alone, ci=True, tests=TWINS)
    assert run.returncode == 1, run.stdout
    twin = "test_planted.py::test_tokens[ds-rpc_device]"
    assert f"test_planted.py::test_tokens[ds-vulkan_device]: its RPC twin {twin} did not run" in run.stdout


def test_a_vulkan_test_without_a_twin_cannot_be_skipped(tmp_path: Path) -> None:
    """Not even by an allowlist entry: only a twin covers a device fault."""
    allow = '[[allow]]\ntest = "*"\nreason = "llvmpipe fault"\nwhy = "an entry that tries to allow every fault"\n'
    run = session(tmp_path, allow, ci=True, tests=TWINLESS)
    assert run.returncode == 1, run.stdout
    assert "skips CI does not allow" in run.stdout
    assert re.search(r"test_pinned_memory_on_llvmpipe: llvmpipe fault .*\[no RPC twin", run.stdout), run.stdout
    assert "their RPC twins: 3 passed" in run.stdout  # the others are still covered


def test_every_vulkan_test_that_meets_the_probe_has_a_twin() -> None:
    """The repository's pairs, as collected: a Vulkan test that the probe can skip has an RPC twin that is
    collected too; the others (start-up only, `vulkan_build`) never meet the probe."""
    collect = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    run = subprocess.run(
        [*collect, "--show-twins", "-m", "vulkan"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    pairs = re.findall(r"^twin: (\S+) <- (\S+) \((probed|unprobed)\)$", run.stdout, re.M)
    assert len(pairs) >= 15, run.stdout[-3000:]
    collected = set(subprocess.run(
        [*collect, "tests/test_vulkan.py",
         "tests/test_backend_ops.py", "tests/test_expert_cache.py", "tests/test_expert_cache_auto.py",
         "tests/test_expert_cache_cpu_misses.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    ).stdout.split())  # fmt: skip
    for vulkan, twin, probed in pairs:
        if probed == "probed":
            assert twin != "None" and twin in collected, f"{vulkan}: no RPC twin collected ({twin})"
            assert "vulkan" not in twin.rsplit("[", 1)[-1], f"{vulkan}: its twin {twin} is a Vulkan case"
        else:
            assert twin == "None" and vulkan.startswith("tests/test_expert_cache_copies.py::"), vulkan


def test_the_repository_allowlist_names_tests_that_exist() -> None:
    entries = load_allowlist(ALLOWLIST)
    assert entries, "the CUDA build's skip is allowed"
    for entry in entries:
        path, _, name = entry.test.partition("::")
        assert (ROOT / path).is_file(), entry.test
        assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), entry.test
        assert len(entry.why.split()) >= 10, f"{entry.test}: say why CI may skip it"


def test_every_area_pattern_matches_a_test_file() -> None:
    files = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")]
    for pattern, area in AREAS:
        assert any(area_of(f"{f}::test") == area for f in files if re.fullmatch(pattern.replace("*", ".*"), f)), (
            f"{pattern} matches no test file: a stale line of AREAS"
        )
    assert area_of("tests/cache/test_e2e.py::test_x[1]") == "cache"
    assert area_of("tests/test_expert_cache_copies.py::test_y") == "engine"
    assert area_of("tests/test_supervisor.py::test_z") == "other"
