"""Device time on a GPU: CUDA events, the emulator's spin kernel, the allocator's counters (skipped without CUDA).

The step clock's CUDA-event marks must give the device time their events span, read without a wait for the
device at any step's end; the memory reader must find the bytes a sample costs. How long the emulator's spin
lasts against what was asked is a figure of the device, checked by ``dynamix bench device`` (timing 1:3).
"""

from __future__ import annotations

import pytest
import torch

from lightning_dynamix.callbacks.emulator import CudaSpin
from lightning_dynamix.metrics import CudaEventClock, StepClock
from lightning_dynamix.metrics.memory import CudaMemoryReader, DeviceMemory

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


class CountedWaits(CudaEventClock):
    """CUDA events that count every read that had to wait for the device (a mark it had not reached)."""

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.waits = 0

    def elapsed(self, start, end):  # type: ignore[no-untyped-def]
        self.waits += not (start.query() and end.query())
        return super().elapsed(start, end)


def step(clock: StepClock, spin: CudaSpin, seconds: float, reference: list | None = None) -> None:
    """A step whose compute is ``seconds`` of device time; ``reference`` gets events recorded beside the clock's."""
    clock.data_start()
    clock.data_end(32)
    begin = torch.cuda.Event(enable_timing=True)
    begin.record()
    spin.spin(seconds)
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    clock.bucket_done(clock.bucket_ready(4096))
    clock.backward_end()
    clock.step_end()
    if reference is not None:
        reference.append((begin, end))


def test_the_step_clock_reads_the_device_time_its_events_span():
    # compared with events of our own recorded beside the clock's, with nothing queued between: no threshold on speed
    spin = CudaSpin("cuda")
    clock = StepClock(time_source=CudaEventClock("cuda"), cpu_quota=None)
    reference: list = []
    for _ in range(5):
        step(clock, spin, 0.02, reference)
    summary = clock.summary()
    spans = [begin.elapsed_time(end) / 1000.0 for begin, end in reference]
    assert summary.compute_time == pytest.approx(sum(spans) / len(spans), abs=1e-4)


def test_a_step_is_read_without_waiting_for_the_device_until_the_interval_ends():
    # whatever the host's speed: a step's marks are read at a step's end only where the device passed them
    spin = CudaSpin("cuda")
    source = CountedWaits("cuda")
    clock = StepClock(time_source=source, cpu_quota=None)
    for _ in range(5):
        step(clock, spin, 0.05)
    assert source.waits == 0
    assert clock.summary().steps == 5  # the interval's end reads the rest, waiting where it must


def test_the_allocator_counters_give_the_bytes_a_sample_costs_and_a_cap():
    memory = DeviceMemory(CudaMemoryReader("cuda"), margin=0.1, warmup_steps=0)
    weight = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    memory.step_end(0)
    for batch in (64, 128):
        x = torch.randn(batch, 1024, device="cuda")
        (x @ weight).relu().sum().backward()
        del x
        memory.step_end(batch)
    assert memory.bytes_per_sample >= 2 * 1024 * 4  # at least the input and the output of each sample, float32
    cap = memory.cap()
    assert 128 < cap < torch.cuda.get_device_properties(0).total_memory / memory.bytes_per_sample
