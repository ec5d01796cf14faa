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

Every time source answers the same four calls (:class:`TimeSource`); :class:`FakeDevice` with
:class:`FakeEventClock` queues work on a simulated device behind a host that runs ahead, so the
device-side arithmetic is tested without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
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
        # recorded over the first: FakeEventClock refuses it in the tests)
        if len(self._free) < 256:
            self._free.append(mark)


def time_source_for(device: torch.device | str) -> TimeSource:
    """The time source for a rank training on ``device``: CUDA events on a GPU, the host's clock elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaEventClock(device)
    return HostClock()


# --------------------------------------------------------------------------------------------- tests' device


@dataclass(frozen=True)
class FakeEvent:
    """A mark of :class:`FakeEventClock`: the device time at which its stream reaches it."""

    time: float


class FakeDevice:
    """A device with streams that run queued work in order, behind a host that only queues it.

    The host's time moves with :meth:`host_work` (Python, kernel launches) and when it waits for the device
    (:meth:`synchronize`, reading a mark not yet reached). Work queued with :meth:`launch` starts when its
    stream is free and the host has queued it; :meth:`wait_for` makes a stream wait for a mark on another (a
    collective's stream, a peer that is late). Times in seconds.
    """

    def __init__(self) -> None:
        self.host = 0.0
        self.streams: dict[str, float] = {"compute": 0.0}
        self.current = "compute"

    def host_work(self, seconds: float) -> None:
        """The host spends ``seconds`` (queueing kernels, running Python)."""
        self.host += seconds

    def launch(self, seconds: float, stream: str | None = None) -> None:
        """Queue ``seconds`` of device work on ``stream`` (the current one by default)."""
        name = stream or self.current
        self.streams[name] = max(self.streams.get(name, 0.0), self.host) + seconds

    def wait_for(self, mark: FakeEvent, stream: str | None = None) -> None:
        """``stream`` (the current one by default) goes on only once ``mark`` is reached."""
        name = stream or self.current
        self.streams[name] = max(self.streams.get(name, 0.0), mark.time)

    def reached(self, stream: str | None = None) -> FakeEvent:
        """Where ``stream`` will be once everything queued on it so far has run."""
        return FakeEvent(max(self.streams.get(stream or self.current, 0.0), self.host))

    def synchronize(self) -> None:
        """The host waits until every stream has run everything queued."""
        self.host = max(self.host, *self.streams.values())


class FakeEventClock:
    """A :class:`TimeSource` on a :class:`FakeDevice`: marks its current stream like a CUDA event would."""

    device_kind = "fake"

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.waits = 0  # reads that made the host wait for the device
        self._held: dict[int, FakeEvent] = {}  # marks handed out and not released yet

    def mark(self) -> FakeEvent:
        mark = self.device.reached()
        self._held[id(mark)] = mark
        return mark

    def ready(self, mark: Mark) -> bool:
        return bool(mark.time <= self.device.host)

    def elapsed(self, start: Mark, end: Mark) -> float:
        for mark in (start, end):
            if not self.ready(mark):
                self.waits += 1
                self.device.host = mark.time
        return float(end.time - start.time)

    def release(self, mark: Mark) -> None:
        # a CUDA event pool hands a released event out again: releasing a mark twice would let two later marks
        # share one event, the second recorded over the first
        if self._held.pop(id(mark), None) is None:
            raise RuntimeError(f"FakeEventClock: {mark} released twice, or never handed out by this clock")
