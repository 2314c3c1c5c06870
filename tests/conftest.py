"""Fixtures: the real patched llama-server on a generated demo MoE model."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from moe_l2_contracts.admin import ADMIN_TOKEN_ENV, ADMIN_TOKEN_HEADER
from moe_l2_gguf.demo_model import load_planted, make_demo_model
from moe_l2_llama.backend import choose_backend
from moe_l2_llama.build import BuildConfig
from moe_l2_llama.serving_plan import llama_server_binary
from moe_l2_llama.settings import LlamaSettings
from moe_l2_ops.llama_service import llama_service_spec
from moe_l2_ops.supervisor import ServiceSpec, Supervisor, SupervisorError, describe_exit, free_port, tcp_open

if TYPE_CHECKING:
    from tests.llvmpipe_probe import ProbeReport

# tests/ci_policy.py: with CI set an unallowlisted skip fails the run; the per-area summary.
# tests/selection.py: the tests that use an engine build are marked, so `make check` leaves them out.
pytest_plugins = ["tests.ci_policy", "tests.selection"]

# Every service a test starts inherits this environment, so they all share one admin token, as
# under `moe-l2 up`; tests of the token itself override it per process.
ADMIN_TOKEN = os.environ.setdefault(ADMIN_TOKEN_ENV, "moe-l2-test-admin-token")
ADMIN_HEADERS = {ADMIN_TOKEN_HEADER: ADMIN_TOKEN}


@dataclass
class LlamaServer:
    url: str
    client: httpx.Client
    log_path: Path

    def routing(self, reset: bool = False) -> dict:
        resp = self.client.get("/moe/routing", params={"reset": "1"} if reset else None, headers=ADMIN_HEADERS)
        resp.raise_for_status()
        return resp.json()

    def metrics(self) -> str:
        resp = self.client.get("/metrics")
        resp.raise_for_status()
        return resp.text


def with_test_hooks(config: BuildConfig) -> BuildConfig:
    """The test suite's build of `config`: with the patch series' test-only hooks (the route-trace replay) and
    upstream's test programs beside llama-server (test-backend-ops, test-llama-archs), which BuildConfig's
    default, the build `moe-l2 up` serves, leaves out. Asked for here, for every build fixture, and by
    `make test`'s `moe-l2 build-llama --test-hooks [--rpc|--vulkan]`: the same flags, so the same cache keys,
    and pytest finds built what `make test` built before it."""
    return replace(config, test_hooks=True)


def engine_test_build(backend: str) -> BuildConfig:
    """The test build of a backend (cpu, rpc, vulkan) as the fixtures below build it."""
    return with_test_hooks(BuildConfig(backend=backend))


@pytest.fixture(scope="session")
def llama_binary() -> Path:
    """MOE_L2_LLAMA_SERVER, else the test build of the backend MOE_L2_LLAMA_BACKEND names (the CPU build for
    auto, as llama_server_binary decides), built once per machine and cached (~6 min on 2 cores the first time)."""
    settings = LlamaSettings()
    choice = choose_backend("cpu" if settings.backend == "auto" else settings.backend)
    return llama_server_binary(settings, replace(choice, config=with_test_hooks(choice.config)))


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "demo.gguf"
    make_demo_model(path, seed=0)
    return path


@pytest.fixture(scope="session")
def planted(demo_model: Path) -> dict:
    return load_planted(demo_model)


@pytest.fixture(scope="session")
def start_llama(
    llama_binary: Path, demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., LlamaServer]]:
    """Factory: start a llama-server with the given settings; all are stopped at session end."""
    supervisor = Supervisor(tmp_path_factory.mktemp("llama-logs"))
    clients: list[httpx.Client] = []

    def start(name: str, *, telemetry: bool = True, parallel: int = 4, ctx_size: int = 4096) -> LlamaServer:
        settings = LlamaSettings(port=free_port(), parallel=parallel, ctx_size=ctx_size, telemetry=telemetry, threads=2)
        base = f"http://{settings.host}:{settings.port}"
        running = supervisor.start(llama_service_spec(name, llama_binary, demo_model, settings))
        client = httpx.Client(base_url=base, timeout=120)
        clients.append(client)
        return LlamaServer(url=base, client=client, log_path=running.log_path)

    yield start
    for client in clients:
        client.close()
    supervisor.stop()


@pytest.fixture(scope="session")
def llama(start_llama: Callable[..., LlamaServer]) -> LlamaServer:
    """Telemetry on, four slots."""
    return start_llama("llama-telemetry", telemetry=True, parallel=4)


@pytest.fixture(scope="session")
def llama_off(start_llama: Callable[..., LlamaServer]) -> LlamaServer:
    """Telemetry off (no eval callback installed)."""
    return start_llama("llama-plain", telemetry=False, parallel=4)


# The software GPU (docs/test-bed.md): llama-server's Vulkan backend on Mesa's llvmpipe.


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vulkan: needs the Vulkan build of llama-server (glslc, libvulkan-dev, ...)")


@pytest.fixture(scope="session")
def llvmpipe_probe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.llvmpipe_probe import write_probe_model

    return write_probe_model(tmp_path_factory.mktemp("llvmpipe-probe-model") / "probe.gguf")


def require_sound_llvmpipe(
    binary: Path, model: Path, logs: Path, *, probe: Callable[[Path, Path, Path], ProbeReport]
) -> ProbeReport:
    """Runs the probe; returns its report when llvmpipe is sound, else skips with the finding. The skip's
    reason starts with DEVICE_FAULT, which in CI passes only where each test's RPC twin ran and passed
    in the same run (tests/ci_policy.py): a faulting llvmpipe cannot fail main, and cannot hide what
    the Vulkan tests assert either (issue 33: CI once passed with all 28 skipped)."""
    from tests.ci_policy import DEVICE_FAULT  # here: the plugin is imported by pytest_plugins, not before

    report = probe(binary, model, logs)
    if report.fault is None:
        return report
    pytest.skip(f"{DEVICE_FAULT} (docs/test-bed.md; their RPC twins must pass): {report.line()}")


def vulkan_build_binary() -> Path:
    """The Vulkan llama-server, built once and cached (`moe-l2 build-llama --vulkan`), or
    MOE_L2_VULKAN_LLAMA_SERVER. Without the packages a developer's run skips; CI (CI set) fails, so a
    CI machine cannot skip the device path for want of a package."""
    from moe_l2_llama import build as build_mod

    if env := os.environ.get("MOE_L2_VULKAN_LLAMA_SERVER"):
        return Path(env)
    if missing := build_mod.missing_vulkan_packages():
        reason = f"the Vulkan build needs {', '.join(missing)} (apt-get install {build_mod.VULKAN_APT_PACKAGES})"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return build_mod.build(engine_test_build("vulkan"))


@pytest.fixture(scope="session")
def vulkan_build() -> Path:
    """The Vulkan build for tests that only start llama-server and read its log: they send no batch, so
    the probe's verdict on batches does not concern them and they run wherever the build does."""
    return vulkan_build_binary()


@pytest.fixture(scope="session")
def vulkan_binary(
    vulkan_build: Path,
    llvmpipe_probe_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    pytestconfig: pytest.Config,
) -> Path:
    """The Vulkan build for tests that compute on llvmpipe: probed first (tests/llvmpipe_probe.py). A machine
    whose llvmpipe cannot run the batches the Vulkan tests send skips them with the finding, covered by
    their RPC twins (tests/ci_policy.py); the probe's report is printed at the end of the run."""
    from tests.llvmpipe_probe import probe

    # pytest keeps a session fixture's skip or failure, so the probe runs once however many tests ask
    logs = tmp_path_factory.mktemp("llvmpipe-probe")
    # MOE_L2_LLVMPIPE_PROBE_SERVER: the server the probe runs instead of the build, to rehearse the skip path
    # with a stand-in that crashes as lavapipe does (docs/test-bed.md) while the other tests keep the build
    probed = Path(os.environ.get("MOE_L2_LLVMPIPE_PROBE_SERVER") or vulkan_build)
    pytestconfig.stash[PROBE_REPORT] = "pending"
    try:
        report = require_sound_llvmpipe(probed, llvmpipe_probe_model, logs, probe=probe)
    except pytest.skip.Exception as skip:
        pytestconfig.stash[PROBE_REPORT] = str(skip.msg)
        raise
    pytestconfig.stash[PROBE_REPORT] = report.line()
    return vulkan_build


PROBE_REPORT = pytest.StashKey[str]()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if (line := config.stash.get(PROBE_REPORT, None)) is not None:
        terminalreporter.write_line(f"llvmpipe probe: {line}")


# The RPC device (docs/test-bed.md, "The RPC device"): ggml's RPC backend as the device of llama-server,
# the CPU backend of a ggml-rpc-server behind it. The engine's correctness tests (the expert cache's) run
# there: the scheduler places layers, expert slots and copies on it as on a GPU, and no Mesa is involved.


@dataclass(frozen=True)
class VulkanDevice:
    """The Vulkan build on llvmpipe, as a device tests can run the same code on as on RpcDevice."""

    binary: Path
    device: str = "Vulkan0"

    def on_device(self, settings: LlamaSettings) -> LlamaSettings:
        return settings  # ggml-vulkan finds llvmpipe itself (GGML_VK_VISIBLE_DEVICES from device_env)

    def assert_holds_the_model(self, log_text: str) -> None:
        assert "llvmpipe" in log_text, "ggml-vulkan did not find the llvmpipe device"
        assert_offloaded(log_text, self.device)


def assert_offloaded(log_text: str, device: str) -> None:
    """The log (-lv 4) shows every layer placed on the device and the device holding weights: else a
    build could have run everything on the CPU without a word and a comparison would prove nothing."""
    offloaded = re.search(r"offloaded (\d+)/(\d+) layers to GPU", log_text)
    assert offloaded and int(offloaded[1]) == int(offloaded[2]) > 0, "not every layer went to the device"
    assert re.search(rf"{re.escape(device)} model buffer size = +[1-9]", log_text), f"{device} holds no weights"


@dataclass(frozen=True)
class RpcDevice:
    """A running ggml-rpc-server and the RPC build's llama-server that uses it as its device."""

    binary: Path  # llama-server built with GGML_RPC
    endpoint: str  # host:port of the ggml-rpc-server
    log_path: Path

    @property
    def device(self) -> str:
        """The device's name in llama-server's log (`RPC0[127.0.0.1:50052]`)."""
        return f"RPC0[{self.endpoint}]"

    def on_device(self, settings: LlamaSettings) -> LlamaSettings:
        """settings with `--rpc`: llama-server registers the RPC server as a device, the first GPU-like
        one, so -ngl, --cpu-moe and --moe-cache-bytes place on it as on a GPU. And `--no-repack`: the
        RPC build is a CPU build, whose CPU backend repacks quantized experts kept in host memory into
        its own layout, which the expert cache cannot copy to a device (measured: `expert cache off:
        the experts in host memory are repacked for the CPU's own kernels`)."""
        extra = f"--rpc {self.endpoint} {settings.extra_args}".strip()
        return settings.model_copy(update={"extra_args": extra, "cpu_repack": False})

    def assert_holds_the_model(self, log_text: str) -> None:
        assert_offloaded(log_text, self.device)


EngineDevice = VulkanDevice | RpcDevice


@pytest.fixture(scope="session")
def vulkan_device(vulkan_binary: Path) -> VulkanDevice:
    return VulkanDevice(vulkan_binary)


@pytest.fixture
def device(request: pytest.FixtureRequest) -> EngineDevice:
    """The device a parametrized test runs on, by the name of its session fixture."""
    return request.getfixturevalue(request.param)


# The same test on the RPC device and on llvmpipe: the RPC case is the llvmpipe case's twin, which
# tests/ci_policy.py requires to pass where a faulting llvmpipe skips the other.
ON_RPC_AND_LLVMPIPE = pytest.mark.parametrize(
    "device",
    ["rpc_device", pytest.param("vulkan_device", marks=pytest.mark.vulkan)],
    indirect=True,
    ids=["rpc", "vulkan"],
)


@pytest.fixture(scope="session")
def rpc_binary() -> Path:
    """The RPC build's llama-server (`moe-l2 build-llama --rpc`, cached; ~6 min on 2 cores cold), or
    MOE_L2_RPC_LLAMA_SERVER, with its ggml-rpc-server next to it. No skip: the build needs only what the
    CPU build needs, so a machine that cannot make it fails here, in CI or not."""
    from moe_l2_llama import build as build_mod

    if env := os.environ.get("MOE_L2_RPC_LLAMA_SERVER"):
        binary = Path(env)
        if not binary.is_file():
            pytest.fail(f"MOE_L2_RPC_LLAMA_SERVER={binary} does not exist", pytrace=False)
    else:
        binary = build_mod.build(engine_test_build("rpc"))
    if not build_mod.rpc_server_binary(binary).is_file():
        rebuild = "moe-l2 build-llama --rpc --test-hooks"
        pytest.fail(f"no {build_mod.RPC_SERVER} next to {binary}: build it with `{rebuild}`")
    return binary


def rpc_server_spec(binary: Path, port: int, threads: int = 2) -> ServiceSpec:
    """ggml-rpc-server on the CPU backend. Two threads: the two cores of the CI machines; llama-server
    waits on the device's results, so the two do not compete. No `-c`: its file cache keeps tensors
    under ~/.cache/llama.cpp/rpc to speed a reload, which the tests' small models do not need.
    Healthy once it accepts a connection: it prints its banner before it binds."""
    from moe_l2_llama.build import rpc_server_binary

    return ServiceSpec(
        name="ggml-rpc-server",
        argv=[str(rpc_server_binary(binary)), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
        health=tcp_open("127.0.0.1", port),
        url=f"127.0.0.1:{port}",
        start_timeout_s=30,
    )


@pytest.fixture(scope="session")
def rpc_device(rpc_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RpcDevice]:
    """One ggml-rpc-server for the session, stopped at its end. It serves one client at a time (its
    accept loop runs each connection to its end), so the tests that use it must run their llama-servers
    one after the other, as they do; a server's buffers are freed when its client disconnects."""
    supervisor = Supervisor(tmp_path_factory.mktemp("rpc-server"))
    try:
        running = supervisor.start(rpc_server_spec(rpc_binary, free_port()))
    except SupervisorError as exc:
        supervisor.stop()
        pytest.fail(f"ggml-rpc-server did not start: {exc}", pytrace=False)
    yield RpcDevice(binary=rpc_binary, endpoint=running.spec.url, log_path=running.log_path)
    alive = running.proc.poll() is None
    supervisor.stop()
    # a device that died mid-session failed the test that killed it; say so once more at the end
    assert alive, f"ggml-rpc-server {describe_exit(running.proc.returncode)}; log: {running.log_path}"
