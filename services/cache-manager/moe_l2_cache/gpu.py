"""GPU memory and utilisation through NVML (nvidia-ml-py), for `moe-l2 doctor` and the cache-manager's /metrics.

Everything here answers None when NVML is unavailable (no package, no driver, no GPU): the callers
show "no GPU" or leave the gauges out, and nothing is logged on every scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# The names the cache-manager exports through GpuCollector; the dashboard's GPU-only panels use them.
MEMORY_USED = "moe_l2_gpu_memory_used_bytes"
MEMORY_TOTAL = "moe_l2_gpu_memory_total_bytes"
UTILIZATION = "moe_l2_gpu_utilization_ratio"
METRIC_NAMES = (MEMORY_USED, MEMORY_TOTAL, UTILIZATION)


@dataclass(frozen=True)
class GpuStats:
    index: int
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_ratio: float | None  # None: the device does not report it (e.g. a MIG slice)


@dataclass(frozen=True)
class NvmlReport:
    driver_version: str
    cuda_version: str | None  # the highest CUDA version the driver supports, e.g. "12.4"
    gpus: list[GpuStats]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _device_stats(nvml: Any, index: int) -> GpuStats:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        utilization: float | None = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
    except nvml.NVMLError:
        utilization = None
    return GpuStats(index, _text(nvml.nvmlDeviceGetName(handle)), int(memory.used), int(memory.total), utilization)


def nvml_report() -> NvmlReport | None:
    """Driver, CUDA version and every GPU; None when NVML cannot be used here."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.debug("NVML unavailable: %s", exc)
        return None
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        try:
            cuda_raw = int(pynvml.nvmlSystemGetCudaDriverVersion())
            cuda: str | None = f"{cuda_raw // 1000}.{cuda_raw % 1000 // 10}"
        except pynvml.NVMLError:
            cuda = None
        gpus = [_device_stats(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
        return NvmlReport(driver, cuda, gpus)
    except pynvml.NVMLError as exc:
        log.debug("NVML query failed: %s", exc)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def gpu_stats() -> list[GpuStats] | None:
    """Per-GPU memory used/total and utilisation; None without NVML."""
    report = nvml_report()
    return None if report is None else report.gpus


class GpuCollector(Collector):
    """Prometheus gauges per GPU (label `gpu`, the NVML index); no families at all without NVML.

    After NVML fails once it is not tried again, so a machine without a GPU pays nothing per scrape.
    """

    def __init__(self, read: Callable[[], list[GpuStats] | None] = gpu_stats) -> None:
        self._read = read
        self._available = True

    def collect(self) -> Iterator[Metric]:
        if not self._available:
            return
        stats = self._read()
        if stats is None:
            self._available = False
            return
        used = GaugeMetricFamily(MEMORY_USED, "GPU memory in use (NVML)", labels=["gpu"])
        total = GaugeMetricFamily(MEMORY_TOTAL, "GPU memory installed (NVML)", labels=["gpu"])
        util = GaugeMetricFamily(UTILIZATION, "GPU busy fraction over NVML's last sample period", labels=["gpu"])
        for gpu in stats:
            used.add_metric([str(gpu.index)], gpu.memory_used_bytes)
            total.add_metric([str(gpu.index)], gpu.memory_total_bytes)
            if gpu.utilization_ratio is not None:
                util.add_metric([str(gpu.index)], gpu.utilization_ratio)
        yield used
        yield total
        yield util
