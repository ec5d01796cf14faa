"""System signals of one rank: CPU and memory (psutil), GPU through NVML (nvidia-ml-py), CPU quotas.

Sampled once per decision interval, not per step. Without a GPU, or where NVML cannot be loaded,
every GPU value is NaN; nothing here raises because a machine lacks a GPU. A rank's CPU quota (its
cgroup's CFS bandwidth limit) is found once, when its step clock is made (:func:`find_cpu_quota`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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


# --------------------------------------------------------------------------------------------------
# CPU quotas (cgroup CFS bandwidth: Kubernetes' and Docker's CPU limits)
# --------------------------------------------------------------------------------------------------

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuQuota:
    """The CFS quota that limits a process: ``cores`` of CPU time per wall-clock second.

    A rank under a quota that has used it up is frozen until the next period, also while it waits
    in a collective, so over an interval it cannot step faster than its CPU time per step divided
    by ``cores``. ``usage`` is the counter that quota is charged from: the cgroup's own (cgroup v2
    ``cpu.stat``, or a v1 ``cpuacct.usage`` accounting the same group), which includes its
    DataLoader workers; ``None`` where the group is not accounted, and then the process's own CPU
    time (all its threads, no child processes) stands for it. One counter is read throughout, so
    that differences of readings are CPU time.
    """

    cores: float
    group: Path
    usage: Path | None = None

    def counter(self) -> Callable[[], float]:
        """A reader of the CPU seconds charged to the quota so far (differences are what matter).

        It keeps the group's counter open, so that a reading (twice a step, by the step clock) is one
        ``pread``, not an open and a close. A reading that fails is NaN, never the process's own CPU
        time instead: a difference of two counters is no CPU time.
        """
        if self.usage is None:
            return time.process_time
        try:
            handle = self.usage.open("rb", buffering=0)
        except OSError:
            return lambda: NAN
        v2 = self.usage.name == "cpu.stat"  # v2: "usage_usec N" among other lines; v1 cpuacct.usage: ns

        def read() -> float:
            try:
                text = os.pread(handle.fileno(), 4096, 0).decode()
            except OSError:
                return NAN
            if v2:
                fields = dict(line.split(" ", 1) for line in text.splitlines() if " " in line)
                return int(fields["usage_usec"]) * 1e-6 if "usage_usec" in fields else NAN
            return int(text) * 1e-9

        return read


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota < 0 or period <= 0 else quota / period


def find_cpu_quota(proc_cgroup: str | None = None, root: Path = CGROUP_ROOT) -> CpuQuota | None:
    """The tightest CFS quota over this process's cgroup and its ancestors; ``None`` where none is set.

    Reads ``/proc/self/cgroup`` (or ``proc_cgroup``, its text) and the hierarchy mounted under
    ``root``: cgroup v2 (``cpu.max``) where ``root`` is the unified hierarchy, else the v1 ``cpu``
    controller (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, mounted at ``root/cpu`` or
    ``root/cpu,cpuacct``). Never raises: a machine without cgroups has no quota.
    """
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    paths: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths[controller] = parts[2]
    if (root / "cgroup.controllers").exists() and "" in paths:  # the unified (v2) hierarchy
        return _tightest(root, paths[""], _v2_quota, lambda group: _existing(group / "cpu.stat"))
    if "cpu" not in paths:
        return None
    mount = next((root / name for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu") if (root / name).is_dir()), None)
    if mount is None:
        return None

    def accounted(group: Path) -> Path | None:
        # the v1 cpuacct counter accounts the same group only where the process sits at the same path there
        relative = group.relative_to(mount)
        if "cpuacct" not in paths or Path("/", paths["cpuacct"]) != Path("/", relative):
            return None
        counters = (
            _existing(root / name / relative / "cpuacct.usage") for name in ("cpu,cpuacct", "cpuacct,cpu", "cpuacct")
        )
        return next((counter for counter in counters if counter is not None), None)

    return _tightest(mount, paths["cpu"], _v1_quota, accounted)


def _existing(path: Path) -> Path | None:
    return path if path.exists() else None


def _tightest(
    mount: Path, path: str, read: Callable[[Path], float | None], usage: Callable[[Path], Path | None]
) -> CpuQuota | None:
    """Walk from ``mount/path`` up to ``mount``: the group with the smallest quota, with its usage counter."""
    group = mount / path.strip("/")
    quotas: list[tuple[float, Path]] = []
    while True:
        cores = read(group)
        if cores is not None:
            quotas.append((cores, group))
        if group == mount or mount not in group.parents:
            break
        group = group.parent
    if not quotas:
        return None
    cores, tightest = min(quotas, key=lambda quota: quota[0])  # the innermost of equal ones
    return CpuQuota(cores, tightest, usage(tightest))
