"""Emulate a heterogeneous cluster on one machine: make ranks slower by a factor, on a schedule.

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/callbacks/emulator.py``.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from typing_extensions import override

from lightning_dynamix import _compat
from lightning_dynamix._checks import require_number
from lightning_dynamix.callbacks.measurement import _heterogeneous_strategy
from lightning_dynamix.control.allocation import validate_batch_size_caps
from lightning_dynamix.metrics import StepClock, StepRecord
from lightning_dynamix.strategies import PerRankBatchStrategy

_RECENT_STEPS = 5  # compute-to-forward ratios the next sleep is based on (their median)


class CudaSpin:
    """Device time on demand: a kernel that spins on the current stream of ``device`` for a given number of seconds.

    ``torch.cuda._sleep(cycles)`` (through :mod:`lightning_dynamix._compat`) spins for a number of the device's
    clock cycles; the cycles per second are measured at construction (the median of a few spins timed with CUDA
    events, after one to wake the clock).

    Args:
        device: the CUDA device to spin on.
        calibration_s: seconds each calibration spin aims at.

    Raises:
        ValueError: ``device`` is not a CUDA device or CUDA is not available.
    """

    def __init__(self, device: torch.device | str, calibration_s: float = 0.02) -> None:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"`device` must be an available CUDA device for CudaSpin, got {str(device)!r}")
        self.device = device
        cycles = 1_000_000
        with torch.cuda.device(device):
            _compat.cuda_sleep(cycles)  # wakes the device's clock from idle
            rates = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                _compat.cuda_sleep(cycles)
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1000.0
                rates.append(cycles / seconds)
                cycles = max(1, int(cycles * calibration_s / seconds))  # the next spin near the aim
        self.cycles_per_s = statistics.median(rates[1:])

    def spin(self, seconds: float) -> None:
        """Queue ``seconds`` of spinning on the current stream (returns at once)."""
        if seconds > 0:
            with torch.cuda.device(self.device):
                _compat.cuda_sleep(max(1, int(seconds * self.cycles_per_s)))


def _slowdown(name: str, value: object) -> float:
    # sleeping can only slow a rank down: a factor below 1 could not be honoured
    return require_number(name, value, 1.0)


class HeterogeneityEmulator(Callback):
    """Slows ranks down by a factor each, changeable at scheduled steps. For benchmarks and tests.

    Args:
        factors: one factor per rank, ``>= 1`` (1.0 = the rank's own speed, 3.0 = three times slower;
            sleeping cannot make a rank faster, so factors below 1 are rejected).
        schedule: ``(step, rank, factor)`` entries: from optimizer step ``step`` on, rank ``rank``
            runs at ``factor``.
        memory_limits: one entry per rank: the most samples its (emulated) device memory holds, ``None`` for no
            limit. A step that gives the rank more raises ``torch.OutOfMemoryError`` as its backward starts, as a
            device with less memory would (the strategy's recovery catches it; see
            :mod:`~lightning_dynamix.strategies.memory_recovery`). Default: no limits.

    Raises:
        ValueError: for factors below 1 (or not finite), an empty ``factors``, or a schedule entry that is malformed or
            names a rank that does not exist; for memory limits that are not ints >= 1 or None, one per rank.
        MisconfigurationException: at set-up, if ``factors`` does not have one entry per rank or the
            strategy is not ``HeterogeneousDDPStrategy`` (whose step clock measures own compute).
    """

    def __init__(
        self,
        factors: Sequence[float],
        schedule: Sequence[Sequence[float]] = (),
        memory_limits: Sequence[int | None] | None = None,
    ) -> None:
        if isinstance(factors, str) or not isinstance(factors, Sequence) or not factors:
            raise ValueError(f"`factors` must be a non-empty list with one factor per rank, got {factors!r}")
        self.factors = [_slowdown(f"factors[{i}]", f) for i, f in enumerate(factors)]
        self.memory_limits = validate_batch_size_caps(memory_limits, "memory_limits", len(self.factors))
        entries: list[tuple[int, int, float]] = []
        for i, entry in enumerate(schedule):
            if isinstance(entry, str) or not isinstance(entry, Sequence) or len(entry) != 3:
                raise ValueError(f"`schedule[{i}]` must be a (step, rank, factor) triple, got {entry!r}")
            step, rank, factor = entry
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"`schedule[{i}]` has step {step!r}; steps are ints >= 0")
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(self.factors):
                raise ValueError(
                    f"`schedule[{i}]` names rank {rank!r}, but `factors` gives {len(self.factors)} ranks"
                    f" (0 to {len(self.factors) - 1})"
                )
            entries.append((step, rank, _slowdown(f"schedule[{i}] factor", factor)))
        self.schedule = sorted(entries, key=lambda e: e[0])
        self._clock: StepClock | None = None
        self._rank = 0
        self._ratios: deque[float] = deque(maxlen=_RECENT_STEPS)
        self._forwards: deque[tuple[int, float]] = deque(maxlen=_RECENT_STEPS)  # (batch size, forward seconds)
        self._forward_start = 0.0
        self._forward = 0.0
        self._slept = 0.0
        self._backward_seen = False  # the last step ran backward with samples: its compute time is a measurement
        self._strategy: PerRankBatchStrategy | None = None
        self._spin: CudaSpin | None = None  # on a GPU: the slowdown is device time
        self._own: deque[tuple[int, float]] = deque(maxlen=4 * _RECENT_STEPS)  # (batch size, own device compute)
        self._last_read: StepRecord | None = None  # the clock's latest record already counted in _own

    def factor_at(self, rank: int, step: int) -> float:
        """Rank ``rank``'s factor at optimizer step ``step``."""
        factor = self.factors[rank]
        for when, who, value in self.schedule:
            if when > step:
                break
            if who == rank:
                factor = value
        return factor

    @property
    def slept(self) -> float:
        """Seconds this rank slept in its current (or last) step; 0.0 for a step it had no samples in."""
        return self._slept

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = _heterogeneous_strategy(trainer, type(self).__name__)
        if len(self.factors) != trainer.world_size:
            raise MisconfigurationException(
                f"HeterogeneityEmulator(factors={self.factors}) has {len(self.factors)} factors but the job has"
                f" {trainer.world_size} ranks; give one factor per rank."
            )
        self._strategy = strategy
        self._clock = strategy.enable_step_clock()
        self._rank = trainer.global_rank
        if strategy.root_device.type == "cuda":
            self._spin = CudaSpin(strategy.root_device)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        assert self._clock is not None
        last = self._clock.last_step
        if self._spin is not None:
            self._slept = 0.0
            if last is not None and last is not self._last_read and last.batch_size > 0:  # read from the device since
                self._own.append((last.batch_size, max(0.0, last.compute_time - last.slowdown)))
            self._last_read = last
            return
        if last is not None and self._backward_seen and self._forward > 0:
            self._ratios.append(max(0.0, last.compute_time - self._slept) / self._forward)
        self._slept, self._forward, self._backward_seen = 0.0, 0.0, False
        self._forward_start = time.perf_counter()

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        assert self._strategy is not None
        assert self._clock is not None
        self._check_memory()
        if self._spin is not None:
            self._spin_on_device(trainer)
            return
        # a collective inside training_step (sync_dist logging) waits for other ranks: not this rank's work
        self._forward = time.perf_counter() - self._forward_start - self._clock.step_collective_time
        sizes = self._strategy.current_batch_sizes
        if sizes is not None and sizes[self._rank] == 0:  # no samples: none of the model runs, nothing to slow
            return
        batch_size = sizes[self._rank] if sizes else 0
        self._forwards.append((batch_size, self._forward))
        factor = self.factor_at(self._rank, trainer.global_step)
        self._backward_seen = True
        if not self._ratios or factor <= 1.0:
            return
        forward = statistics.median(f for b, f in self._forwards if b == batch_size)
        start = time.perf_counter()
        time.sleep((factor - 1.0) * statistics.median(self._ratios) * forward)
        self._slept += time.perf_counter() - start  # what was slept, oversleeping included
        self._clock.slowed(self._slept)

    def _check_memory(self) -> None:
        """An emulated device memory: more samples than it holds fail as a real device's would."""
        assert self._strategy is not None
        limit = self.memory_limits[self._rank] if self.memory_limits is not None else None
        sizes = self._strategy.current_batch_sizes
        if limit is not None and sizes is not None and sizes[self._rank] > limit:
            raise torch.OutOfMemoryError(
                f"HeterogeneityEmulator: rank {self._rank}'s emulated device memory holds {limit} samples, the step"
                f" gives it {sizes[self._rank]}"
            )

    def _spin_on_device(self, trainer: Trainer) -> None:
        """Queue ``(factor - 1)`` times this rank's own device compute at the batch size at hand on its stream."""
        assert self._strategy is not None
        assert self._spin is not None
        assert self._clock is not None
        sizes = self._strategy.current_batch_sizes
        batch_size = sizes[self._rank] if sizes else 0
        factor = self.factor_at(self._rank, trainer.global_step)
        own = [seconds for b, seconds in self._own if b == batch_size]
        if batch_size == 0 or factor <= 1.0 or not own:  # nothing measured at this size yet: the device's own pace
            return
        seconds = (factor - 1.0) * statistics.median(own[-_RECENT_STEPS:])
        self._spin.spin(seconds)
        self._slept = seconds
        self._clock.slowed(seconds)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._clock is not None
        self._clock.step_end()  # closes the step if no measuring callback did
