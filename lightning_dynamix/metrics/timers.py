"""One rank's step timeline, recorded at batch boundaries and gradient buckets.

:class:`StepClock` receives timestamps from the places that see them first: the DataLoader
(when a batch is asked for and handed over), the weighted all-reduce hook (when each gradient
bucket is ready and when its all-reduce completes), the strategy's backward (when it returns,
after DDP has waited for every all-reduce) and the end of the batch. From them it derives, per
step, in seconds:

* ``data_time``: waiting for the DataLoader;
* ``compute_time``: from the batch being handed over to the last gradient bucket being ready,
  the rank's own forward and backward without any wait for other ranks (to the end of backward
  on steps that do not synchronise), less the time spent in blocking collectives inside the step
  before that point (:meth:`StepClock.collective`: a value logged with ``sync_dist=True`` from
  ``training_step`` waits there for the slowest rank);
* ``sync_wait``: from the last bucket being ready to the end of backward, plus those collectives;
* ``step_time``: from asking for the batch to the end of the step;
* ``comm_time`` and ``comm_bytes``: time with at least one all-reduce in flight, and the bytes
  all-reduced;
* ``least_sync_wait``: the least ``sync_wait`` of any step in an interval: the bare transfer of
  the last gradient bucket at a step where no other rank was late (or frozen by its CPU quota);
* ``cpu_time``: CPU seconds used over ``step_time``, on the counter a CPU quota is charged from
  where the rank has one (:class:`~lightning_dynamix.metrics.system.CpuQuota`: the cgroup's), else
  the process's own (all its threads, the backend's included).

Steps are summed into an interval (:meth:`StepClock.summary`) at the rank's current batch size:
a step trained at another size (one prefetched before a resize) starts the interval afresh, so
times and sizes always belong together; an epoch's final step, whose sizes the dataset's remainder
decides, is left out of the interval altogether. Recording costs a few ``perf_counter`` calls per step and
bucket (and one CPU-time reading per step) and needs no collective.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

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


class StepClock:
    """Timestamps of one rank's training steps; see the module docstring for what is derived.

    Args:
        timer: the clock read at every event, in seconds (monotonic).
        cpu_quota: the CPU quota this process runs under, ``None`` for none, or ``"find"`` (default)
            to read it from the process's cgroup (:func:`~lightning_dynamix.metrics.system.find_cpu_quota`).
    """

    def __init__(
        self, timer: Callable[[], float] = time.perf_counter, cpu_quota: CpuQuota | Literal["find"] | None = "find"
    ) -> None:
        self._timer = timer
        self.cpu_quota = find_cpu_quota() if cpu_quota == "find" else cpu_quota
        self._cpu = self.cpu_quota.counter() if self.cpu_quota is not None else time.process_time
        self._lock = threading.Lock()  # all-reduce completions arrive on the backend's thread
        self.last_step: StepRecord | None = None
        self._reset_step()
        self._reset_interval(0)

    # ------------------------------------------------------------------ events
    def data_start(self) -> None:
        """The training loop asks the DataLoader for the next batch."""
        self._reset_step()
        self._data_start = self._timer()
        self._cpu_start = self._cpu()

    def data_end(self, batch_size: int, regular: bool = True) -> None:
        """The DataLoader handed over a batch of ``batch_size`` samples for this rank.

        ``regular=False`` marks a step whose sizes are not the ones in force (an epoch's final step,
        which takes what is left): it is timed (:attr:`last_step`) but left out of the interval, so a
        short tail neither restarts the interval nor stands for the sizes the controller set.
        """
        self._data_end = self._timer()
        if self._cpu_start is None:
            self._cpu_start = self._cpu()
        self._batch_size = batch_size
        self._regular = regular

    def bucket_ready(self, num_bytes: int) -> float:
        """A gradient bucket of ``num_bytes`` is ready and its all-reduce starts; returns the time."""
        now = self._timer()
        self._last_bucket_ready = now
        self._comm_bytes += num_bytes
        return now

    def bucket_done(self, started: float) -> None:
        """The all-reduce that started at ``started`` completed (may run on another thread)."""
        now = self._timer()
        with self._lock:
            self._comm_spans.append((started, now))

    def collective(self, started: float, ended: float) -> None:
        """A blocking collective inside the step ran from ``started`` to ``ended`` (``perf_counter`` seconds).

        The part before the last gradient bucket is ready is waiting for the other ranks, not this
        rank's compute: it moves from ``compute_time`` to ``sync_wait``.
        """
        self._collectives.append((started, ended))

    @property
    def step_collective_time(self) -> float:
        """Seconds this step has spent in blocking collectives so far."""
        return sum(end - start for start, end in self._collectives)

    def backward_end(self) -> None:
        """A backward pass returned (after DDP waited for its all-reduces, if it synchronised)."""
        self._backward_end = self._timer()

    def step_end(self) -> StepRecord | None:
        """The step is over (optimizer step done). Safe to call more than once per step.

        Returns:
            The finished step, or ``None`` if this step was already closed or never started.
        """
        if self._data_end is None or self._closed:
            return None
        now = self._timer()
        self._closed = True
        work_end = self._backward_end if self._backward_end is not None else now
        synchronised = self._last_bucket_ready is not None
        ready = self._last_bucket_ready if synchronised else work_end
        with self._lock:
            spans = list(self._comm_spans)
        waited = _overlap(self._collectives, self._data_end, ready)  # waiting for others before the gradients
        record = StepRecord(
            batch_size=self._batch_size,
            data_time=self._data_end - self._data_start if self._data_start is not None else 0.0,
            compute_time=max(0.0, ready - self._data_end - waited),
            sync_wait=max(0.0, work_end - ready) + waited,
            step_time=now - (self._data_start if self._data_start is not None else self._data_end),
            comm_time=_union_length(spans),
            comm_bytes=self._comm_bytes,
            synchronised=synchronised,
            regular=self._regular,
            cpu_time=self._cpu() - self._cpu_start if self._cpu_start is not None else NAN,
        )
        self.last_step = record
        if record.regular:
            self._add(record)
        return record

    # ------------------------------------------------------------------ intervals
    def summary(self) -> IntervalSummary:
        """Means over the interval's steps (at the latest batch size); does not reset."""
        n = self._steps
        quota = self.cpu_quota.cores if self.cpu_quota is not None else NAN
        if n == 0:
            return IntervalSummary(self._interval_size, 0, *[NAN] * 8, cpu_quota=quota)
        synced = self._synced_steps
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
        )

    def reset_interval(self) -> None:
        """Start a new interval (after a decision was gathered)."""
        self._reset_interval(self._interval_size)

    # ------------------------------------------------------------------ internals
    def _reset_step(self) -> None:
        self._data_start: float | None = None
        self._data_end: float | None = None
        self._cpu_start: float | None = None
        self._batch_size = 0
        self._regular = True
        self._last_bucket_ready: float | None = None
        self._backward_end: float | None = None
        self._comm_bytes = 0
        self._collectives: list[tuple[float, float]] = []
        self._closed = False
        with self._lock:
            self._comm_spans: list[tuple[float, float]] = []

    def _reset_interval(self, batch_size: int) -> None:
        self._interval_size = batch_size
        self._steps = 0
        self._synced_steps = 0
        self._least_sync_wait = NAN
        self._sums = dict.fromkeys(
            ("data_time", "compute_time", "sync_wait", "step_time", "cpu_time", "comm_time", "comm_bytes"), 0.0
        )

    def _add(self, record: StepRecord) -> None:
        if record.batch_size != self._interval_size:
            self._reset_interval(record.batch_size)  # times at another size would be mixed in
        self._steps += 1
        for name in ("data_time", "compute_time", "sync_wait", "step_time", "cpu_time"):
            self._sums[name] += getattr(record, name)
        if record.synchronised:
            least = self._least_sync_wait
            self._least_sync_wait = record.sync_wait if math.isnan(least) else min(least, record.sync_wait)
            self._synced_steps += 1
            self._sums["comm_time"] += record.comm_time
            self._sums["comm_bytes"] += record.comm_bytes
