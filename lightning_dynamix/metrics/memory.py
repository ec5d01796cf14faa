"""The largest batch a rank's device memory holds, from the peak bytes its steps used.

GPU models differ in memory (16 GB beside 80 GB): a controller that gives a fast card with little
memory more samples ends the job with an out-of-memory error. :class:`DeviceMemory` reads the CUDA
caching allocator's counters at each step's end (host calls into the allocator's statistics: no
synchronisation): the memory held between steps (parameters, gradients, optimizer state: the
*base*) and the peak of the step, reset after each reading. The bytes a sample costs are the most
any step needed above the base per sample, and the largest batch is what fits in the device's
memory (its total times the process's memory fraction) less a margin:

    cap = floor((limit * (1 - margin) - base) / bytes_per_sample)

The readings come from a :class:`MemoryReader`: :class:`CudaMemoryReader` on a GPU; tests give
their own.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from lightning_dynamix._checks import require_int, require_number

NAN = float("nan")


def check_margin(name: str, value: object) -> float:
    """``value`` as a share of memory kept free, in [0, 1); a ``ValueError`` naming ``name`` otherwise."""
    margin = require_number(name, value, 0.0)
    if not margin < 1.0:
        raise ValueError(f"`{name}` must be in [0, 1): the share of the memory kept free, got {value!r}")
    return margin


class MemoryReader(Protocol):
    """The allocator's counters of one device, in bytes."""

    def allocated(self) -> int:
        """Bytes held by tensors now."""
        ...

    def peak(self) -> int:
        """The most bytes held by tensors since the last :meth:`reset_peak`."""
        ...

    def reset_peak(self) -> None:
        """Start a new peak from what is held now."""
        ...

    def limit(self) -> int:
        """Bytes this process may hold on the device (its total times the process's memory fraction)."""
        ...


class CudaMemoryReader:
    """:class:`MemoryReader` of a CUDA device, from torch's caching allocator."""

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"`device` must be an available CUDA device for CudaMemoryReader, got {str(device)!r}")
        # an index: torch's memory-fraction query refuses a bare "cuda"
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def limit(self) -> int:
        total = torch.cuda.get_device_properties(self.device).total_memory
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _device: 1.0)(self.device)
        return int(total * fraction)


class DeviceMemory:
    """Peak bytes per sample of one rank's steps, and the largest batch its device memory holds.

    Args:
        reader: the device's counters.
        margin: the share of the memory limit kept free (fragmentation, the allocator's rounding, a step
            that needs more than the ones measured), in [0, 1).
        warmup_steps: steps read before a cap is given (the first steps allocate workspaces once).

    Raises:
        ValueError: for a margin outside [0, 1) or a negative ``warmup_steps``.
    """

    def __init__(self, reader: MemoryReader, margin: float = 0.1, warmup_steps: int = 2) -> None:
        self.reader = reader
        self.margin = check_margin("margin", margin)
        self.warmup_steps = require_int("warmup_steps", warmup_steps, 0)
        self.bytes_per_sample = NAN
        """The most bytes a sample needed above the base in any step read, NaN before one."""
        self.base = 0
        """Bytes held between steps (parameters, gradients, optimizer state) at the latest reading."""
        self.steps = 0
        self._started = False

    def step_end(self, batch_size: int) -> None:
        """A step of ``batch_size`` samples ended: read its peak and start the next one's."""
        reader = self.reader
        if self._started and batch_size > 0:
            self.steps += 1
            if self.steps > self.warmup_steps:
                per_sample = max(0, reader.peak() - self.base) / batch_size
                if not per_sample <= self.bytes_per_sample:  # NaN at first
                    self.bytes_per_sample = per_sample
        self.base = reader.allocated()
        reader.reset_peak()
        self._started = True

    def cap(self) -> float:
        """The largest batch the memory holds, samples (a float for the gather); NaN before a step was read."""
        if not math.isfinite(self.bytes_per_sample) or self.bytes_per_sample <= 0:
            return NAN
        room = self.reader.limit() * (1.0 - self.margin) - self.base
        return float(max(0, math.floor(room / self.bytes_per_sample)))
