"""Which llama-server build serves on this machine, and why: the one answer `moe-l2 up` acts on and
`moe-l2 doctor` reports.

The GPU is found through the tools its driver installs, never a library that may be absent:

- `nvidia-smi` listing a GPU: the CUDA build, compiled for the compute capabilities it reports
  (sm_90 for an H100; every image architecture when the driver is too old to say);
- else `vulkaninfo` listing a discrete or integrated GPU: the Vulkan build. A software device
  (Mesa's llvmpipe, of type CPU) is not a GPU: ggml-vulkan skips it too unless told otherwise, and
  the CPU build runs the same code without the detour;
- else the CPU build, the reason being what each probe found.

With `auto` (MOE_L2_LLAMA_BACKEND's default) a GPU whose build is neither cached nor buildable here
(no nvcc, no glslc) falls back to the next candidate and finally the CPU build, and the reason says
so; a backend named explicitly is built or fails with the toolchain's own message. Every choice
compiles ggml's CPU code for this CPU (BuildConfig.native): with --cpu-moe it computes the experts.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from moe_l2_llama.build_cache import built_binary
from moe_l2_llama.build_config import CUDA_ARCHITECTURES, BuildConfig, BuildError
from moe_l2_llama.cmake_build import check_toolchain

BACKEND_ENV = "MOE_L2_LLAMA_BACKEND"
Requested = Literal["auto", "cpu", "cuda", "vulkan"]
PROBE_TIMEOUT_S = 20.0
# ggml-vulkan's own choice when GGML_VK_VISIBLE_DEVICES is unset (ggml_vk_instance_init)
VULKAN_GPU_TYPES = ("DISCRETE_GPU", "INTEGRATED_GPU")


@dataclass(frozen=True)
class NvidiaGpu:
    name: str
    compute_cap: str  # "9.0"; "" when nvidia-smi does not report it


@dataclass(frozen=True)
class VulkanDevice:
    index: int  # vulkaninfo's GPU<n>, the loader's order (GGML_VK_VISIBLE_DEVICES counts the same way)
    name: str
    device_type: str  # DISCRETE_GPU, INTEGRATED_GPU, VIRTUAL_GPU, CPU, OTHER

    @property
    def is_gpu(self) -> bool:
        return self.device_type in VULKAN_GPU_TYPES


@dataclass(frozen=True)
class GpuDetection:
    """What the probes found; each note says why its probe found no GPU ("" when it found one)."""

    nvidia: tuple[NvidiaGpu, ...] = ()
    nvidia_note: str = ""
    vulkan: tuple[VulkanDevice, ...] = ()
    vulkan_note: str = ""

    @property
    def vulkan_gpus(self) -> tuple[VulkanDevice, ...]:
        return tuple(d for d in self.vulkan if d.is_gpu)

    def no_gpu_reason(self) -> str:
        return f"no GPU: {self.nvidia_note}, {self.vulkan_note}"


def _run(tool: str, *args: str) -> tuple[str | None, str]:
    """(stdout, "") of a tool found on PATH, or (None, why not) in a few words."""
    path = shutil.which(tool)
    if path is None:
        return None, f"{tool} not found"
    try:
        result = subprocess.run([path, *args], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"{tool} did not answer in {PROBE_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return None, f"{tool} did not run: {exc.strerror or exc}"
    if result.returncode != 0:
        said = (result.stderr.strip() or result.stdout.strip()).splitlines()
        return None, f"{tool} failed (exit {result.returncode}){': ' + said[0][:120] if said else ''}"
    return result.stdout, ""


def probe_nvidia() -> tuple[tuple[NvidiaGpu, ...], str]:
    """The NVIDIA GPUs nvidia-smi lists, or () and why none."""
    out, problem = _run("nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader")
    if out is None and "nvidia-smi not found" not in problem:
        # drivers before compute_cap was a query field (R510) refuse the query: the names alone
        names, _ = _run("nvidia-smi", "--query-gpu=name", "--format=csv,noheader")
        if names is not None:
            out = "\n".join(f"{line}, " for line in names.splitlines())
    if out is None:
        return (), problem
    gpus = []
    for line in out.splitlines():
        if not line.strip():
            continue
        name, _, cap = line.rpartition(",")
        cap = cap.strip()
        gpus.append(NvidiaGpu(name.strip(), cap if re.fullmatch(r"\d+\.\d+", cap) else ""))
    return tuple(gpus), "" if gpus else "nvidia-smi lists no GPU"


_VK_DEVICE_RE = re.compile(r"^GPU(\d+):\s*$")
_VK_FIELD_RE = re.compile(r"^\s+(deviceType|deviceName)\s*=\s*(.+?)\s*$")


def parse_vulkaninfo(summary: str) -> tuple[VulkanDevice, ...]:
    """The devices of `vulkaninfo --summary` ("Devices:" then one GPU<n>: block per device)."""
    devices: list[VulkanDevice] = []
    index, fields = None, {}

    def close() -> None:
        if index is not None:
            kind = fields.get("deviceType", "").removeprefix("PHYSICAL_DEVICE_TYPE_") or "OTHER"
            devices.append(VulkanDevice(index, fields.get("deviceName", "?"), kind))

    for line in summary.splitlines():
        if m := _VK_DEVICE_RE.match(line):
            close()
            index, fields = int(m.group(1)), {}
        elif index is not None and (m := _VK_FIELD_RE.match(line)):
            fields[m.group(1)] = m.group(2)
    close()
    return tuple(devices)


def probe_vulkan() -> tuple[tuple[VulkanDevice, ...], str]:
    """Every Vulkan device vulkaninfo lists, and why none is a GPU ("" when one is)."""
    out, problem = _run("vulkaninfo", "--summary")
    if out is None:
        return (), f"no Vulkan GPU ({problem})"
    devices = parse_vulkaninfo(out)
    if any(d.is_gpu for d in devices):
        return devices, ""
    if not devices:
        return devices, "no Vulkan GPU (vulkaninfo lists no device)"
    others = ", ".join(f"{d.name}, type {d.device_type}" for d in devices)
    return devices, f"no Vulkan GPU (only {others})"


def detect_gpus() -> GpuDetection:
    nvidia, nvidia_note = probe_nvidia()
    vulkan, vulkan_note = probe_vulkan()
    return GpuDetection(nvidia, nvidia_note, vulkan, vulkan_note)


def cuda_architectures(gpus: tuple[NvidiaGpu, ...]) -> str | None:
    """CMake's architectures for these GPUs ("90", "86;90"), None when one's capability is unknown.
    The same numbers `build-llama --cuda --arch native` resolves to, so both build the same key."""
    if not gpus or any(not g.compute_cap for g in gpus):
        return None
    return ";".join(sorted({g.compute_cap.replace(".", "") for g in gpus}, key=int))


@dataclass(frozen=True)
class BackendChoice:
    backend: str  # cpu, cuda, vulkan
    config: BuildConfig
    reason: str  # what was found, or why not a GPU build

    @property
    def label(self) -> str:
        if self.backend == "cuda":
            archs = self.config.cuda_architectures.split(";")
            if self.config.cuda_architectures == CUDA_ARCHITECTURES:
                return f"CUDA build for the image's architectures ({self.config.cuda_architectures})"
            return "CUDA build for " + "+".join(f"sm_{a}" for a in archs)
        return {"vulkan": "Vulkan build", "cpu": "CPU build"}.get(self.backend, f"{self.backend} build")

    @property
    def summary(self) -> str:
        """What serves and why: the words `moe-l2 up` logs and `moe-l2 doctor` prints."""
        return f"{self.label} ({self.reason})"

    @property
    def line(self) -> str:
        return f"llama-server: {self.summary}"

    def build_command(self) -> str:
        """The `moe-l2 build-llama` call that builds the same binary ahead of time."""
        if self.backend == "cuda":
            return f"moe-l2 build-llama --cuda --arch '{self.config.cuda_architectures}'"
        return "moe-l2 build-llama" + (f" --{self.backend}" if self.backend != "cpu" else "")


def toolchain_problem(config: BuildConfig) -> str | None:
    """Why the build of config cannot be had here (None: it is cached, or this machine can build it)."""
    if built_binary(config) is not None:
        return None
    try:
        check_toolchain(config)
    except BuildError as exc:
        return str(exc)
    return None


def _nvidia_choice(detection: GpuDetection) -> BackendChoice:
    gpus = detection.nvidia
    archs = cuda_architectures(gpus)
    names = "; ".join(f"{g.name}, compute capability {g.compute_cap or '?'}" for g in gpus)
    reason = f"nvidia-smi: {names}"
    if archs is None:
        reason += "; nvidia-smi does not report the compute capability"
    return BackendChoice("cuda", BuildConfig(backend="cuda", cuda_architectures=archs or CUDA_ARCHITECTURES), reason)


def _vulkan_choice(detection: GpuDetection) -> BackendChoice:
    gpus = "; ".join(f"GPU{d.index} {d.name}" for d in detection.vulkan_gpus)
    return BackendChoice("vulkan", BuildConfig(backend="vulkan"), f"vulkaninfo: {gpus}")


def _forced(requested: str, detection: GpuDetection) -> BackendChoice:
    """A backend named explicitly: built whatever was detected (a missing toolchain is the build's error)."""
    why = f"{BACKEND_ENV}={requested}"
    if requested == "cuda":
        if detection.nvidia:
            found = _nvidia_choice(detection)
            return BackendChoice("cuda", found.config, f"{why}; {found.reason}")
        return BackendChoice("cuda", BuildConfig(backend="cuda"), f"{why}; {detection.nvidia_note}")
    if requested == "vulkan":
        seen = _vulkan_choice(detection).reason if detection.vulkan_gpus else detection.vulkan_note
        return BackendChoice("vulkan", BuildConfig(backend="vulkan"), f"{why}; {seen}")
    return BackendChoice("cpu", BuildConfig(), why)


def choose_backend(
    requested: str = "auto",
    detection: GpuDetection | None = None,
    problem: Callable[[BuildConfig], str | None] = toolchain_problem,
) -> BackendChoice:
    """The build to serve with. `problem` says why a GPU build cannot be had here (tests replace it)."""
    if requested not in ("auto", "cpu", "cuda", "vulkan"):
        raise BuildError(f"{BACKEND_ENV}={requested!r}: use auto, cpu, cuda or vulkan")
    if requested == "cpu":
        return _forced("cpu", GpuDetection())  # nothing to detect
    detection = detection if detection is not None else detect_gpus()
    if requested != "auto":
        return _forced(requested, detection)
    candidates = []
    if detection.nvidia:
        candidates.append(_nvidia_choice(detection))
    if detection.vulkan_gpus:
        candidates.append(_vulkan_choice(detection))
    if not candidates:
        return BackendChoice("cpu", BuildConfig(), detection.no_gpu_reason())
    refused = []
    for candidate in candidates:
        why_not = problem(candidate.config)
        if why_not is None:
            return candidate
        refused.append(f"{candidate.reason}, but {why_not}")
    return BackendChoice("cpu", BuildConfig(), "; ".join(refused))
