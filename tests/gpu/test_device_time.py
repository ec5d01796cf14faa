"""Device time on a GPU: CUDA events, the emulator's spin kernel, the allocator's counters (skipped without CUDA).

The host only queues the kernels: the step clock's CUDA-event marks must give the device's time for a step
whose host time is a few launches, without a synchronisation per step; the emulator's spin must last the
seconds asked on the device; the memory reader must find the bytes a sample costs.
"""

from __future__ import annotations

import time

import pytest
import torch

from lightning_dynamix.callbacks.emulator import CudaSpin
from lightning_dynamix.metrics import CudaEventClock, HostClock, StepClock
from lightning_dynamix.metrics.memory import CudaMemoryReader, DeviceMemory

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def step(clock: StepClock, spin: CudaSpin, seconds: float) -> None:
    """A step whose compute is ``seconds`` of device time, queued in microseconds."""
    clock.data_start()
    clock.data_end(32)
    spin.spin(seconds)
    clock.bucket_done(clock.bucket_ready(4096))
    clock.backward_end()
    clock.step_end()


def test_cuda_event_marks_time_the_device_where_the_host_only_queued_the_kernels():
    spin = CudaSpin("cuda")
    on_device = StepClock(time_source=CudaEventClock("cuda"), cpu_quota=None)
    on_host = StepClock(time_source=HostClock(), cpu_quota=None)
    torch.cuda.synchronize()
    for clock in (on_device, on_host):
        for _ in range(5):
            step(clock, spin, 0.02)
        torch.cuda.synchronize()
    assert on_device.summary().compute_time == pytest.approx(0.02, rel=0.1)
    assert on_host.summary().compute_time < 0.005  # the launches only


def test_a_step_is_read_without_waiting_for_the_device_until_the_interval_ends():
    spin = CudaSpin("cuda")
    clock = StepClock(time_source=CudaEventClock("cuda"), cpu_quota=None)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(5):
        step(clock, spin, 0.05)
    queued = time.perf_counter() - started
    assert queued < 0.1  # 250 ms of device work queued: no step waited for it
    assert clock.summary().steps == 5  # the interval's end waits once


def test_the_spin_kernel_lasts_the_seconds_asked_on_the_device():
    spin = CudaSpin("cuda")
    for seconds in (0.005, 0.05):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        spin.spin(seconds)
        end.record()
        end.synchronize()
        assert start.elapsed_time(end) / 1000.0 == pytest.approx(seconds, rel=0.1)


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
