"""Device memory as a limit: each rank's largest batch, measured or given, respected by every decision.

The recovery of a step that ran out of memory is checked in real multi-process runs
(tests/distributed/test_memory.py); here its pieces: the caps' arithmetic, the measurement of bytes per
sample, the re-split of a step already handed out, and the arguments' checks.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import Dataset

from lightning_dynamix import HeterogeneityEmulator, HeterogeneousDDPStrategy
from lightning_dynamix.control import GoodputController, PIDController, StaticController
from lightning_dynamix.control.allocation import respect_batch_size_caps
from lightning_dynamix.data import HeterogeneousBatchSampler, HeterogeneousDataLoader
from lightning_dynamix.decisions import DecisionMaker, IntervalMeter
from lightning_dynamix.metrics.memory import DeviceMemory
from lightning_dynamix.metrics.state import ClusterState, WorkerMetrics
from lightning_dynamix.strategies.memory_recovery import OutOfMemoryRecovery, OutOfMemoryStop

NAN = float("nan")


def state(sizes, compute, caps, max_batch_size=None):
    workers = tuple(
        WorkerMetrics(
            r, b, data_time=0.0, compute_time=t, sync_wait=max(compute) - t, step_time=max(compute), max_batch_size=c
        )
        for r, (b, t, c) in enumerate(zip(sizes, compute, caps))
    )
    return ClusterState(workers=workers, max_batch_size=max_batch_size)


def test_sizes_above_a_cap_go_to_the_ranks_with_room_the_total_kept():
    assert respect_batch_size_caps([10, 10, 10], [None, 6, None]) == (12, 6, 12)
    assert respect_batch_size_caps([4, 28], [None, 20]) == (12, 20)
    assert respect_batch_size_caps([8, 8], [None, None]) == (8, 8)  # nothing to do
    # a rank that sits out takes samples only once the others are full
    assert respect_batch_size_caps([0, 10, 10], [None, 8, 10]) == (2, 8, 10)
    with pytest.raises(ValueError, match="hold 14 samples, fewer than the global batch of 20"):
        respect_batch_size_caps([10, 10], [7, 7])


def test_a_ranks_cap_is_the_tighter_of_its_memory_and_the_jobs_bound():
    caps = state([8, 8, 8], [1, 1, 1], [NAN, 6.0, 30.0], max_batch_size=20).batch_size_caps
    assert caps == (20, 6, 20)
    assert state([8, 8], [1, 1], [NAN, NAN]).batch_size_caps == (None, None)


@pytest.mark.parametrize("controller", [PIDController(smoothing=0.0), GoodputController()], ids=["pid", "goodput"])
def test_a_controller_never_gives_a_fast_rank_more_than_its_memory_holds(controller):
    # rank 1 is five times as fast: without its cap of 12 it would get most of the 32 samples
    decided = controller.decide(state([16, 16], [0.05, 0.01], [NAN, 12.0]))
    assert decided.batch_sizes[1] <= 12
    assert sum(decided.batch_sizes) == 32


@pytest.mark.parametrize("controller", [StaticController(), PIDController(smoothing=0.0)], ids=["static", "pid"])
def test_every_decision_is_kept_within_the_caps_whatever_the_controller_decided(controller):
    # the static controller keeps sizes the new cap no longer allows: the decision moves the excess
    maker = DecisionMaker(controller, "test", "none", "test")
    decision = maker.propose(state([8, 24], [0.01, 0.01], [NAN, 16.0]), [8, 24])
    assert decision.batch_sizes[1] <= 16
    assert sum(decision.batch_sizes) == 32


class FakeMemory:
    """A device's allocator counters, set by the test."""

    def __init__(self, limit: int) -> None:
        self.held, self.high, self.total = 0, 0, limit

    def allocated(self) -> int:
        return self.held

    def peak(self) -> int:
        return self.high

    def reset_peak(self) -> None:
        self.high = self.held

    def limit(self) -> int:
        return self.total

    def step(self, base: int, per_sample: int, batch: int, memory: DeviceMemory) -> None:
        self.held = base
        self.high = base + per_sample * batch
        memory.step_end(batch)


def test_the_largest_batch_follows_from_the_peak_bytes_per_sample_after_warm_up():
    reader = FakeMemory(limit=10_000)
    memory = DeviceMemory(reader, margin=0.1, warmup_steps=1)
    reader.held = 1000  # parameters and optimizer state
    memory.step_end(0)  # the reading starts
    reader.step(1000, 50, 16, memory)  # warm-up: not counted
    assert math.isnan(memory.cap())
    reader.step(1000, 100, 16, memory)
    assert memory.bytes_per_sample == 100
    assert memory.cap() == 80  # (10000 * 0.9 - 1000) / 100
    reader.step(1000, 80, 32, memory)  # a cheaper step does not lower the bytes per sample
    assert memory.cap() == 80
    with pytest.raises(ValueError, match=r"`margin` must be in \[0, 1\)"):
        DeviceMemory(reader, margin=1.0)


def test_a_rank_s_gathered_cap_is_the_tighter_of_the_one_given_and_its_memory():
    meter = IntervalMeter(interval=1, warmup_steps=0)
    assert math.isnan(meter._batch_size_cap(None))  # a CPU rank: nothing measured
    assert meter._batch_size_cap(12) == 12
    reader = FakeMemory(limit=10_000)
    meter.memory = DeviceMemory(reader, margin=0.0, warmup_steps=0)
    meter.memory.step_end(0)
    reader.step(0, 1000, 4, meter.memory)
    assert meter._batch_size_cap(None) == 10
    assert meter._batch_size_cap(12) == 10
    with pytest.raises(ValueError, match="`memory_margin` must be in"):
        IntervalMeter(memory_margin=1.5)


def test_a_rank_that_ran_out_of_memory_is_capped_and_the_same_global_batch_split_anew():
    recovery = OutOfMemoryRecovery(world_size=3, rank=0, caps=[None, None, 20])
    recovery.trained = [8, 8, 8]
    # rank 1 failed at 24: capped at 18 (3/4 of 24, more than the 8 it trained); the 48 samples within the caps
    assert recovery.split_anew((12, 24, 12), [0, 24, 0], least=1) == (15, 18, 15)
    assert recovery.caps == [None, 18, 20]
    assert recovery.retry_pending
    recovery.trained = [8, 17, 8]
    assert recovery.split_anew((12, 18, 18), [0, 18, 0], least=1)[1] == 17  # its largest trained size: known to fit
    with pytest.raises(OutOfMemoryStop, match="rank 0 ran out of device memory at 2 samples"):
        OutOfMemoryRecovery(2, 0, [None, None]).split_anew((2, 2), [2, 0], least=2)
    with pytest.raises(OutOfMemoryStop, match="fewer than the global batch"):
        OutOfMemoryRecovery(2, 0, [None, 10]).split_anew((40, 10), [40, 0], least=1)


class Indexed(Dataset):
    def __len__(self) -> int:
        return 60

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


def test_a_step_split_anew_is_rebuilt_also_where_it_was_prefetched_at_the_old_sizes():
    sampler = HeterogeneousBatchSampler(Indexed(), [4, 8], rank=0, world_size=2, shuffle=False)
    loader = HeterogeneousDataLoader(Indexed(), batch_sampler=sampler, num_workers=1, prefetch_factor=3)
    batches = iter(loader)
    assert next(batches).tolist() == [0, 1, 2, 3]
    assert next(batches).tolist() == [12, 13, 14, 15]  # step 1; the worker read steps 2 and 3 ahead
    assert not sampler.was_resplit(2)
    sampler.resplit(1, [6, 6])
    assert sampler.was_resplit(2)  # produced at [4, 8] before the resplit, for the worker to read ahead
    assert sampler.was_resplit(3)
    assert not sampler.was_resplit(5)
    assert loader.resplit_current().tolist() == [12, 13, 14, 15, 16, 17]  # the step being trained
    assert loader.current_batch_sizes == (6, 6)
    assert next(batches).tolist() == [24, 25, 26, 27, 28, 29]  # prefetched at [4, 8]: rebuilt
    assert next(batches).tolist() == [36, 37, 38, 39, 40, 41]
    with pytest.raises(ValueError, match="a resplit keeps step 4's global batch of 12"):
        sampler.resplit(4, [6, 7])
    with pytest.raises(ValueError, match="the step being trained"):
        sampler.resplit(1, [6, 6])


def test_caps_and_memory_limits_are_checked_where_they_are_given():
    with pytest.raises(ValueError, match=r"`batch_size_caps\[1\]` must be an int >= 1"):
        HeterogeneousDDPStrategy(batch_size_caps=[None, 0])
    with pytest.raises(ValueError, match="`batch_size_caps` must be a list"):
        HeterogeneousDDPStrategy(batch_size_caps=8)
    with pytest.raises(ValueError, match=r"give ranks \[1\] more samples than their caps \[None, 8\]"):
        HeterogeneousDDPStrategy(batch_sizes=[4, 12], batch_size_caps=[None, 8])
    with pytest.raises(ValueError, match="`recover_out_of_memory` must be"):
        HeterogeneousDDPStrategy(recover_out_of_memory="yes")
    with pytest.raises(ValueError, match=r"`memory_limits` must hold one cap .* per rank, 2 of them"):
        HeterogeneityEmulator([1.0, 2.0], memory_limits=[8])
    with pytest.raises(ValueError, match=r"`memory_limits\[0\]` must be an int >= 1"):
        HeterogeneityEmulator([1.0, 2.0], memory_limits=[0, None])
