"""The step clock on a device whose host runs ahead: fake CUDA events on a simulated stream.

On a GPU the CPU only queues kernels, so host timestamps at the step's events measure launches. These
tests run one step sequence (forward and backward queued, a gradient bucket's all-reduce waiting on
its own stream for a late peer, the optimizer step) against the same clock read from the host and
from device marks, and check that only the device marks give the rank's own compute and its wait.
"""

from __future__ import annotations

import pytest

from lightning_dynamix.metrics import HostClock, StepClock, time_source_for
from lightning_dynamix.testing import FakeDevice, FakeEvent, FakeEventClock

LAUNCH = 0.0002  # host seconds to queue a kernel
LOADER = 0.001  # host seconds to take a batch from the loader


def device_step(
    clock: StepClock,
    device: FakeDevice,
    batch: int,
    forward: float = 0.010,
    backward: float = 0.020,
    peer_late: float = 0.015,
    transfer: float = 0.002,
    optimizer: float = 0.003,
):
    """One training step as a GPU rank runs it: the host queues, the device runs, NCCL waits for a peer."""
    clock.data_start()
    device.host_work(LOADER)
    clock.data_end(batch)
    device.host_work(LAUNCH)
    device.launch(forward)
    device.host_work(LAUNCH)
    device.launch(backward)
    started = clock.bucket_ready(4096)  # the hook, right after the bucket's gradient kernels were queued
    ready = device.reached()
    # NCCL's stream starts the all-reduce once the bucket is ready and the peer has arrived
    device.wait_for(ready, "nccl")
    device.wait_for(FakeEvent(ready.time + peer_late), "nccl")
    device.launch(transfer, "nccl")
    device.wait_for(device.reached("nccl"))  # the future's callback runs on a stream that waits for it
    clock.bucket_done(started)
    clock.backward_end()  # DDP's end of backward: the stream waits for the all-reduce, the CPU does not
    device.host_work(LAUNCH)
    device.launch(optimizer)
    return clock.step_end()


def test_device_marks_give_own_compute_and_the_wait_for_a_late_peer_where_host_times_give_launches():
    device = FakeDevice()
    on_device = StepClock(time_source=FakeEventClock(device), cpu_quota=None)
    device_step(on_device, device, batch=64)  # the first step also waits for the host's first launch
    on_device.reset_interval()
    for _ in range(4):
        device_step(on_device, device, batch=64)
    summary = on_device.summary()
    assert summary.steps == 4
    assert summary.compute_time == pytest.approx(0.030)  # forward and backward on the device
    assert summary.sync_wait == pytest.approx(0.017)  # the late peer and the transfer
    assert summary.comm_time == pytest.approx(0.017)  # bucket ready to all-reduce done, on the device
    assert summary.step_time == pytest.approx(0.050)  # the device's step, the optimizer's kernels included

    host_device = FakeDevice()
    on_host = StepClock(time_source=HostClock(lambda: host_device.host), cpu_quota=None)
    for _ in range(4):
        device_step(on_host, host_device, batch=64)
    host = on_host.summary()
    # the host reached the hook after queueing two kernels, and never waited for the all-reduce
    assert host.compute_time == pytest.approx(2 * LAUNCH)
    assert host.sync_wait == pytest.approx(0.0)
    assert host.step_time == pytest.approx(LOADER + 3 * LAUNCH)


def test_device_marks_are_read_at_a_later_step_once_reached_never_by_waiting_each_step():
    device = FakeDevice()
    source = FakeEventClock(device)
    clock = StepClock(time_source=source, cpu_quota=None)
    for _ in range(3):
        assert device_step(clock, device, batch=32) is None  # the device is still on it
    assert clock.last_step is None
    assert clock.last_batch_size == 32  # known on the host at once
    assert source.waits == 0  # no step made the host wait for the device
    host_before = device.host
    assert host_before < 0.01  # the host ran ahead: three device steps take 150 ms

    device.host_work(1.0)  # e.g. the host waited for something else: the device passed every mark
    assert device_step(clock, device, batch=32) is None  # this step's marks: not reached yet
    assert source.waits == 0
    assert clock.last_step is not None  # the three before it were read, without waiting
    assert clock.summary().steps == 4  # the interval's end reads the rest, waiting where it must
    assert source.waits > 0
    # each step's own forward and backward; the first and the one after the pause also wait for a launch
    assert clock.summary().compute_time == pytest.approx(0.030, abs=LAUNCH)


def test_a_new_interval_leaves_out_steps_closed_before_it_even_when_read_after_it():
    device = FakeDevice()
    clock = StepClock(time_source=FakeEventClock(device), cpu_quota=None)
    device_step(clock, device, batch=16, backward=0.5)  # a slow warm-up step, read only later
    device_step(clock, device, batch=16, backward=0.5)
    clock.reset_interval()
    for _ in range(2):
        device_step(clock, device, batch=16)
    summary = clock.summary()
    assert summary.steps == 2
    assert summary.compute_time == pytest.approx(0.030)


def test_an_emulated_slowdown_is_recorded_with_the_step_it_slowed():
    device = FakeDevice()
    clock = StepClock(time_source=FakeEventClock(device), cpu_quota=None)
    clock.data_start()
    clock.data_end(8)
    device.launch(0.01)
    clock.slowed(0.02)
    device.launch(0.02)  # the spin kernel
    clock.backward_end()
    clock.step_end()
    clock.summary()
    assert clock.last_step is not None
    assert clock.last_step.compute_time == pytest.approx(0.03)
    assert clock.last_step.slowdown == pytest.approx(0.02)


def test_step_clock_takes_one_source_of_time():
    with pytest.raises(ValueError, match=r"`timer`.*`time_source`"):
        StepClock(timer=lambda: 0.0, time_source=HostClock())
    with pytest.raises(ValueError, match="`time_source` must be a TimeSource"):
        StepClock(time_source=lambda: 0.0)  # type: ignore[arg-type]


def test_a_cpu_rank_is_timed_on_the_host_and_a_cuda_clock_needs_a_gpu():
    assert isinstance(time_source_for("cpu"), HostClock)
    from lightning_dynamix.metrics import CudaEventClock

    with pytest.raises(ValueError, match="`device` must be a CUDA device"):
        CudaEventClock("cpu")


def test_the_test_doubles_still_import_from_metrics_for_a_release_with_a_deprecation_warning():
    import lightning_dynamix.metrics as metrics
    import lightning_dynamix.testing as testing

    for name in ("FakeDevice", "FakeEventClock"):
        with pytest.warns(DeprecationWarning, match=r"import it from lightning_dynamix\.testing"):
            assert getattr(metrics, name) is getattr(testing, name)
    with pytest.warns(DeprecationWarning, match="FakeDevice"):
        from lightning_dynamix.metrics import FakeDevice  # noqa: F401  (the import docs/gpus.md showed)
    assert "FakeDevice" not in metrics.__all__
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        _ = metrics.Nope
