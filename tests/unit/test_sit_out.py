"""Ranks that sit steps out (batch size 0): the schedule, the loader, the controllers and the probes."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from lightning_dynamix.control import Decision, GoodputController, PIDController, StaticController
from lightning_dynamix.data import EmptyBatch, HeterogeneousBatchSampler, HeterogeneousDataLoader, final_step_sizes
from lightning_dynamix.decisions import _PROBE_BUDGET, _PROBE_WAIT_FIRST, _PROBE_WAIT_MOST, DecisionMaker
from lightning_dynamix.distributed import (
    BucketNorms,
    SyncWindowWeighting,
    TrainingRanksGroups,
    WeightedAllReduceState,
    report_gradient_norms,
)
from lightning_dynamix.metrics.state import ClusterState, WorkerMetrics

ZERO_STEP_SECONDS = 0.001  # what a step costs a rank that sits it out


@pytest.mark.parametrize(
    ("sizes", "remaining", "expected"),
    [
        ((0, 3, 5), 11, (0, 4, 7)),  # extra samples only to the ranks that train
        ((0, 3, 5), 5, (0, 2, 3)),  # a short tail: one each, the rest in proportion to b - 1
        ((2, 0, 0), 3, (3, 0, 0)),  # more extra samples than ranks that train
    ],
)
def test_the_final_step_keeps_a_rank_that_sits_out_at_zero(sizes, remaining, expected):
    assert final_step_sizes(sizes, remaining) == expected


def test_every_sample_once_per_epoch_with_a_rank_going_to_zero_and_back():
    world, num_samples = 3, 200
    samplers = [HeterogeneousBatchSampler(num_samples, [4, 4, 4], rank=r, world_size=world) for r in range(world)]
    plan = {3: [0, 6, 6], 7: [0, 0, 9], 11: [5, 0, 2]}  # from step: sizes
    for epoch in range(2):
        batches: list[list[list[int]]] = [[] for _ in range(world)]
        iterators = [iter(s) for s in samplers]
        for sampler in samplers:
            sampler.set_epoch(epoch)
        iterators = [iter(s) for s in samplers]
        step = 0
        while True:
            if step in plan and epoch == 0:
                for sampler in samplers:
                    sampler.set_batch_sizes(plan[step], from_step=step)
            try:
                for r in range(world):
                    batches[r].append(next(iterators[r]))
            except StopIteration:
                break
            step += 1
        seen = [i for rank in batches for batch in rank for i in batch]
        assert sorted(seen) == list(range(num_samples))
        sizes = [tuple(len(batches[r][k]) for r in range(world)) for k in range(len(batches[0]))]
        if epoch == 0:
            assert sizes[3][0] == 0
            assert sizes[8][:2] == (0, 0)
            assert sizes[11][:2] == (5, 0)
        else:  # the next epoch starts with the latest sizes: rank 1 still out
            assert all(s[1] == 0 for s in sizes)


def test_the_loader_hands_a_rank_that_sits_out_an_empty_batch_also_from_workers():
    dataset = TensorDataset(torch.arange(20.0))
    sampler = HeterogeneousBatchSampler(dataset, [2, 2], rank=0, world_size=2, shuffle=False)
    sampler.set_batch_sizes([0, 4], from_step=2)
    loader = HeterogeneousDataLoader(dataset, sampler, num_workers=1)
    batches = list(loader)
    assert [len(b) if isinstance(b, EmptyBatch) else len(b[0]) for b in batches] == [2, 2, 0, 0, 0]
    assert all(isinstance(b, EmptyBatch) for b in batches[2:])
    assert loader.current_step == 4
    assert loader.current_batch_sizes == (0, 4)


def make_state(sizes: Sequence[int], times: Sequence[float], min_batch_size: int = 0) -> ClusterState:
    workers = tuple(
        WorkerMetrics(rank=r, batch_size=b, compute_time=t, data_time=0.0, step_time=max(times))
        for r, (b, t) in enumerate(zip(sizes, times))
    )
    return ClusterState(workers=workers, min_batch_size=min_batch_size)


def run_loop(
    decide,
    sizes: Sequence[int],
    fixed: Sequence[float],
    per_sample: Sequence[float],
    intervals: int,
    *,
    min_batch_size: int = 0,
    seed: int = 0,
) -> list[tuple[int, ...]]:
    """Closed loop: rank r's step takes ``fixed_r + per_sample_r * b_r`` seconds (+-3%), or next to nothing at 0."""
    rng = random.Random(seed)
    history = [tuple(sizes)]
    for _ in range(intervals):
        times = [
            (a + c * b) * (1 + rng.uniform(-0.03, 0.03)) if b > 0 else ZERO_STEP_SECONDS
            for a, c, b in zip(fixed, per_sample, sizes)
        ]
        sizes = decide(make_state(sizes, times, min_batch_size=min_batch_size), list(sizes))
        history.append(tuple(sizes))
    return history


def job_step_time(sizes: Sequence[int], fixed: Sequence[float], per_sample: Sequence[float]) -> float:
    return max(a + c * b for a, c, b in zip(fixed, per_sample, sizes) if b > 0)


# rank 2 is a straggler whose fixed cost per step alone is longer than the others' whole step
STRAGGLER_FIXED, STRAGGLER_PER_SAMPLE = [0.01, 0.01, 0.2], [0.001, 0.001, 0.008]
STRAGGLER = (STRAGGLER_FIXED, STRAGGLER_PER_SAMPLE)


def _goodput_on_the_straggler(**kwargs):
    controller = GoodputController(dead_band=0.02)

    def decide(state, current):
        return controller.decide(state).batch_sizes

    return run_loop(decide, [32, 32, 32], STRAGGLER_FIXED, STRAGGLER_PER_SAMPLE, intervals=6, **kwargs)


def test_goodput_sits_a_straggler_out_when_its_fixed_cost_alone_outlasts_the_others_step():
    history = _goodput_on_the_straggler()
    assert history[-1][2] == 0
    assert sum(history[-1]) == 96
    without_straggler = job_step_time([48, 48, 0], STRAGGLER_FIXED, STRAGGLER_PER_SAMPLE)
    # as fast as without the straggler, within the dead band
    reached = job_step_time(history[-1], STRAGGLER_FIXED, STRAGGLER_PER_SAMPLE)
    assert reached == pytest.approx(without_straggler, rel=0.02)
    # without min_batch_size=0 it must keep at least one sample there, and the job waits for it
    bounded = _goodput_on_the_straggler(min_batch_size=1)
    assert bounded[-1][2] == 1
    assert job_step_time(bounded[-1], STRAGGLER_FIXED, STRAGGLER_PER_SAMPLE) > 0.2


def test_a_rank_kept_out_is_probed_ever_less_often_and_comes_back_once_fast():
    maker = DecisionMaker(GoodputController(dead_band=0.02), "goodput", "none", "test")
    fixed, per_sample = list(STRAGGLER_FIXED), list(STRAGGLER_PER_SAMPLE)
    history = run_loop(
        lambda state, current: maker.propose(state, current).batch_sizes, [32, 32, 32], fixed, per_sample, 300
    )
    out = [k for k, sizes in enumerate(history) if sizes[2] == 0]
    probes = [k for k in range(1, len(history)) if history[k][2] > 0 and history[k - 1][2] == 0]
    assert out
    assert len(probes) >= 3
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps[0] >= _PROBE_WAIT_FIRST
    assert all(later >= earlier for earlier, later in itertools.pairwise(gaps))
    # still slow: out again within a few decisions
    assert all(any(sizes[2] == 0 for sizes in history[k + 1 : k + 5]) for k in probes if k + 5 <= len(history))
    # the straggler recovers (its neighbour left): the next probe brings it back for good
    fast = run_loop(
        lambda state, current: maker.propose(state, current).batch_sizes,
        history[-1],
        [0.01, 0.01, 0.01],
        [0.001, 0.001, 0.001],
        2 * 128,
    )
    assert fast[-1][2] >= 20
    assert all(sizes[2] > 0 for sizes in fast[-20:])


class KeepsRankTwoOut:
    """A controller that sends rank 2 back to 0 at once, whatever its probe measured."""

    def decide(self, state: ClusterState) -> Decision:
        return Decision((24, 24, 0))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def _probes_of_rank_two(fixed, per_sample, intervals):
    maker = DecisionMaker(KeepsRankTwoOut(), "stub", "none", "test")
    history = run_loop(
        lambda state, current: maker.propose(state, current).batch_sizes, [24, 24, 0], fixed, per_sample, intervals
    )
    probes = [k for k, sizes in enumerate(history) if sizes[2] > 0]
    assert all(history[k + 1][2] == 0 for k in probes if k + 1 < len(history))  # dropped at once
    return history, probes


def test_the_wait_before_the_next_cheap_probe_doubles_also_when_the_controller_drops_it_at_once():
    # rank 2 is as fast as the others: its probe costs the job nothing, the wait doubles up to its bound
    _, probes = _probes_of_rank_two([0.01, 0.01, 0.01], [0.001, 0.001, 0.001], 500)
    # the probe takes the place of the 8th decision at 0, then of the 16th, the 32nd...
    waits = [b - a - 1 for a, b in itertools.pairwise([0, *probes])]
    assert waits == [min(_PROBE_WAIT_FIRST * 2**i, _PROBE_WAIT_MOST) - 1 for i in range(len(waits))]
    assert len(waits) >= 5


def test_probes_that_hold_the_job_up_wait_long_enough_to_cost_it_at_most_the_budget():
    # the straggler's probe makes the job's step 7 times longer; after the first probe has shown that,
    # the probes take at most _PROBE_BUDGET of the job's time
    history, probes = _probes_of_rank_two(*STRAGGLER, 600)
    assert len(probes) >= 3
    assert probes[0] == _PROBE_WAIT_FIRST
    after_first = history[probes[0] + 1 :]
    times = [job_step_time(sizes, *STRAGGLER) for sizes in after_first]
    normal = job_step_time((24, 24, 0), *STRAGGLER)
    extra = sum(t - normal for t in times)
    assert extra <= _PROBE_BUDGET * sum(times)
    assert extra > 0.5 * _PROBE_BUDGET * sum(times)  # not much less either: the rank is still probed


def test_the_static_controller_keeps_a_rank_given_zero_samples_at_zero():
    # hand-chosen sizes with a rank out: nothing the static controller measures could bring it back, so a
    # probe would only cost the job (and its split would be kept for the rest of the run)
    maker = DecisionMaker(StaticController(), "static", "none", "test")
    history = run_loop(
        lambda state, current: maker.propose(state, current).batch_sizes, [32, 32, 0], *STRAGGLER, 3 * _PROBE_WAIT_MOST
    )
    assert set(history) == {(32, 32, 0)}


def test_pid_keeps_a_rank_that_sits_out_there_until_a_probe_measures_it():
    controller = PIDController()
    sizes = controller.decide(make_state([0, 48, 48], [ZERO_STEP_SECONDS, 0.05, 0.05], min_batch_size=0)).batch_sizes
    assert sizes == (0, 48, 48)


@pytest.mark.parametrize("controller", [PIDController, GoodputController], ids=["pid", "goodput"])
def test_a_rank_that_sat_out_and_reports_no_time_at_all_neither_stops_the_decisions_nor_its_probes(controller):
    # on a GPU a rank that sits out queues nothing: its step's first and last marks lie together (0 s). The
    # decisions go on (rank 0 slows down and is moved), and the sitting rank is still probed and brought back
    maker = DecisionMaker(controller(min_batch_size=0), "test", "none", "test")
    per_sample = [0.001, 0.001, 0.001]
    sizes, history = [12, 12, 0], []
    for k in range(3 * _PROBE_WAIT_FIRST):
        if k == 3:
            per_sample = [0.04, 0.001, 0.001]
        times = [c * b for c, b in zip(per_sample, sizes)]  # exactly 0.0 where b == 0
        workers = tuple(
            WorkerMetrics(rank=r, batch_size=b, compute_time=t, data_time=0.0, step_time=t)
            for r, (b, t) in enumerate(zip(sizes, times))
        )
        state = ClusterState(workers=workers, min_batch_size=0)
        assert state.is_finite()
        sizes = list(maker.propose(state, sizes).batch_sizes)
        history.append(tuple(sizes))
    assert history[5][0] < 12, "rank 0 slowed down and nothing moved"
    assert history[-1][2] > 0, "the rank kept out was never probed and brought back"


def test_a_rank_that_sat_out_a_window_reports_no_gradient_norms_of_its_own():
    """The noise scale needs each rank's own gradient: a rank without samples has none to report."""
    state = WeightedAllReduceState()
    state.norms = BucketNorms([torch.tensor(0.0)], [torch.tensor(4.0)])
    reported = []
    weighting = SyncWindowWeighting(rank=0)
    weighting.add_backward(0, (0, 8))
    report_gradient_norms(state, weighting, lambda *values: reported.append(values))
    assert reported == []
    assert state.norms.local == []  # cleared for the next synchronisation
    weighting = SyncWindowWeighting(rank=1)
    weighting.add_backward(0, (0, 8))
    state.norms = BucketNorms([torch.tensor(1.0)], [torch.tensor(1.0)])
    report_gradient_norms(state, weighting, lambda *values: reported.append(values))
    assert [(own, total) for _, own, _, total in reported] == [(8, 8)]


def test_the_groups_of_training_ranks_refuse_a_capacity_below_one():
    with pytest.raises(ValueError, match="`capacity` must be an int >= 1, got 0"):
        TrainingRanksGroups(capacity=0)


def test_a_group_of_training_ranks_not_prepared_by_every_rank_is_an_error_naming_its_ranks(
    isolated_process_group, tmp_path
):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    groups = TrainingRanksGroups(capacity=1)
    assert groups.prepare([3]) is None  # every rank trains: the default group serves
    with pytest.raises(RuntimeError, match=r"has no process group prepared for the training ranks \[0\]"):
        groups.group([2, 0])
    group = groups.prepare([2, 0], timedelta(seconds=5))
    assert groups.group([2, 0], timedelta(seconds=5)) is group
    assert group.size() == 1
    assert len(groups) == 1
    # its collectives wait at most the timeout given (the strategy's), not torch's 30 minutes
    assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=5)
