"""The suite's CI policy, a pytest plugin (tests/conftest.py loads it): no silent skip, and what ran where.

- With CI set (`.ci/run` sets CI=1), a test skipped for a reason that no entry of
  tests/skip_allowlist.toml allows fails the session at its end: the skips are listed with their
  reasons and the exit status is 1, however green the rest. Outside CI such skips pass and are only
  listed, so a developer sees what CI would refuse. An allowlist that does not parse, or an entry
  without its `why`, is a usage error on every run: the file is reviewed, so it must stay valid.
- Every run ends with one line per area of the suite: the tests that ran, passed, failed, were
  skipped or xfailed (AREAS maps test paths to areas; a path it does not map is counted as "other").

`--skip-allowlist FILE` reads another allowlist (the plugin's own tests use it).
"""

from __future__ import annotations

import fnmatch
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ALLOWLIST = Path(__file__).resolve().parent / "skip_allowlist.toml"

# Test path (an fnmatch glob over the node id's file part, relative to the repository) -> area; the
# first match wins. Unmapped paths count as "other": the stack as a whole and its operations (`moe-l2
# up`, the supervisor and restarts, stats and doctor, observability, the services' fuzzing), the lock
# files, the import layers and this plugin's own tests.
AREAS: tuple[tuple[str, str], ...] = (
    # the patched llama-server: its build, its patches, the expert cache, the devices it runs on, the models
    ("tests/test_llama_server.py", "engine"),
    ("tests/test_expert_cache*.py", "engine"),
    ("tests/test_vulkan.py", "engine"),
    ("tests/test_llvmpipe_probe.py", "engine"),
    ("tests/test_build_llama.py", "engine"),
    ("tests/test_backend_ops.py", "engine"),
    ("tests/test_bump_llama.py", "engine"),
    ("tests/test_cuda_toolchain.py", "engine"),
    ("tests/test_source_archive.py", "engine"),
    ("tests/test_moe_willneed.py", "engine"),
    ("tests/test_route_trace.py", "engine"),
    ("tests/test_upstream_server_tests.py", "engine"),
    ("tests/test_llama_settings.py", "engine"),
    ("tests/test_demo_model.py", "engine"),
    ("tests/test_model_shapes.py", "engine"),
    ("tests/test_gpu_check.py", "engine"),
    ("tests/test_expert_offload_bench.py", "engine"),
    ("tests/fuzz/test_hot_set_body.py", "engine"),
    # the gateway: its APIs, transports, routing over replicas
    ("tests/proxy/*", "gateway"),
    ("tests/scale_out/*", "gateway"),
    ("tests/test_affinity_replay_bench.py", "gateway"),
    ("tests/fuzz/test_parsers.py", "gateway"),
    # the cache-manager and its policies
    ("tests/cache/*", "cache"),
    ("tests/policy/*", "cache"),
    ("tests/test_ram_tier_bench.py", "cache"),
    ("tests/predictor/*", "predictor"),
    # the images and compose
    ("tests/containers/*", "containers"),
    ("tests/compose/*", "containers"),
    ("tests/test_dockerfiles.py", "containers"),
    ("tests/kubernetes/*", "kubernetes"),
)
AREA_ORDER = ("engine", "gateway", "cache", "predictor", "containers", "kubernetes", "other")


def area_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((area for pattern, area in AREAS if fnmatch.fnmatch(path, pattern)), "other")


def ci_enabled() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class Allowed:
    test: str
    reason: re.Pattern[str]
    why: str

    def allows(self, nodeid: str, message: str) -> bool:
        return fnmatch.fnmatch(nodeid, self.test) and self.reason.search(message) is not None


class AllowlistError(Exception):
    pass


def load_allowlist(path: Path) -> list[Allowed]:
    """The entries of an allowlist file; AllowlistError names the file and what is wrong with it."""
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise AllowlistError(f"{path}: {exc}") from exc
    unknown = set(doc) - {"allow"}
    if unknown:
        raise AllowlistError(f"{path}: unknown keys {sorted(unknown)} (entries are [[allow]] tables)")
    entries = []
    for number, entry in enumerate(doc.get("allow", []), start=1):
        where = f"{path}: entry {number}"
        if not isinstance(entry, dict) or set(entry) != {"test", "reason", "why"}:
            got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise AllowlistError(f"{where} must have exactly the keys test, reason and why (has {got})")
        if not all(isinstance(entry[key], str) and entry[key].strip() for key in ("test", "reason", "why")):
            raise AllowlistError(f"{where}: test, reason and why must be non-empty strings")
        try:
            reason = re.compile(entry["reason"])
        except re.error as exc:
            raise AllowlistError(f"{where}: reason is not a regular expression: {exc}") from exc
        entries.append(Allowed(entry["test"], reason, entry["why"].strip()))
    return entries


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def skip_message(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The skip's reason as `-rs` prints it, without pytest's `Skipped: ` prefix."""
    longrepr = report.longrepr
    message = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return message.removeprefix("Skipped: ")


@dataclass
class Tally:
    ran: int = 0  # the test's body ran: passed, failed, xfailed or xpassed
    passed: int = 0
    failed: int = 0  # in its body (xpassed strict included)
    errors: int = 0  # in setup or teardown
    skipped: int = 0
    xfailed: int = 0

    def line(self, area: str) -> str:
        counts = {"failed": self.failed, "errors": self.errors, "skipped": self.skipped, "xfailed": self.xfailed}
        parts = [f"{self.ran} ran", f"{self.passed} passed", *(f"{n} {word}" for word, n in counts.items() if n)]
        return f"  {area:<11} " + ", ".join(parts)


@dataclass(eq=False)  # a plugin object must be hashable
class Policy:
    allowlist_path: Path
    allowlist: list[Allowed]
    ci: bool
    outcomes: dict[str, str] = field(default_factory=dict)  # nodeid -> its one outcome
    skips: dict[str, str] = field(default_factory=dict)  # nodeid -> skip message
    refused: dict[str, str] = field(default_factory=dict)  # the skips no entry allows
    allowed: dict[str, Allowed] = field(default_factory=dict)  # the others, and the entry that allows each

    # -- recording ---------------------------------------------------------------------------------

    def _skipped(self, nodeid: str, message: str) -> None:
        self.skips[nodeid] = message
        entry = next((entry for entry in self.allowlist if entry.allows(nodeid, message)), None)
        if entry is None:
            self.refused[nodeid] = message
        else:
            self.allowed[nodeid] = entry

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        nodeid, before = report.nodeid, self.outcomes.get(report.nodeid)
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "failed" if report.failed else "passed"  # xpassed: passed
        elif report.skipped:
            outcome = "skipped"
            self._skipped(nodeid, skip_message(report))
        elif report.failed:
            outcome = "failed" if report.when == "call" else "error"
        elif report.when == "call":
            outcome = "passed"
        else:
            return  # a setup or teardown that passed says nothing of the test
        if before in ("failed", "error") or (before == "skipped" and outcome != "error"):
            return  # a teardown error after a failure, or after a skip, keeps the first word
        self.outcomes[nodeid] = outcome

    @pytest.hookimpl
    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        # a whole module skipped while collected (pytest.importorskip, skip(allow_module_level=True))
        if report.skipped:
            self._skipped(report.nodeid, skip_message(report))
            self.outcomes[report.nodeid] = "skipped"

    # -- the end -----------------------------------------------------------------------------------

    def tallies(self) -> dict[str, Tally]:
        tallies: dict[str, Tally] = {}
        for nodeid, outcome in self.outcomes.items():
            tally = tallies.setdefault(area_of(nodeid), Tally())
            if outcome == "error":
                tally.errors += 1
                continue
            if outcome in ("passed", "failed", "xfailed"):
                tally.ran += 1
            setattr(tally, outcome, getattr(tally, outcome) + 1)
        return tallies

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        # a run with nothing else wrong fails; a whole module skipped may leave "no tests collected" (5)
        if self.ci and self.refused and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        write = terminalreporter.write_line
        tallies = self.tallies()
        if tallies:
            terminalreporter.write_sep("-", "tests per area (tests/ci_policy.py AREAS)")
            for area in AREA_ORDER:
                if area in tallies:
                    write(tallies[area].line(area))
        for nodeid, entry in self.allowed.items():
            why = " ".join(entry.why.split())
            write(
                f"allowlisted skip: {nodeid}: {self.skips[nodeid]} (why: {why[:160]}{'...' if len(why) > 160 else ''})"
            )
        if not self.refused:
            return
        by_reason: dict[str, list[str]] = {}
        for nodeid, message in self.refused.items():
            by_reason.setdefault(message, []).append(nodeid)
        if self.ci:
            terminalreporter.write_sep("=", "skips CI does not allow", red=True, bold=True)
            write(
                f"CI is set: {plural(len(self.refused), 'test')} skipped for a reason no entry of "
                f"{self.allowlist_path} allows, so this run fails:",
                red=True,
            )
        else:
            terminalreporter.write_sep("-", "skips CI would refuse")
            write(
                f"{plural(len(self.refused), 'skip')} here that no entry of {self.allowlist_path} allows "
                "(CI would fail):"
            )
        for message, nodeids in by_reason.items():
            more = f" (and {len(nodeids) - 1} more)" if len(nodeids) > 1 else ""
            write(f"  {nodeids[0]}{more}: {message}")
        if self.ci:
            write(
                "Remove the cause (install the package in .ci/run, provide the data, fix the device), or, when "
                "the skip is right on every CI machine, add an entry with its reason to the allowlist.",
                red=True,
            )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--skip-allowlist",
        default=str(ALLOWLIST),
        help="the skips CI accepts (default: tests/skip_allowlist.toml; see tests/ci_policy.py)",
    )


def pytest_configure(config: pytest.Config) -> None:
    path = Path(config.getoption("--skip-allowlist"))
    try:
        entries = load_allowlist(path)
    except AllowlistError as exc:
        raise pytest.UsageError(f"skip allowlist: {exc}") from exc
    config.pluginmanager.register(Policy(path, entries, ci_enabled()), "moe-l2-ci-policy")
