"""One rank's step timeline, recorded at batch boundaries and gradient buckets.

:class:`StepClock` receives timestamps from the places that see them first: the DataLoader
(when a batch is asked for and handed over), the weighted all-reduce hook (when each gradient
bucket is ready and when its all-reduce completes), the strategy's backward (when it returns,
after DDP has waited for every all-reduce) and the end of the batch. From them it derives, per
step, in seconds:

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/metrics/timers.py``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from lightning_dynamix.metrics.arrivals import Span
from lightning_dynamix.metrics.clocks import HostClock, Mark, TimeSource
from lightning_dynamix.metrics.system import CpuQuota, find_cpu_quota

NAN = float("nan")


@dataclass(frozen=True)
class StepRecord:
    """One finished step of one rank; times in seconds."""

    batch_size: int
    data_time: float
    compute_time: float
    sync_wait: float
    step_time: float
    comm_time: float
    comm_bytes: int
    synchronised: bool
    regular: bool = True
    cpu_time: float = NAN
    slowdown: float = 0.0
    """Seconds of emulated slowdown (:meth:`StepClock.slowed`) inside ``compute_time``."""
    work: float = NAN
    """The step's work, what its time grows with (a language model's token positions); NaN where not counted."""
    padding: float = NAN
    """How much of ``work`` was padding (token positions); NaN where not known."""
    collectives: tuple[Span, ...] = ()
    """The collectives counted as waiting in ``sync_wait`` (those before the gradients were ready), each
    ``(arrival, release)`` on the host's clock; empty on a device clock, whose marks are not times of day."""


@dataclass(frozen=True)
class IntervalSummary:
    """Means over the steps of an interval at one batch size; times in seconds per step.

    ``comm_time``, ``comm_bytes``, ``bandwidth`` and ``least_sync_wait`` (the least, not the mean) are
    over synchronising steps only; everything is NaN when no step was recorded. ``cpu_quota`` is the
    rank's CPU quota in cores, NaN without one.
    """

    batch_size: int
    steps: int
    data_time: float
    compute_time: float
    sync_wait: float
    step_time: float
    samples_per_s: float
    comm_time: float
    comm_bytes: float
    bandwidth: float
    cpu_time: float = NAN
    cpu_quota: float = NAN
    least_sync_wait: float = NAN
    work: float = NAN
    """Mean work per step (token positions, padding included); NaN unless every step's was counted."""
    padding: float = NAN
    """The fraction of ``work`` that was padding, in [0, 1]; NaN unless every step's was known."""
    collectives: tuple[tuple[Span, ...], ...] = ()
    """Every regular step's :attr:`StepRecord.collectives` since the interval began (at every size, oldest first:
    the same steps on every rank), for :mod:`~lightning_dynamix.metrics.arrivals`."""


def _union_length(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of ``[start, end]`` spans (all-reduces overlap and queue)."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def _overlap(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Total length of the (disjoint) ``spans`` inside ``[start, end]``."""
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in spans)


@dataclass
class _PendingStep:
    """A closed step whose marks may not be readable yet (device marks the device has not reached)."""

    generation: int
    batch_size: int
    regular: bool
    synchronised: bool
    comm_bytes: int
    cpu_time: float
    slowdown: float
    work: float
    padding: float
    marks: dict[str, Mark]
    comm_spans: list[tuple[Mark, Mark]]
    collectives: list[tuple[Mark, Mark]]

    def all_marks(self) -> list[Mark]:
        """Every mark of the step, each once: the last bucket's ready mark also starts its all-reduce's span, and a
        time source that reuses its marks (CUDA events) must get each back once, or two later marks would share
        one event, the second recorded over the first."""
        spans = [m for span in (*self.comm_spans, *self.collectives) for m in span]
        unique = {id(m): m for m in (*(m for m in self.marks.values() if m is not None), *spans)}
        return list(unique.values())


_MAX_INTERVAL_STEPS = 4096  # steps whose collectives an interval keeps for the arrivals' comparison
_MAX_PENDING = 64  # steps waiting for the device before one is read by waiting (never reached in practice)


class StepClock:
    """Timestamps of one rank's training steps; see the module docstring for what is derived.

    Every timestamp comes from one :class:`~lightning_dynamix.metrics.clocks.TimeSource`: the host's clock on
    a CPU rank, CUDA events on the rank's stream on a GPU (:func:`~lightning_dynamix.metrics.clocks.time_source_for`).
    A step's marks are read when it closes where they are ready (always, on the host); device marks the device
    has not reached yet are read at a later step's end once it has, or at :meth:`summary` (one wait an
    interval): never a synchronisation per step. :attr:`last_step` is then the latest step read.

    Args:
        timer: the host clock read at every event, in seconds (monotonic); only without ``time_source``.
        cpu_quota: the CPU quota this process runs under, ``None`` for none, or ``"find"`` (default)
            to read it from the process's cgroup (:func:`~lightning_dynamix.metrics.system.find_cpu_quota`).
        time_source: where timestamps come from; default the host's clock (``timer``).
    """

    def __init__(
        self,
        timer: Callable[[], float] | None = None,
        cpu_quota: CpuQuota | Literal["find"] | None = "find",
        time_source: TimeSource | None = None,
    ) -> None:
        if timer is not None and time_source is not None:
            raise ValueError("give StepClock either `timer` (a host clock) or `time_source`, not both")
        if time_source is not None and not isinstance(time_source, TimeSource):
            raise ValueError(
                f"`time_source` must be a TimeSource (HostClock, CudaEventClock, FakeEventClock), got {time_source!r}"
            )
        self.time_source: TimeSource = time_source if time_source is not None else HostClock(timer or time.perf_counter)
        self.cpu_quota = find_cpu_quota() if cpu_quota == "find" else cpu_quota
        self._cpu = self.cpu_quota.counter() if self.cpu_quota is not None else time.process_time
        self._lock = threading.Lock()  # all-reduce completions arrive on the backend's thread
        self.last_step: StepRecord | None = None
        self.last_batch_size: int | None = None
        """The batch size of the latest step closed (known at once, where :attr:`last_step` may lag on a device)."""
        self._pending: deque[_PendingStep] = deque()
        self._generation = 0
        self._reset_step()
        self._reset_interval(0)

    # ------------------------------------------------------------------ events
    def now(self) -> Mark:
        """A timestamp of this point from the clock's time source (for :meth:`collective`)."""
        return self.time_source.mark()

    def data_start(self) -> None:
        """The training loop asks the DataLoader for the next batch."""
        self._reset_step()
        self._data_start = self.time_source.mark()
        self._cpu_start = self._cpu()

    def data_end(
        self, batch_size: int, regular: bool = True, work: int | None = None, padding: int | None = None
    ) -> None:
        """The DataLoader handed over a batch of ``batch_size`` samples for this rank.

        ``work`` is what the step's time grows with where samples differ in size (a language model's token
        positions, padding included), ``padding`` how much of it is padding; ``None`` where not counted.

        ``regular=False`` marks a step whose sizes are not the ones in force (an epoch's final step,
        which takes what is left): it is timed (:attr:`last_step`) but left out of the interval, so a
        short tail neither restarts the interval nor stands for the sizes the controller set.
        """
        self._data_end = self.time_source.mark()
        if self._cpu_start is None:
            self._cpu_start = self._cpu()
        self._batch_size = batch_size
        self._regular = regular
        self._work = NAN if work is None else float(work)
        self._padding = NAN if padding is None else float(padding)

    def bucket_ready(self, num_bytes: int) -> Mark:
        """A gradient bucket of ``num_bytes`` is ready and its all-reduce starts; returns the mark."""
        now = self.time_source.mark()
        with self._lock:
            self._last_bucket_ready = now
            self._comm_bytes += num_bytes
        return now

    def bucket_done(self, started: Mark) -> None:
        """The all-reduce that started at ``started`` completed (may run on another thread).

        On a GPU, call it where the collective's work is known done on the device: in the all-reduce future's
        ``then`` callback, whose current stream waits for the collective.
        """
        now = self.time_source.mark()
        with self._lock:
            self._comm_spans.append((started, now))

    def collective(self, started: Mark, ended: Mark) -> None:
        """A blocking collective inside the step ran from ``started`` to ``ended`` (marks of :meth:`now`).

        The part before the last gradient bucket is ready is waiting for the other ranks, not this
        rank's compute: it moves from ``compute_time`` to ``sync_wait``.
        """
        self._collectives.append((started, ended))

    def irregular(self) -> None:
        """This step's times do not stand for its sizes (it was trained twice, or without the usual all-reduce):
        timed (:attr:`last_step`) but left out of the interval."""
        self._regular = False

    def slowed(self, seconds: float) -> None:
        """An emulated slowdown of ``seconds`` was put inside this step's compute (a sleep, a spin kernel)."""
        self._slowdown += seconds

    @property
    def step_collective_time(self) -> float:
        """Seconds this step has spent in blocking collectives so far (a device clock waits for their marks)."""
        return sum(self.time_source.elapsed(start, end) for start, end in self._collectives)

    def backward_end(self) -> None:
        """A backward pass returned (after DDP waited for its all-reduces, if it synchronised)."""
        self._backward_end = self.time_source.mark()

    def step_end(self) -> StepRecord | None:
        """The step is over (optimizer step done). Safe to call more than once per step.

        Returns:
            The finished step where its marks can be read without waiting (always on the host's clock);
            ``None`` if this step was already closed or never started, or its device marks are not reached
            yet (it is read later: :attr:`last_step`, :meth:`summary`).
        """
        if self._data_end is None or self._closed:
            return None
        now = self.time_source.mark()
        self._closed = True
        with self._lock:
            spans = list(self._comm_spans)
            last_ready = self._last_bucket_ready
            comm_bytes = self._comm_bytes
        pending = _PendingStep(
            generation=self._generation,
            batch_size=self._batch_size,
            regular=self._regular,
            synchronised=last_ready is not None,
            comm_bytes=comm_bytes,
            cpu_time=self._cpu() - self._cpu_start if self._cpu_start is not None else NAN,
            slowdown=self._slowdown,
            work=self._work,
            padding=self._padding,
            marks={
                "data_start": self._data_start,
                "data_end": self._data_end,
                "ready": last_ready,
                "backward_end": self._backward_end,
                "end": now,
            },
            comm_spans=spans,
            collectives=list(self._collectives),
        )
        self.last_batch_size = self._batch_size
        self._pending.append(pending)
        self._read(wait=len(self._pending) > _MAX_PENDING)
        if self._pending:
            return None
        return self.last_step

    # ------------------------------------------------------------------ intervals
    def summary(self) -> IntervalSummary:
        """Means over the interval's steps (at the latest batch size); does not reset.

        Reads every closed step, waiting for the device where its marks are not reached yet.
        """
        self._read(wait=True)
        n = self._steps
        quota = self.cpu_quota.cores if self.cpu_quota is not None else NAN
        if n == 0:
            return IntervalSummary(self._interval_size, 0, *[NAN] * 8, cpu_quota=quota)
        synced = self._synced_steps
        work, padding = self._sums["work"], self._sums["padding"]
        return IntervalSummary(
            batch_size=self._interval_size,
            steps=n,
            data_time=self._sums["data_time"] / n,
            compute_time=self._sums["compute_time"] / n,
            sync_wait=self._sums["sync_wait"] / n,
            step_time=self._sums["step_time"] / n,
            samples_per_s=self._interval_size * n / self._sums["step_time"] if self._sums["step_time"] > 0 else NAN,
            comm_time=self._sums["comm_time"] / synced if synced else NAN,
            comm_bytes=self._sums["comm_bytes"] / synced if synced else NAN,
            bandwidth=self._sums["comm_bytes"] / self._sums["comm_time"] if self._sums["comm_time"] > 0 else NAN,
            cpu_time=self._sums["cpu_time"] / n,
            cpu_quota=quota,
            least_sync_wait=self._least_sync_wait,
            work=work / n,
            padding=padding / work if work > 0 else NAN,
            collectives=tuple(self._interval_collectives),
        )

    def reset_interval(self) -> None:
        """Start a new interval (after a decision was gathered); steps closed before it stay out of it."""
        self._generation += 1
        self._reset_interval(self._interval_size)

    # ------------------------------------------------------------------ internals
    def _read(self, wait: bool) -> None:
        """Turn closed steps into records, oldest first, while their marks are ready (all of them if ``wait``)."""
        source = self.time_source
        on_host = isinstance(source, HostClock)  # always ready, nothing to give back
        while self._pending:
            pending = self._pending[0]
            marks = () if on_host else pending.all_marks()
            if not wait and not all(source.ready(m) for m in marks):
                return
            self._pending.popleft()
            record = self._record(pending)
            for mark in marks:
                source.release(mark)
            self.last_step = record
            if record.regular and pending.generation == self._generation:
                self._add(record)

    def _record(self, pending: _PendingStep) -> StepRecord:
        """A closed step's times, each mark read as seconds after the step's first."""
        source = self.time_source
        marks = pending.marks
        origin = marks["data_start"] if marks["data_start"] is not None else marks["data_end"]

        def at(mark: Mark) -> float:
            return source.elapsed(origin, mark)

        data_start, data_end, end = at(origin), at(marks["data_end"]), at(marks["end"])
        work_end = at(marks["backward_end"]) if marks["backward_end"] is not None else end
        ready = at(marks["ready"]) if pending.synchronised else work_end
        collectives = [(at(s), at(e)) for s, e in pending.collectives]
        spans = [(at(s), at(e)) for s, e in pending.comm_spans]
        waited = _overlap(collectives, data_end, ready)  # waiting for others before the gradients
        # on the host's clock a mark is a time: the same line on every rank of a machine (arrivals compared)
        host_origin = origin if isinstance(source, HostClock) else None
        inside = tuple(
            (host_origin + max(s, data_end), host_origin + min(e, ready))
            for s, e in collectives
            # those inside, a zero-length one too (the last to arrive), or reaching into it
            if host_origin is not None and (data_end <= s <= e <= ready or min(e, ready) > max(s, data_end))
        )
        return StepRecord(
            batch_size=pending.batch_size,
            data_time=data_end - data_start,
            compute_time=max(0.0, ready - data_end - waited),
            sync_wait=max(0.0, work_end - ready) + waited,
            step_time=end - data_start,
            comm_time=_union_length(spans),
            comm_bytes=pending.comm_bytes,
            synchronised=pending.synchronised,
            regular=pending.regular,
            cpu_time=pending.cpu_time,
            slowdown=pending.slowdown,
            work=pending.work,
            padding=pending.padding,
            collectives=inside,
        )

    def _reset_step(self) -> None:
        self._data_start: Mark | None = None
        self._data_end: Mark | None = None
        self._cpu_start: float | None = None
        self._batch_size = 0
        self._regular = True
        self._backward_end: Mark | None = None
        self._collectives: list[tuple[Mark, Mark]] = []
        self._slowdown = 0.0
        self._work = NAN
        self._padding = NAN
        self._closed = False
        with self._lock:
            self._last_bucket_ready: Mark | None = None
            self._comm_bytes = 0
            self._comm_spans: list[tuple[Mark, Mark]] = []

    def _reset_interval(self, batch_size: int, new_interval: bool = True) -> None:
        if new_interval:  # bounded: a clock whose intervals nobody gathers (the emulator alone) keeps the latest
            self._interval_collectives: deque[tuple[Span, ...]] = deque(maxlen=_MAX_INTERVAL_STEPS)
        self._interval_size = batch_size
        self._steps = 0
        self._synced_steps = 0
        self._least_sync_wait = NAN
        names = ("data_time", "compute_time", "sync_wait", "step_time", "cpu_time", "comm_time", "comm_bytes")
        self._sums = dict.fromkeys((*names, "work", "padding"), 0.0)

    def _add(self, record: StepRecord) -> None:
        self._interval_collectives.append(record.collectives)
        if record.batch_size != self._interval_size:
            self._reset_interval(record.batch_size, new_interval=False)  # times at another size would be mixed in
        self._steps += 1
        for name in ("data_time", "compute_time", "sync_wait", "step_time", "cpu_time", "work", "padding"):
            self._sums[name] += getattr(record, name)  # NaN (not counted) at one step makes the interval's NaN
        if record.synchronised:
            least = self._least_sync_wait
            self._least_sync_wait = record.sync_wait if math.isnan(least) else min(least, record.sync_wait)
            self._synced_steps += 1
            self._sums["comm_time"] += record.comm_time
            self._sums["comm_bytes"] += record.comm_bytes
