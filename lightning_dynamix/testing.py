"""Test doubles for code built on the package: a simulated GPU and a step clock that reads it.

Nothing in the package uses them at run time. :class:`FakeDevice` queues work on streams that run behind a host
that only queues it, as a GPU does; :class:`FakeEventClock` is a
:class:`~lightning_dynamix.metrics.TimeSource` that marks its current stream as a CUDA event would, so code that
times a step on the device (:class:`~lightning_dynamix.metrics.StepClock`, a controller fed by it) is tested
without a GPU::

    from lightning_dynamix.metrics import StepClock
    from lightning_dynamix.testing import FakeDevice, FakeEventClock

    device = FakeDevice()
    clock = StepClock(time_source=FakeEventClock(device), cpu_quota=None)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FakeDevice", "FakeEvent", "FakeEventClock"]


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
    """A :class:`~lightning_dynamix.metrics.TimeSource` on a :class:`FakeDevice`: marks its current stream like a CUDA
    event would."""

    device_kind = "fake"

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.waits = 0  # reads that made the host wait for the device
        self._held: dict[int, FakeEvent] = {}  # marks handed out and not released yet

    def mark(self) -> FakeEvent:
        mark = self.device.reached()
        self._held[id(mark)] = mark
        return mark

    def ready(self, mark: FakeEvent) -> bool:
        return bool(mark.time <= self.device.host)

    def elapsed(self, start: FakeEvent, end: FakeEvent) -> float:
        for mark in (start, end):
            if not self.ready(mark):
                self.waits += 1
                self.device.host = mark.time
        return float(end.time - start.time)

    def release(self, mark: FakeEvent) -> None:
        # a CUDA event pool hands a released event out again: releasing a mark twice would let two later marks
        # share one event, the second recorded over the first
        if self._held.pop(id(mark), None) is None:
            raise RuntimeError(f"FakeEventClock: {mark} released twice, or never handed out by this clock")
