"""HeterogeneousBatchSampler: one global schedule, exactly-once coverage, resizes, resume.

All ranks of a job are simulated in one process: one sampler per rank, advanced in lockstep,
every size change made on all of them at the same point, as the strategy does.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import IterableDataset, TensorDataset

from lightning_dynamix.data import HeterogeneousBatchSampler, HeterogeneousDataLoader
from lightning_dynamix.data.sampler import even_split


def make_samplers(num_samples, sizes, **kwargs):
    return [
        HeterogeneousBatchSampler(num_samples, sizes, rank=r, world_size=len(sizes), **kwargs)
        for r in range(len(sizes))
    ]


def run_epoch(samplers, resizes=(), stop_after=None):
    """Iterate all ranks in lockstep; ``resizes`` maps a step count to new sizes applied after it.

    Returns per-step lists of every rank's batch.
    """
    resizes = dict(resizes)
    iterators = [iter(s) for s in samplers]
    steps = []
    while stop_after is None or len(steps) < stop_after:
        batches = [next(it, None) for it in iterators]
        if all(b is None for b in batches):
            break
        assert None not in batches, "ranks disagree on the number of steps"
        steps.append(batches)
        if len(steps) in resizes:
            applied = {s.set_batch_sizes(resizes[len(steps)]) for s in samplers}
            assert len(applied) == 1
    return steps


def flatten(steps):
    return [i for batches in steps for batch in batches for i in batch]


world_sizes = st.integers(1, 4)


@st.composite
def jobs(draw, max_size=6):
    world_size = draw(world_sizes)
    sizes = draw(st.lists(st.integers(1, max_size), min_size=world_size, max_size=world_size))
    num_samples = draw(st.integers(sum(sizes), sum(sizes) * 5 + world_size))
    resizes = draw(
        st.dictionaries(
            st.integers(1, 12),
            st.lists(st.integers(1, max_size), min_size=world_size, max_size=world_size).filter(
                lambda s: sum(s) <= num_samples
            ),
            max_size=3,
        )
    )
    return num_samples, sizes, resizes


@settings(max_examples=150, deadline=None)
@given(job=jobs(), shuffle=st.booleans(), seed=st.integers(0, 3))
def test_every_index_exactly_once_per_epoch_under_random_resizes(job, shuffle, seed):
    num_samples, sizes, resizes = job
    samplers = make_samplers(num_samples, sizes, shuffle=shuffle, seed=seed)
    steps = run_epoch(samplers, resizes)
    assert sorted(flatten(steps)) == list(range(num_samples))
    assert all(len(batch) >= 1 for batches in steps for batch in batches)
    # __len__ is exact for the schedule that was followed, on every rank
    assert {len(s) for s in samplers} == {len(steps)}
    for k, batches in enumerate(steps):
        assert tuple(len(b) for b in batches) == samplers[0].batch_sizes_at(k)


@settings(max_examples=100, deadline=None)
@given(job=jobs())
def test_rank_slices_are_consecutive_in_rank_order_of_the_global_order(job):
    num_samples, sizes, resizes = job
    samplers = make_samplers(num_samples, sizes, shuffle=True, seed=7)
    steps = run_epoch(samplers, resizes)
    order = samplers[0].sampler.indices(0, num_samples)
    assert flatten(steps) == order


@settings(max_examples=100, deadline=None)
@given(job=jobs())
def test_drop_last_skips_only_an_incomplete_last_global_batch(job):
    num_samples, sizes, resizes = job
    samplers = make_samplers(num_samples, sizes, drop_last=True)
    steps = run_epoch(samplers, resizes)
    seen = flatten(steps)
    assert len(seen) == len(set(seen))
    assert num_samples - len(seen) < sum(samplers[0].schedule.latest_batch_sizes)
    for k, batches in enumerate(steps):  # only full steps
        assert (
            tuple(len(b) for b in batches)
            == samplers[0].schedule.segments[
                max(i for i, (start, _) in enumerate(samplers[0].schedule.segments) if start <= k)
            ][1]
        )


def test_len_is_known_before_iterating_and_sizes_change_from_the_next_step():
    samplers = make_samplers(100, [2, 6])
    assert len(samplers[0]) == 13  # 12 steps of 8, then a tail step of the 4 left
    steps = run_epoch(samplers, {3: [4, 4]})
    assert [len(b) for b in steps[2]] == [2, 6]
    assert [len(b) for b in steps[3]] == [4, 4]
    assert len(steps) == len(samplers[0]) == 13


def test_planned_samples_count_every_rank_up_to_the_epochs_end_under_a_pending_resize():
    sampler = make_samplers(103, [2, 6])[0]
    sampler.set_batch_sizes([4, 4], from_step=3)
    # steps 1, 2 at [2, 6], steps 3, 4 at [4, 4]: what an accumulation window over them will hold
    assert sampler.planned_samples(1, 5) == 8 + 8 + 8 + 8
    steps = len(sampler)  # 12 steps of 8, then a tail step of the 7 left
    assert steps == 13
    assert sampler.planned_samples(0, steps) == 103
    assert sampler.planned_samples(steps - 2, steps + 5) == 8 + 7  # capped at the epoch's end


def test_resize_at_the_last_step_applies_from_the_next_epoch():
    samplers = make_samplers(16, [2, 2])
    steps = run_epoch(samplers)
    applied = {s.set_batch_sizes([1, 3]) for s in samplers}
    assert applied == {len(steps)}
    assert [len(b) for b in steps[-1]] == [2, 2]
    for s in samplers:
        s.set_epoch(1)
    steps = run_epoch(samplers)
    assert [len(b) for b in steps[0]] == [1, 3]
    assert sorted(flatten(steps)) == list(range(16))


def test_epochs_reshuffle_deterministically_and_a_new_pass_starts_with_the_latest_sizes():
    a, b = make_samplers(40, [3, 5], seed=1), make_samplers(40, [3, 5], seed=1)
    first = run_epoch(a, {2: [4, 4]})
    assert first == run_epoch(b, {2: [4, 4]})
    for s in a:
        s.set_epoch(1)
    second = run_epoch(a)
    assert flatten(second) != flatten(first)
    assert sorted(flatten(second)) == list(range(40))
    assert all([len(x) for x in batches] == [4, 4] for batches in second[:-1])
    other_seed = make_samplers(40, [3, 5], seed=2)
    assert flatten(run_epoch(other_seed)) != flatten(first)


def test_a_step_already_produced_cannot_change():
    (sampler,) = make_samplers(30, [3])
    it = iter(sampler)
    next(it), next(it)
    with pytest.raises(ValueError, match="already produced"):
        sampler.set_batch_sizes([5], from_step=1)
    assert sampler.set_batch_sizes([5], from_step=4) == 4


@settings(max_examples=80, deadline=None)
@given(job=jobs(), data=st.data())
def test_resume_mid_epoch_continues_with_exactly_the_same_indices(job, data):
    num_samples, sizes, resizes = job
    reference = run_epoch(make_samplers(num_samples, sizes, seed=3), resizes)
    stop = data.draw(st.integers(0, len(reference) - 1))
    interrupted = make_samplers(num_samples, sizes, seed=3)
    done = run_epoch(interrupted, {k: v for k, v in resizes.items() if k <= stop}, stop_after=stop)
    states = [s.state_dict() for s in interrupted]
    resumed = make_samplers(num_samples, sizes, seed=3)
    for s, state in zip(resumed, states):
        s.load_state_dict(state)
    rest = run_epoch(resumed, {k - stop: v for k, v in resizes.items() if k > stop})
    assert done + rest == reference


def test_state_saved_after_the_last_step_resumes_at_the_next_epoch_with_the_latest_sizes():
    samplers = make_samplers(24, [2, 4])
    run_epoch(samplers)
    for s in samplers:
        s.set_batch_sizes([3, 3])  # decided at the end of epoch 0: applies from epoch 1
    states = [s.state_dict() for s in samplers]
    resumed = make_samplers(24, [2, 4])
    for s, state in zip(resumed, states):
        s.load_state_dict(state)
        assert s.epoch == 1
        iter(s)  # Lightning creates the iterator before it sets the new epoch
        s.sampler.set_epoch(1)
    steps = run_epoch(resumed)
    assert sorted(flatten(steps)) == list(range(24))
    assert [len(b) for b in steps[0]] == [3, 3]


@pytest.mark.parametrize(
    ("key", "value"), [("num_samples", 25), ("shuffle", False), ("seed", 9), ("drop_last", True), ("version", 99)]
)
def test_state_from_another_schedule_is_refused(key, value):
    (sampler,) = make_samplers(24, [4])
    state = sampler.state_dict()
    state[key] = value
    with pytest.raises(ValueError, match=key if key != "version" else "format version"):
        sampler.load_state_dict(state)


def global_batches(steps):
    """Each step's samples over all ranks, in rank order: the global batch whatever the number of ranks."""
    return [[i for batch in batches for i in batch] for batches in steps]


@settings(max_examples=200, deadline=None)
@given(job=jobs(), new_world=world_sizes, drop_last=st.booleans(), data=st.data())
def test_resume_on_another_number_of_ranks_trains_the_same_global_batches(job, new_world, drop_last, data):
    num_samples, sizes, resizes = job
    assume(num_samples >= new_world)
    kwargs = {"seed": 3, "drop_last": drop_last}
    reference = make_samplers(num_samples, sizes, **kwargs)
    expected = [run_epoch(reference, resizes)]
    for s in reference:
        s.set_epoch(1)
    expected.append(run_epoch(reference))
    stop = data.draw(st.integers(0, len(expected[0])), label="checkpoint after step")
    interrupted = make_samplers(num_samples, sizes, **kwargs)
    done = run_epoch(interrupted, {k: v for k, v in resizes.items() if k <= stop}, stop_after=stop)
    state = interrupted[0].state_dict()
    resumed = make_samplers(num_samples, [1] * new_world, **kwargs)
    left = num_samples - len(flatten(done))
    assume(min([sum(sizes), *map(sum, resizes.values())]) >= new_world)  # too small a global batch: below
    if 0 < left < new_world and stop < len(expected[0]) and not drop_last:
        with pytest.raises(ValueError, match="fewer than the"):
            resumed[0].load_state_dict(state)
        return
    for s in resumed:
        s.load_state_dict(state)
    # the decisions taken after the checkpoint: the same global batches over the new ranks
    later = {k - stop: even_split(sum(v), new_world) for k, v in resizes.items() if k > stop}
    rest = [] if stop == len(expected[0]) else run_epoch(resumed, later)
    for s in resumed:
        s.set_epoch(1)
    next_epoch = run_epoch(resumed)
    # every sample exactly once in every epoch, every rank at least one sample at every step
    assert sorted(flatten(done + rest)) == sorted(flatten(expected[0]))
    assert sorted(flatten(next_epoch)) == sorted(flatten(expected[1]))
    assert all(len(batch) >= 1 for batches in rest + next_epoch for batch in batches)
    # the same global batches as the uninterrupted job; with more ranks than it started with, a final
    # step smaller than their number joins the step before (documented)
    if new_world <= len(sizes) or drop_last:
        assert global_batches(done + rest) == global_batches(expected[0])
        assert global_batches(next_epoch) == global_batches(expected[1])


def test_resume_on_other_ranks_splits_the_global_batch_evenly_or_as_asked():
    samplers = make_samplers(60, [2, 3, 7])
    run_epoch(samplers, stop_after=2)
    state = samplers[0].state_dict()
    even = make_samplers(60, [1, 1])
    for s in even:
        s.load_state_dict(state)
    assert even[0].batch_sizes == (6, 6)
    assert [len(b) for b in run_epoch(even)[0]] == [6, 6]
    (asked,) = make_samplers(60, [1, 1], seed=0)[:1]
    asked.load_state_dict(state, split=lambda total: (total - 2, 2))
    assert asked.batch_sizes == (10, 2)
    with pytest.raises(ValueError, match="does not sum"):
        make_samplers(60, [1, 1])[0].load_state_dict(state, split=lambda total: (1, 1))
    too_many = make_samplers(60, [1] * 13)[0]
    with pytest.raises(ValueError, match="global batch of 12 samples"):
        too_many.load_state_dict(state)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"data_source": 5, "batch_sizes": [3, 3]}, "fewer than one global batch"),
        ({"data_source": 0, "batch_sizes": [1]}, ">= 1"),
        ({"data_source": _Stream(), "batch_sizes": [1]}, "iterable-style"),
        ({"data_source": object(), "batch_sizes": [1]}, "sized dataset"),
        ({"data_source": 10, "batch_sizes": [1, -1]}, "ints >= 0"),
        ({"data_source": 10, "batch_sizes": [0, 0]}, "at least one rank must train"),
        ({"data_source": 10, "batch_sizes": [1, 1, 1]}, "world size is 2"),
        ({"data_source": 10, "batch_sizes": [1, 1], "rank": 2}, r"\[0, 1\]"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs, message):
    kwargs.setdefault("rank", 0)
    kwargs.setdefault("world_size", 2)
    with pytest.raises(ValueError, match=message):
        HeterogeneousBatchSampler(**kwargs)


def test_rank_and_world_size_are_required_without_a_process_group():
    with pytest.raises(ValueError, match=r"torch\.distributed is not initialized"):
        HeterogeneousBatchSampler(10, [2])


# ---------------------------------------------------------------------- DataLoader workers
@pytest.mark.parametrize("num_workers", [0, 2])
@settings(max_examples=8, deadline=None)
@given(job=jobs(max_size=4))
def test_dataloader_with_workers_covers_every_index_once_and_resizes_from_the_agreed_step(job, num_workers):
    num_samples, sizes, resizes = job
    dataset = TensorDataset(torch.arange(num_samples))
    loaders = [
        HeterogeneousDataLoader(dataset, sampler, num_workers=num_workers)
        for sampler in make_samplers(num_samples, sizes, seed=5)
    ]
    iterators = [iter(loader) for loader in loaders]
    seen, count = [], 0
    while True:
        batches = [next(it, None) for it in iterators]
        if all(b is None for b in batches):
            break
        count += 1
        for loader, (batch,) in zip(loaders, batches):
            assert len(batch) == loader.current_batch_sizes[loader.batch_sampler.rank]
            assert loader.current_step == count - 1
            seen.extend(batch.tolist())
        if count in resizes:
            # the agreed step: the first one no rank has produced (workers prefetch ahead)
            agreed = max(loader.batch_sampler.next_step for loader in loaders)
            for loader in loaders:
                loader.batch_sampler.set_batch_sizes(resizes[count], from_step=agreed)
    assert sorted(seen) == list(range(num_samples))
    assert count == len(loaders[0])


def test_dataloader_state_is_the_position_trained_on_not_the_prefetched_one():
    dataset = TensorDataset(torch.arange(64))
    loaders = [HeterogeneousDataLoader(dataset, s, num_workers=2) for s in make_samplers(64, [2, 6], seed=1)]
    iterators = [iter(loader) for loader in loaders]
    for _ in range(3):
        for it in iterators:
            next(it)
    assert loaders[0].batch_sampler.next_step > 3  # workers have prefetched
    states = [loader.state_dict() for loader in loaders]
    assert {state["step"] for state in states} == {3}
    rest_expected = [[b.tolist() for (b,) in it] for it in iterators]
    resumed = [HeterogeneousDataLoader(dataset, s, num_workers=2) for s in make_samplers(64, [2, 6], seed=1)]
    for loader, state in zip(resumed, states):
        loader.load_state_dict(state)
    assert [[b.tolist() for (b,) in loader] for loader in resumed] == rest_expected


def test_an_iterator_still_producing_when_the_epoch_changes_fails_loudly():
    (sampler,) = make_samplers(40, [4])
    it = iter(sampler)
    next(it)
    sampler.sampler.set_epoch(1)  # what Lightning calls between epochs
    with pytest.raises(RuntimeError, match="create a new iterator after set_epoch"):
        next(it)
    assert sorted(i for batch in sampler for i in batch) == list(range(40))


@pytest.mark.parametrize("num_workers", [0, 2])
@settings(max_examples=6, deadline=None)
@given(job=jobs(max_size=4), data=st.data())
def test_dataloader_resume_under_random_resizes_continues_exactly(job, data, num_workers):
    """Stop anywhere, save every rank's loader state, resume in new loaders: same batches, once each."""
    num_samples, sizes, resizes = job
    dataset = TensorDataset(torch.arange(num_samples))

    def loaders():
        return [HeterogeneousDataLoader(dataset, s, num_workers=num_workers) for s in make_samplers(num_samples, sizes)]

    def run(group, start, stop=None):
        """Lockstep over all ranks from the (already consumed) step ``start``; resizes keyed by step count."""
        iterators, steps = [iter(loader) for loader in group], []
        while stop is None or start + len(steps) < stop:
            batches = [next(it, None) for it in iterators]
            if all(b is None for b in batches):
                break
            steps.append([b[0].tolist() for b in batches])
            if start + len(steps) in resizes:
                agreed = max(loader.batch_sampler.next_step for loader in group)
                for loader in group:
                    loader.batch_sampler.set_batch_sizes(resizes[start + len(steps)], from_step=agreed)
        return steps

    reference = run(loaders(), 0)
    stop = data.draw(st.integers(0, len(reference) - 1))
    first = loaders()
    done = run(first, 0, stop)
    states = [loader.state_dict() for loader in first]
    second = loaders()
    for loader, state in zip(second, states):
        loader.load_state_dict(state)
    rest = run(second, stop)
    assert done + rest == reference
    assert sorted(flatten(done + rest)) == list(range(num_samples))
