"""Where a rank's timestamps come from: the host's clock, or the device's stream.

On a CPU rank the work happens where the Python code runs, so ``time.perf_counter`` at an event is
the event's time. On a GPU the CPU only queues kernels: it reaches the end of forward, the gradient
bucket hook and the end of the step long before the device has done the work, and with NCCL the end
of backward does not wait on the CPU either, so host timestamps measure launches. A
:class:`CudaEventClock` marks an event with a CUDA event recorded on the current stream instead: it
completes when the device reaches that point of the stream, and two completed events give the
device time between them. Reading an event that has not completed would block the CPU until the
device reaches it, so :class:`~lightning_dynamix.metrics.StepClock` reads a step's marks only once
they are :meth:`TimeSource.ready` (at a later step) or at an interval's end.

Every time source answers the same four calls (:class:`TimeSource`); :mod:`lightning_dynamix.testing` has one on
a simulated device, for tests without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

Mark = Any
"""A timestamp from a :class:`TimeSource`: a float (seconds) for the host's clock, an event for a device's."""


@runtime_checkable
class TimeSource(Protocol):
    """Timestamps of one rank's events, on the host or on the device the rank trains on."""

    device_kind: str
    """``"cpu"`` for the host's clock, ``"cuda"`` for a GPU's stream, ``"fake"`` in tests."""

    def mark(self) -> Mark:
        """A timestamp of this point: now on the host, or where the current stream has got to on a device."""
        ...

    def ready(self, mark: Mark) -> bool:
        """Whether ``mark``'s time is known without waiting (always on the host; once the device passed it)."""
        ...

    def elapsed(self, start: Mark, end: Mark) -> float:
        """Seconds from ``start`` to ``end`` (negative where ``end`` came first); waits for marks not ready."""
        ...

    def release(self, mark: Mark) -> None:
        """``mark`` was read and will not be used again (a device clock reuses its event)."""
        ...


class WaitTimer(Protocol):
    """Told of every wait for other ranks inside a step, in marks of the rank's time source: a
    :class:`~lightning_dynamix.metrics.StepClock` is one, so a layer's collective or a remote lookup's wait
    counts as waiting, not as the rank's compute."""

    def now(self) -> Mark:
        """A timestamp of this point."""
        ...

    def collective(self, started: Mark, ended: Mark) -> None:
        """A wait for other ranks ran from ``started`` to ``ended`` (marks of :meth:`now`)."""
        ...


class HostClock:
    """Host timestamps: ``timer()`` (``time.perf_counter`` by default) at each event; always ready."""

    device_kind = "cpu"

    def __init__(self, timer: Callable[[], float] = time.perf_counter) -> None:
        self._timer = timer

    def mark(self) -> float:
        return self._timer()

    def ready(self, mark: Mark) -> bool:
        return True

    def elapsed(self, start: Mark, end: Mark) -> float:
        return float(end) - float(start)

    def release(self, mark: Mark) -> None:
        pass


class CudaEventClock:
    """Device timestamps: a timing CUDA event recorded on the current stream of ``device`` at each event.

    Recording an event is one call into the CUDA driver on the host and a marker on the stream; events are
    reused once read.
    Times are read between events of the same step (``elapsed``), never against an origin hours back: a CUDA
    event's elapsed time is a float32 of milliseconds, which would lose the sub-millisecond resolution.

    Args:
        device: the CUDA device the rank trains on.

    Raises:
        ValueError: ``device`` is not a CUDA device, or CUDA is not available.
    """

    device_kind = "cuda"

    def __init__(self, device: torch.device | str | int) -> None:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"`device` must be a CUDA device for CudaEventClock, got {str(device)!r}")
        if not torch.cuda.is_available():
            raise ValueError(f"`device` {str(device)!r}: CUDA is not available on this machine")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self._free: list[torch.cuda.Event] = []

    def mark(self) -> torch.cuda.Event:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def ready(self, mark: Mark) -> bool:
        return bool(mark.query())

    def elapsed(self, start: Mark, end: Mark) -> float:
        start.synchronize()  # returns at once where the device passed it
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    def release(self, mark: Mark) -> None:
        # the step clock gives each mark back once (a mark given twice would go to two later marks, the second
        # recorded over the first: lightning_dynamix.testing.FakeEventClock refuses it)
        if len(self._free) < 256:
            self._free.append(mark)


def time_source_for(device: torch.device | str) -> TimeSource:
    """The time source for a rank training on ``device``: CUDA events on a GPU, the host's clock elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaEventClock(device)
    return HostClock()
