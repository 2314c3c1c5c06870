"""The suite's CI policy, a pytest plugin (tests/conftest.py loads it): no silent skip, and what ran where.

- With CI set (`.ci/run` sets CI=1), a test skipped for a reason that no entry of
  tests/skip_allowlist.toml allows fails the session at its end: the skips are listed with their
  reasons and the exit status is 1, however green the rest. Outside CI such skips pass and are only
  listed, so a developer sees what CI would refuse. An allowlist that does not parse, or an entry
  without its `why`, is a usage error on every run: the file is reviewed, so it must stay valid.
- Every run ends with one line per area of the suite: the tests that ran, passed, failed, were
  skipped or xfailed (AREAS maps test paths to areas; a path it does not map is counted as "other").

- A device fault is covered by twins (issue 42). A test skipped for DEVICE_FAULT (tests/conftest.py: the
  probe found that this machine's llvmpipe faults on the batches the Vulkan tests send) passes in CI only
  if its twin on the RPC device, the same assertion on the same model and budgets, ran and passed in
  the same run. The twin is the test's `rpc_twin` mark (a node id), or, for a test parametrized over
  devices (tests/conftest.py's ON_RPC_AND_LLVMPIPE), the same parameters with `rpc_device`. A Vulkan
  test without a twin cannot be skipped; a twin that failed, or did not run, fails the run. The
  summary names each pair.

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
    ("tests/test_llama_archs.py", "engine"),
    ("tests/test_bump_llama.py", "engine"),
    ("tests/test_cuda_toolchain.py", "engine"),
    ("tests/test_build_script_mode.py", "engine"),
    ("tests/test_llama_shutdown.py", "engine"),
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
# The start of a skip's reason that says the device faulted (tests/conftest.py's vulkan_binary): the test
# is then covered by its RPC twin, not by the allowlist.
DEVICE_FAULT = "llvmpipe fault"
# The fixtures through which a test meets the probe (tests/conftest.py): the device parameter, or the build
PROBED_FIXTURES = {"device", "vulkan_binary", "vulkan_device"}
TWIN_DEVICE = ("vulkan_device", "rpc_device")  # the parameter values of a device-parametrized test and its twin

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


def twin_of(item: pytest.Item, by_name: dict[tuple[str, str], list[pytest.Item]]) -> str | None:
    """The node id of item's RPC twin, or None: its `rpc_twin` mark, else the same test with every
    `vulkan_device` parameter `rpc_device` (by_name: the session's items by file and function)."""
    if mark := item.get_closest_marker("rpc_twin"):
        return str(mark.args[0])
    params = getattr(getattr(item, "callspec", None), "params", None)
    if not params or TWIN_DEVICE[0] not in params.values():
        return None
    wanted = {k: TWIN_DEVICE[1] if v == TWIN_DEVICE[0] else v for k, v in params.items()}
    key = (item.nodeid.split("::", 1)[0], getattr(item, "originalname", item.name))
    found = next((other.nodeid for other in by_name.get(key, []) if other.callspec.params == wanted), None)  # type: ignore[attr-defined]
    return found or _twin_by_id(item.nodeid)


def _twin_by_id(nodeid: str) -> str | None:
    """The twin's node id where it was not collected (a run of the Vulkan test's node id alone): its id with
    the device's part of the parameter id swapped, `vulkan` for `rpc` (the repository's ids), or
    `vulkan_device` for `rpc_device` (pytest's own)."""
    head, bracket, ids = nodeid.partition("[")
    if not bracket:
        return None
    swap = {"vulkan": "rpc", TWIN_DEVICE[0]: TWIN_DEVICE[1]}
    parts = ids.removesuffix("]").split("-")
    if not any(part in swap for part in parts):
        return None
    return f"{head}[{'-'.join(swap.get(part, part) for part in parts)}]"


@dataclass(eq=False)  # a plugin object must be hashable
class Policy:
    allowlist_path: Path
    allowlist: list[Allowed]
    ci: bool
    outcomes: dict[str, str] = field(default_factory=dict)  # nodeid -> its one outcome
    skips: dict[str, str] = field(default_factory=dict)  # nodeid -> skip message
    refused: dict[str, str] = field(default_factory=dict)  # the skips no entry allows
    allowed: dict[str, Allowed] = field(default_factory=dict)  # the others, and the entry that allows each
    twins: dict[str, str | None] = field(default_factory=dict)  # a Vulkan test -> its RPC twin's node id
    covered: dict[str, str] = field(default_factory=dict)  # a test skipped for DEVICE_FAULT -> its twin
    show_twins: bool = False

    # -- recording ---------------------------------------------------------------------------------

    def _skipped(self, nodeid: str, message: str) -> None:
        self.skips[nodeid] = message
        if message.startswith(DEVICE_FAULT):
            if twin := self.twins.get(nodeid):
                self.covered[nodeid] = twin
            else:  # no allowlist entry can stand in for a twin
                self.refused[nodeid] = f"{message} [no RPC twin: a Vulkan test without one cannot be skipped]"
            return
        entry = next((entry for entry in self.allowlist if entry.allows(nodeid, message)), None)
        if entry is None:
            self.refused[nodeid] = message
        else:
            self.allowed[nodeid] = entry

    @pytest.hookimpl(tryfirst=True)  # before -k, -m and --deselect: a twin deselected is a twin that did not run
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        by_name: dict[tuple[str, str], list[pytest.Item]] = {}
        for item in items:
            if getattr(item, "callspec", None) is not None:
                key = (item.nodeid.split("::", 1)[0], getattr(item, "originalname", item.name))
                by_name.setdefault(key, []).append(item)
        for item in items:
            if item.get_closest_marker("vulkan"):
                self.twins[item.nodeid] = twin_of(item, by_name)
        if self.show_twins:  # --show-twins: the pairs as collected, one line each (tests/test_ci_policy.py)
            probed = {item.nodeid for item in items if PROBED_FIXTURES & set(getattr(item, "fixturenames", ()))}
            for nodeid, twin in self.twins.items():
                print(f"twin: {nodeid} <- {twin} ({'probed' if nodeid in probed else 'unprobed'})")

    def twin_problems(self) -> dict[str, str]:
        """A covered test -> what is wrong with its twin: it failed, or it did not run."""
        problems = {}
        for nodeid, twin in self.covered.items():
            outcome = self.outcomes.get(twin)
            if outcome != "passed":
                problems[nodeid] = f"its RPC twin {twin} {'did not run' if outcome is None else outcome}"
        return problems

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
        wrong = self.refused or self.twin_problems()
        if self.ci and wrong and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
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
        self._report_twins(terminalreporter)
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

    def _report_twins(self, terminalreporter: pytest.TerminalReporter) -> None:
        """`vulkan: 12 skipped (llvmpipe fault: ...); their RPC twins: 12 passed`, then each pair; a twin
        that failed or did not run is named, and fails the run in CI."""
        if not self.covered:
            return
        write = terminalreporter.write_line
        problems = self.twin_problems()
        first = self.skips[next(iter(self.covered))]
        fault = first.split(": ", 1)[1] if ": " in first else first
        passed = len(self.covered) - len(problems)
        write(
            f"vulkan: {len(self.covered)} skipped ({DEVICE_FAULT}: {fault}); "
            f"their RPC twins: {passed} passed" + (f", {len(problems)} not" if problems else ""),
            red=bool(problems),
        )
        for nodeid, twin in self.covered.items():
            if nodeid in problems:
                write(f"  {nodeid}: {problems[nodeid]}", red=True)
            else:
                write(f"  {nodeid} <- twin {twin} passed")
        if problems and self.ci:
            write(
                f"CI is set: {plural(len(problems), 'Vulkan test')} skipped for a device fault without a passing "
                "RPC twin, so this run fails.",
                red=True,
            )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--skip-allowlist",
        default=str(ALLOWLIST),
        help="the skips CI accepts (default: tests/skip_allowlist.toml; see tests/ci_policy.py)",
    )
    parser.addoption("--show-twins", action="store_true", help="print each Vulkan test's RPC twin as collected")


def pytest_configure(config: pytest.Config) -> None:
    path = Path(config.getoption("--skip-allowlist"))
    try:
        entries = load_allowlist(path)
    except AllowlistError as exc:
        raise pytest.UsageError(f"skip allowlist: {exc}") from exc
    config.addinivalue_line(
        "markers", "rpc_twin(nodeid): the RPC device's test that covers this Vulkan test where llvmpipe faults"
    )
    policy = Policy(path, entries, ci_enabled(), show_twins=config.getoption("--show-twins"))
    config.pluginmanager.register(policy, "moe-l2-ci-policy")
