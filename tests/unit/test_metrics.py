"""Step timing, system sampling and the ClusterState encoding, in one process."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from lightning_dynamix.metrics import (
    GLOBAL_FEATURES,
    LOCAL_FEATURES,
    ClusterState,
    StepClock,
    SystemMonitor,
    WorkerMetrics,
)
from lightning_dynamix.metrics.system import CpuQuota, find_cpu_quota


class ManualTime:
    """A clock the test moves by hand, so the derived times are exact."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def run_step(
    clock: StepClock, t: ManualTime, batch: int, data=0.01, compute=0.05, wait=0.02, tail=0.005, buckets=2, regular=True
):
    clock.data_start()
    t.advance(data)
    clock.data_end(batch, regular=regular)
    per_bucket = compute / buckets
    for _ in range(buckets):
        t.advance(per_bucket)
        started = clock.bucket_ready(1000)
        t.advance(0.001)
        clock.bucket_done(started)
        t.now -= 0.001  # the all-reduce ran while backward went on
    t.advance(wait)
    clock.backward_end()
    t.advance(tail)
    return clock.step_end()


def test_step_clock_splits_a_step_into_data_own_compute_and_waiting_for_others():
    t = ManualTime()
    clock = StepClock(timer=t)
    record = run_step(clock, t, batch=32)
    assert record.data_time == pytest.approx(0.01)
    assert record.compute_time == pytest.approx(0.05)  # up to the last bucket being ready
    assert record.sync_wait == pytest.approx(0.02)  # last bucket to the end of backward
    assert record.step_time == pytest.approx(0.085)
    assert record.comm_bytes == 2000
    assert record.comm_time == pytest.approx(0.002)
    assert clock.step_end() is None  # a second close of the same step is ignored


def test_waiting_in_a_collective_inside_the_step_counts_as_sync_wait_not_compute():
    # self.log(..., sync_dist=True) in training_step: the rank waits there 30 ms for a slower one
    t = ManualTime()
    clock = StepClock(timer=t)
    clock.data_start()
    t.advance(0.01)
    clock.data_end(32)
    t.advance(0.02)  # forward
    clock.collective(t.now, t.now + 0.03)
    t.advance(0.03)
    assert clock.step_collective_time == pytest.approx(0.03)
    t.advance(0.04)  # backward
    clock.bucket_done(clock.bucket_ready(1000))
    t.advance(0.005)
    clock.backward_end()
    clock.collective(t.now, t.now + 0.002)  # after the gradients: neither compute nor the gradients' wait
    t.advance(0.002)
    record = clock.step_end()
    assert record.compute_time == pytest.approx(0.06)  # forward and backward only
    assert record.sync_wait == pytest.approx(0.035)
    assert record.step_time == pytest.approx(0.107)
    clock.data_start()  # the next step starts with no collective time
    assert clock.step_collective_time == 0.0


def test_step_without_synchronisation_counts_all_of_backward_as_compute():
    t = ManualTime()
    clock = StepClock(timer=t)
    clock.data_start()
    clock.data_end(8)
    t.advance(0.03)
    clock.backward_end()
    record = clock.step_end()
    assert not record.synchronised
    assert record.compute_time == pytest.approx(0.03)
    assert record.sync_wait == 0.0
    summary = clock.summary()
    assert math.isnan(summary.comm_time)
    assert math.isnan(summary.bandwidth)


def test_interval_summary_means_and_a_size_change_starts_the_interval_afresh():
    t = ManualTime()
    clock = StepClock(timer=t)
    for compute in (0.04, 0.06):
        run_step(clock, t, batch=32, compute=compute)
    summary = clock.summary()
    assert summary.steps == 2
    assert summary.compute_time == pytest.approx(0.05)
    assert summary.samples_per_s == pytest.approx(32 / 0.085)
    assert summary.bandwidth == pytest.approx(2000 / 0.002)
    run_step(clock, t, batch=48, compute=0.09)  # trained at a new size: old times no longer apply
    summary = clock.summary()
    assert (summary.batch_size, summary.steps) == (48, 1)
    assert summary.compute_time == pytest.approx(0.09)
    clock.reset_interval()
    assert clock.summary().steps == 0
    assert math.isnan(clock.summary().step_time)


def test_an_epochs_short_final_step_is_timed_but_left_out_of_the_interval():
    t = ManualTime()
    clock = StepClock(timer=t)
    for _ in range(3):
        run_step(clock, t, batch=32, compute=0.05)
    tail = run_step(clock, t, batch=3, compute=0.01, regular=False)  # the 3 samples left at the epoch's end
    assert tail.batch_size == 3
    assert clock.last_step is tail
    run_step(clock, t, batch=32, compute=0.05)  # the next epoch, same sizes
    summary = clock.summary()
    assert (summary.batch_size, summary.steps) == (32, 4)  # neither reset nor diluted by the tail
    assert summary.compute_time == pytest.approx(0.05)


def test_overlapping_all_reduces_count_once_in_comm_time():
    t = ManualTime()
    clock = StepClock(timer=t)
    clock.data_start()
    clock.data_end(4)
    first = clock.bucket_ready(10)
    t.advance(0.01)
    second = clock.bucket_ready(10)
    t.advance(0.01)
    clock.bucket_done(first)  # [0, 0.02]
    t.advance(0.01)
    clock.bucket_done(second)  # [0.01, 0.03]
    clock.backward_end()
    assert clock.step_end().comm_time == pytest.approx(0.03)


def test_system_monitor_gives_cpu_and_memory_and_nan_for_a_gpu_that_is_not_there():
    sample = SystemMonitor(gpu_index=None).sample()
    assert 0.0 <= sample.cpu_util <= 100.0
    assert 0.0 < sample.mem_util <= 100.0
    assert math.isnan(sample.gpu_util)
    assert math.isnan(sample.gpu_power_w)
    missing = SystemMonitor(gpu_index=7)  # no NVML here, or no such GPU: NaN, never an error
    assert math.isnan(missing.sample().gpu_mem_util) or missing.has_gpu


def worker(rank, batch, compute, step=0.3, **extra):
    """A rank that computes for ``compute`` seconds and waits for the slowest until ``step``."""
    return WorkerMetrics(
        rank=rank,
        batch_size=batch,
        data_time=0.0,
        compute_time=compute,
        sync_wait=step - compute,
        step_time=step,
        **extra,
    )


def test_cluster_state_throughput_against_the_ideal_sum_of_rank_speeds():
    # equal batches, one rank 3x slower: the job runs at the slow rank's pace, half the ideal
    state = ClusterState((worker(0, 32, 0.1), worker(1, 32, 0.3)))
    assert state.throughput == pytest.approx(64 / 0.3)
    assert state.ideal_throughput == pytest.approx(32 / 0.1 + 32 / 0.3)
    assert state.throughput / state.ideal_throughput == pytest.approx(0.5)


def test_the_transfer_every_rank_pays_counts_in_the_ideal_but_waiting_for_a_straggler_does_not():
    # both ranks compute 0.1 s and then spend 0.02 s in the all-reduce: equal speeds run at their ideal
    even = ClusterState((worker(0, 32, 0.1, step=0.12), worker(1, 32, 0.1, step=0.12)))
    assert even.transfer_time == pytest.approx(0.02)
    assert even.throughput / even.ideal_throughput == pytest.approx(1.0)
    # rank 1 is 3x slower: rank 0 waits 0.2 s for it plus the 0.02 s transfer; static batches give N * min s_r
    slow = ClusterState((worker(0, 32, 0.1, step=0.32), worker(1, 32, 0.3, step=0.32)))
    assert slow.transfer_time == pytest.approx(0.02)
    assert slow.rank_speeds == pytest.approx((32 / 0.12, 32 / 0.32))
    assert slow.throughput == pytest.approx(2 * min(slow.rank_speeds))
    # a rank that measured no wait (NaN) does not decide the transfer
    unknown = ClusterState((worker(0, 32, 0.1, step=0.32), WorkerMetrics(rank=1, batch_size=32)))
    assert unknown.transfer_time == pytest.approx(0.22)


def test_the_network_share_tells_a_link_bound_job_from_a_balanced_one_at_the_same_ratio_to_the_ideal():
    # the same 3 ms of compute per rank: on a fast link the all-reduce is 0.5 ms of the step, on a slow one 82 ms;
    # both are balanced, so both run at their ideal, and only the share says which one a larger batch would speed up
    fast = ClusterState((worker(0, 64, 0.003, step=0.0035), worker(1, 64, 0.003, step=0.0035)))
    slow = ClusterState((worker(0, 64, 0.003, step=0.085), worker(1, 64, 0.003, step=0.085)))
    for state in (fast, slow):
        assert state.throughput / state.ideal_throughput == pytest.approx(1.0)
    assert fast.network_share == pytest.approx(0.5 / 3.5)
    assert slow.network_share == pytest.approx(82 / 85)
    # with the all-reduce free, the slow-link job would run at its compute alone: ratio * (1 - share) says so
    compute_alone = 128 / 0.003
    assert slow.throughput / compute_alone == pytest.approx(1 - slow.network_share)
    # waiting for a straggler is not the network: rank 1 three times slower, 20 ms of all-reduce
    straggler = ClusterState((worker(0, 32, 0.1, step=0.32), worker(1, 32, 0.3, step=0.32)))
    assert straggler.network_share == pytest.approx(0.02 / (64 / (32 / 0.12 + 32 / 0.32)))  # 0.115 of the ideal step
    assert straggler.network_share < 0.2  # not the 0.69 of its step rank 0 spent waiting
    # nothing measured: not known
    assert math.isnan(ClusterState((WorkerMetrics(rank=0, batch_size=32),)).network_share)


def test_observation_is_finite_scale_free_and_has_the_documented_shape():
    state = ClusterState(
        (worker(0, 32, 0.1, bandwidth=1e9), worker(1, 96, 0.3)),
        loss=1.2,
        loss_slope=-0.01,
        gradient_noise_scale=float("nan"),
        max_batch_size=128,
    )
    obs = state.observation()
    assert obs["ranks"].shape == (2, len(LOCAL_FEATURES))
    assert obs["cluster"].shape == (len(GLOBAL_FEATURES),)
    assert obs["ranks"].dtype == np.float32
    assert np.isfinite(obs["ranks"]).all()
    assert np.isfinite(obs["cluster"]).all()
    share = LOCAL_FEATURES.index("log2_batch_share")
    assert obs["ranks"][1, share] - obs["ranks"][0, share] == pytest.approx(math.log2(3))
    assert obs["cluster"][GLOBAL_FEATURES.index("noise_scale_known")] == 0.0
    doubled = ClusterState(
        tuple(worker(w.rank, w.batch_size, 2 * w.compute_time, step=0.6) for w in state.workers), max_batch_size=128
    )
    # twice as slow everywhere: relative features do not move
    speed = LOCAL_FEATURES.index("relative_own_speed")
    assert doubled.observation()["ranks"][:, speed] == pytest.approx(obs["ranks"][:, speed])


def test_cluster_state_rejects_ranks_out_of_order():
    with pytest.raises(ValueError, match="rank order"):
        ClusterState((worker(1, 8, 0.1), worker(0, 8, 0.1)))
    with pytest.raises(ValueError, match="one WorkerMetrics per rank"):
        ClusterState(())


def test_the_tightest_cpu_quota_on_the_way_to_the_root_is_found_in_cgroup_v1(tmp_path):
    cpu, cpuacct = tmp_path / "cpu", tmp_path / "cpuacct"
    job, rank = cpu / "job", cpu / "job" / "rank0"
    rank.mkdir(parents=True)
    (cpuacct / "job" / "rank0").mkdir(parents=True)
    for group, quota in ((cpu, -1), (job, 150000), (rank, 50000)):
        (group / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        (group / "cpu.cfs_period_us").write_text("100000\n")
    (cpuacct / "job" / "rank0" / "cpuacct.usage").write_text("2500000000\n")
    found = find_cpu_quota("3:cpuacct:/job/rank0\n2:cpu:/job/rank0\n0::/\n", root=tmp_path)
    assert found == CpuQuota(cores=0.5, group=rank, usage=cpuacct / "job" / "rank0" / "cpuacct.usage")
    assert found.counter()() == 2.5  # the group's CPU time, its DataLoader workers included
    # the job's 1.5 cores are tighter than a rank's 2; the process sits elsewhere in cpuacct: its own CPU time
    (rank / "cpu.cfs_quota_us").write_text("200000\n")
    found = find_cpu_quota("3:cpuacct:/\n2:cpu:/job/rank0\n", root=tmp_path)
    assert found == CpuQuota(cores=1.5, group=job, usage=None)
    assert found.counter()() == pytest.approx(time.process_time(), abs=0.5)
    # no quota anywhere, or no cpu controller at all
    for group in (job, rank):
        (group / "cpu.cfs_quota_us").write_text("-1\n")
    assert find_cpu_quota("2:cpu:/job/rank0\n", root=tmp_path) is None
    assert find_cpu_quota("2:memory:/job\n", root=tmp_path) is None


def test_a_cpu_quota_and_its_usage_are_read_from_cgroup_v2(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    pod = tmp_path / "kubepods" / "pod1"
    pod.mkdir(parents=True)
    (tmp_path / "kubepods" / "cpu.max").write_text("max 100000\n")
    (pod / "cpu.max").write_text("25000 100000\n")
    (pod / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n")
    found = find_cpu_quota("0::/kubepods/pod1\n", root=tmp_path)
    assert found == CpuQuota(cores=0.25, group=pod, usage=pod / "cpu.stat")
    assert found.counter()() == 1.5
    (pod / "cpu.stat").unlink()  # an unreadable counter is no reading, not the process's CPU time instead
    assert math.isnan(found.counter()())
    (pod / "cpu.max").write_text("max 100000\n")
    assert find_cpu_quota("0::/kubepods/pod1\n", root=tmp_path) is None


def test_step_clock_charges_each_step_the_cpu_time_of_its_quota_and_keeps_the_least_wait(tmp_path):
    usage = tmp_path / "cpuacct.usage"
    usage.write_text("0")
    t = ManualTime()
    clock = StepClock(timer=t, cpu_quota=CpuQuota(cores=0.5, group=tmp_path, usage=usage))
    for used_ns, wait in ((0.012e9, 0.02), (0.032e9, 0.004), (0.042e9, 0.03)):
        clock.data_start()
        t.advance(0.01)
        clock.data_end(32)
        usage.write_text(str(int(used_ns)))  # CPU charged to the group during the step
        t.advance(0.05)
        clock.bucket_ready(1000)
        t.advance(wait)
        clock.backward_end()
        clock.step_end()
    summary = clock.summary()
    assert summary.cpu_time == pytest.approx(0.042 / 3)
    assert summary.cpu_quota == 0.5
    assert summary.least_sync_wait == pytest.approx(0.004)
    assert summary.sync_wait == pytest.approx(0.018)
    worker = WorkerMetrics(rank=0, batch_size=32, cpu_time=summary.cpu_time, cpu_quota=summary.cpu_quota)
    assert worker.quota_step_time == pytest.approx(0.028)  # the least a step can take at half a core
    assert math.isnan(WorkerMetrics(rank=0, batch_size=32, cpu_time=0.01).quota_step_time)
    # the bare transfer: the least single step's wait over the ranks, not the least mean wait
    waits = [
        WorkerMetrics(rank=r, batch_size=32, sync_wait=w, least_sync_wait=least)
        for r, (w, least) in enumerate([(0.018, 0.004), (0.012, 0.009)])
    ]
    assert ClusterState(workers=tuple(waits)).bare_transfer_time == pytest.approx(0.004)
    assert ClusterState(workers=(WorkerMetrics(rank=0, batch_size=32, sync_wait=0.012),)).bare_transfer_time == 0.012
    no_quota = StepClock(timer=t, cpu_quota=None)
    assert no_quota.cpu_quota is None
    assert math.isnan(no_quota.summary().cpu_quota)
