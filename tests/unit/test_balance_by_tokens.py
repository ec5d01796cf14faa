"""Balance by tokens: each rank's work per step (a language model's token positions) is measured where the loader
counts it, and the controllers judge step times per unit of work, so their sizes do not follow the lengths drawn."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_dynamix import LabelTokens
from lightning_dynamix.batch_core import PerRankBatchCore
from lightning_dynamix.control import GoodputController, PIDController, PPOController
from lightning_dynamix.control.allocation import arrival_times
from lightning_dynamix.data import HeterogeneousBatchSampler
from lightning_dynamix.data.items import positions_of
from lightning_dynamix.data.language import IGNORE_INDEX, SyntheticTokenSequences, pad_sequences
from lightning_dynamix.metrics import ClusterState, StepClock, WorkerMetrics
from lightning_dynamix.rl import ClusterSimulator, Scenario

NAN = math.nan


def test_label_tokens_counts_a_batch_s_positions_and_its_padding():
    labels = torch.tensor([[5, 6, 7, IGNORE_INDEX], [1, 2, IGNORE_INDEX, IGNORE_INDEX]])
    assert LabelTokens().positions({"labels": labels}) == (8, 3)
    # a prompt masked out of the loss is not padding where the batch says what is (its attention mask)
    labels[0, 0] = IGNORE_INDEX
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert LabelTokens().positions({"labels": labels, "attention_mask": mask}) == (8, 3)
    assert LabelTokens(key=0).positions((labels,)) == (8, 4)


def test_a_counter_s_positions_are_checked():
    class Wrong:
        def __call__(self, batch):
            return 1

        def positions(self, batch):
            return (3, 5)

    assert positions_of(lambda batch: 1, None) is None  # a counter without positions: its items are the work
    with pytest.raises(ValueError, match=r"must return \(positions, padding\).* got \(3, 5\)"):
        positions_of(Wrong(), None)


def _loader_with_clock(count_items):
    data = SyntheticTokenSequences(12, min_length=2, max_length=9, seed=4)
    core = PerRankBatchCore("DynamixAccelerate", [3, 0], count_items=count_items, world_size=2, min_batch_size=0)
    loader = core.training_loader(DataLoader(data, batch_size=3, collate_fn=pad_sequences), 0, 2, "")
    clock = StepClock(cpu_quota=None)
    loader.step_clock = clock
    return loader, clock


def test_the_loader_hands_each_step_s_positions_and_padding_to_the_step_clock():
    loader, clock = _loader_with_clock(LabelTokens())
    positions = padding = 0
    for steps, batch in enumerate(loader, start=1):
        clock.step_end()
        assert clock.last_step.work == batch["labels"].numel()
        positions += batch["labels"].numel()
        padding += int((batch["attention_mask"] == 0).sum())
        if steps == 3:
            break
    summary = clock.summary()
    assert summary.work == pytest.approx(positions / 3)
    assert summary.padding == pytest.approx(padding / positions)
    assert 0 < summary.padding < 1


def test_a_counter_without_positions_makes_its_items_the_work_and_no_count_none():
    loader, clock = _loader_with_clock(lambda batch: int(batch["attention_mask"].sum()))
    batch = next(iter(loader))
    clock.step_end()
    assert clock.last_step.work == batch["attention_mask"].sum().item()
    assert math.isnan(clock.summary().padding)
    loader, clock = _loader_with_clock(None)
    next(iter(loader))
    clock.step_end()
    assert math.isnan(clock.summary().work)


def _state(*workers):
    return ClusterState(workers=tuple(WorkerMetrics(r, *w) for r, w in enumerate(workers)))


def test_times_are_judged_per_unit_of_work_where_every_rank_counted_it():
    # equal speeds, 0.01 s per token: rank 1 drew sequences twice as long, so its step took twice the time
    fields = ("batch_size", "data_time", "compute_time", "sync_wait", "step_time")
    a = dict(zip(fields, (8, 0.0, 0.8, 0.8, 1.6)), work=80.0, padding=0.25)
    b = dict(zip(fields, (8, 0.0, 1.6, 0.0, 1.6)), work=160.0, padding=0.5)
    state = ClusterState(workers=(WorkerMetrics(0, **a), WorkerMetrics(1, **b)))
    assert state.work_factors() == pytest.approx((1.5, 0.75))  # 120 positions per 8 samples on average
    assert state.padding == pytest.approx((80 * 0.25 + 160 * 0.5) / 240)
    even = state.at_mean_work()  # what a controller decides on
    assert arrival_times(even) == pytest.approx([1.2, 1.2])  # alike, as the ranks are
    assert [w.sync_wait for w in even.workers] == pytest.approx([0.0, 0.0])  # neither waits for the other
    assert [w.compute_time for w in even.workers] == pytest.approx([1.2, 1.2])
    assert even.observation()["ranks"][:, 2].tolist() == pytest.approx([0.0, 0.0])  # relative own speed
    assert even.at_mean_work() is even
    # one rank's work not counted: every time stands as measured
    unknown = replace(state, workers=(WorkerMetrics(0, **{**a, "work": NAN}), state.workers[1]))
    assert unknown.work_factors() == (1.0, 1.0)
    assert unknown.at_mean_work() is unknown


# two ranks 3:1 in speed, a step's samples alike in length (length-aware batching) and lengths spread widely:
# a rank's mean length over an interval is off by ~15 %; balanced, rank 0 holds 32 of 128 samples
_LENGTHS = Scenario(
    world_size=2, compute_per_sample=(0.003, 0.001), step_overhead=(0.002, 0.002), data_per_sample=(0.0, 0.0),
    memory_limit=(1000, 1000), gradient_bytes=1e6, bandwidth=1e9, length_spread=0.5, length_grouped=True,
    drift=0.0, jitter=0.01,
)  # fmt: skip


def _slow_rank_shares(controller, seed: int, count_work: bool) -> list[float]:
    simulator = ClusterSimulator(_LENGTHS, seed=seed)
    state, shares = simulator.reset(), []
    for _ in range(24):
        if not count_work:  # the control: the job's work not counted, times per sample as measured
            state = replace(state, workers=tuple(replace(w, work=NAN) for w in state.workers))
        sizes = controller.decide(state).batch_sizes
        shares.append(sizes[0] / sum(sizes))
        state, _ = simulator.run_interval(sizes)
    return shares[3:]


@pytest.mark.parametrize(
    "make",
    [PIDController, GoodputController, lambda: PPOController("default")],
    ids=["pid", "goodput", "ppo"],
)
def test_the_sizes_controllers_choose_do_not_follow_the_lengths_drawn(make):
    worst = max(abs(share - 0.25) for seed in range(3) for share in _slow_rank_shares(make(), seed, True))
    control = max(abs(share - 0.25) for seed in range(3) for share in _slow_rank_shares(make(), seed, False))
    assert worst <= 0.03, f"a share off the balanced 0.25 by {worst:.3f}"
    assert control > 0.05  # judged per sample, the split follows the lengths: the test can fail


def _padding(batches) -> float:
    positions = sum(batch["labels"].numel() for batch in batches)
    return sum(int((batch["attention_mask"] == 0).sum()) for batch in batches) / positions


def _epoch(core, data, rank):
    loader = core.training_loader(DataLoader(data, batch_size=4, collate_fn=pad_sequences), rank, 2, "")
    loader.batch_sampler.set_epoch(1)
    return list(loader)


@pytest.mark.parametrize("front_end", ["HeterogeneousDDPStrategy", "DynamixAccelerate"])
def test_batching_by_length_cuts_padding_and_still_trains_every_sample_once(front_end):
    data = SyntheticTokenSequences(300, seed=5)
    batches = {}
    for group in (None, 64):
        cores = [PerRankBatchCore(front_end, [5, 11], group_by_length=group, world_size=2) for _ in range(2)]
        batches[group] = [_epoch(core, data, rank) for rank, core in enumerate(cores)]
        seen = sorted(i for rank in batches[group] for batch in rank for i in batch["index"].tolist())
        assert seen == list(range(300))
    plain, grouped = (_padding([b for rank in batches[g] for b in rank]) for g in (None, 64))
    assert grouped < plain / 3  # 4-39 tokens at random: 40 % padding; groups of 4 steps: 10 %


def test_groups_sort_each_run_of_the_order_by_length_and_keep_it_random_across_groups():
    lengths = [int(v) for v in SyntheticTokenSequences(200, seed=6).lengths]
    sampler = HeterogeneousBatchSampler(200, [8, 8], rank=0, world_size=2, group_by_length=50, lengths=lengths)
    order = sampler.sampler.indices(0, 200)
    for start in range(0, 200, 50):
        group = [lengths[i] for i in order[start : start + 50]]
        assert group == sorted(group, reverse=True)
    other = HeterogeneousBatchSampler(200, [8, 8], rank=0, world_size=2, group_by_length=50, lengths=lengths)
    other.set_epoch(1)
    assert sorted(other.sampler.indices(0, 50)) != sorted(order[:50])  # another epoch, other groups


def test_batching_by_length_is_checked_and_resumes_only_into_the_same_grouping():
    data = SyntheticTokenSequences(40)
    with pytest.raises(ValueError, match=r"`group_by_length` must be None or an int >= 2, got 1"):
        PerRankBatchCore("DynamixAccelerate", [2, 2], group_by_length=1)
    with pytest.raises(ValueError, match=r"`lengths` must hold one length per sample \(40\), got 3"):
        HeterogeneousBatchSampler(data, [2, 2], rank=0, world_size=2, group_by_length=8, lengths=[1, 2, 3])
    with pytest.raises(ValueError, match=r"cannot read the length of sample 0 of list"):
        HeterogeneousBatchSampler([1.0] * 40, [2, 2], rank=0, world_size=2, group_by_length=8)
    saved = HeterogeneousBatchSampler(data, [2, 2], rank=0, world_size=2, group_by_length=8).state_dict()
    with pytest.raises(ValueError, match=r"saved sampler has group_by_length=8 but this one has group_by_length=None"):
        HeterogeneousBatchSampler(data, [2, 2], rank=0, world_size=2).load_state_dict(saved)
