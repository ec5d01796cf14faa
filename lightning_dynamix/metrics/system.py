"""System signals of one rank: CPU and memory (psutil), GPU through NVML (nvidia-ml-py).

Sampled once per decision interval, not per step. Without a GPU, or where NVML cannot be loaded,
every GPU value is NaN; nothing here raises because a machine lacks a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import psutil

NAN = float("nan")


@dataclass(frozen=True)
class SystemSample:
    """One reading. Percentages are 0-100; power in watts; temperature in degrees Celsius."""

    cpu_util: float
    mem_util: float
    gpu_util: float = NAN
    gpu_mem_util: float = NAN
    gpu_power_w: float = NAN
    gpu_temperature_c: float = NAN


class SystemMonitor:
    """Reads CPU, memory and (when there is one) GPU utilisation.

    Args:
        gpu_index: the NVML index of this rank's GPU; ``None`` for no GPU (all GPU fields NaN).
            NVML numbers GPUs by PCI bus, which matches CUDA's order when
            ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; with ``CUDA_VISIBLE_DEVICES`` set, pass the physical index.
    """

    def __init__(self, gpu_index: int | None = None) -> None:
        self.gpu_index = gpu_index
        self._handle: Any = None
        self._nvml: Any = None
        # cpu_percent(None) measures since the previous call; the first call only starts the clock
        psutil.cpu_percent(interval=None)
        if gpu_index is not None:
            self._handle = self._open_gpu(gpu_index)

    def _open_gpu(self, index: int) -> Any:
        try:
            import pynvml  # the module of nvidia-ml-py

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # no driver, no device: GPU metrics are NaN, never an error
            return None
        self._nvml = pynvml
        return handle

    @property
    def has_gpu(self) -> bool:
        """Whether NVML answered for this rank's GPU."""
        return self._handle is not None

    def sample(self) -> SystemSample:
        """The utilisation since the previous sample (CPU) and the current state (memory, GPU)."""
        cpu = psutil.cpu_percent(interval=None)
        mem = psutil.virtual_memory().percent
        if self._handle is None:
            return SystemSample(cpu_util=cpu, mem_util=mem)
        nvml, handle = self._nvml, self._handle
        return SystemSample(
            cpu_util=cpu,
            mem_util=mem,
            gpu_util=_read(lambda: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)),
            gpu_mem_util=_read(lambda: _memory_percent(nvml.nvmlDeviceGetMemoryInfo(handle))),
            gpu_power_w=_read(lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),  # milliwatts
            gpu_temperature_c=_read(lambda: float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))),
        )


def _memory_percent(info: Any) -> float:
    return 100.0 * info.used / info.total if info.total else NAN


def _read(query: Any) -> float:
    try:
        value = float(query())
    except Exception:  # a query a GPU does not support (power on some boards): NaN
        return NAN
    return value if math.isfinite(value) else NAN
