"""A dataset stored in chunks: every rank reads whole chunks of its own, every sample once per epoch, resumable."""

from __future__ import annotations

import itertools

import pytest

from lightning_dynamix.data import ChunkLayout, HeterogeneousBatchSampler, StreamingView

CHUNKS = [50] * 39 + [37]  # 1987 samples in 40 chunks, the last one short
SAMPLES = sum(CHUNKS)


def samplers(world_size: int, sizes, chunk_sizes=CHUNKS, **kwargs) -> list[HeterogeneousBatchSampler]:
    return [
        HeterogeneousBatchSampler(SAMPLES, sizes, rank=r, world_size=world_size, chunk_sizes=chunk_sizes, **kwargs)
        for r in range(world_size)
    ]


def run(ranks: list[HeterogeneousBatchSampler], changes: dict[int, list[int]] | None = None, stop: int | None = None):
    """Every rank's batches, step by step, changing the sizes on every rank at the steps of ``changes``."""
    changes = changes or {}
    iterators = [iter(s) for s in ranks]
    steps = []
    while stop is None or ranks[0].next_step < stop:
        step = ranks[0].next_step
        if step in changes:
            for s in ranks:
                s.set_batch_sizes(changes[step])
        try:
            steps.append([next(it) for it in iterators])
        except StopIteration:
            break
    return steps


def flat(steps) -> list[int]:
    return [i for step in steps for batch in step for i in batch]


@pytest.mark.parametrize(
    ("world_size", "sizes", "changes"),
    [(2, [48, 16], {7: [20, 44], 15: [31, 33]}), (3, [30, 10, 24], {5: [2, 50, 12], 12: [40, 40, 1]})],
)
def test_every_sample_once_per_epoch_with_sizes_uneven_and_changing(world_size, sizes, changes):
    ranks = samplers(world_size, sizes)
    for epoch in range(2):
        for s in ranks:
            s.set_epoch(epoch)
        steps = run(ranks, changes)
        taken = flat(steps)
        assert sorted(taken) == list(range(SAMPLES))
        for step, batches in enumerate(steps):  # each rank its scheduled size
            assert [len(b) for b in batches] == list(ranks[0].batch_sizes_at(step))
    # the epochs read in other orders
    ranks = samplers(world_size, sizes)
    first = flat(run(ranks))
    for s in ranks:
        s.set_epoch(1)
    assert flat(run(ranks)) != first


def chunk_runs(layout: ChunkLayout, indices: list[int]) -> int:
    """How many times a rank reading ``indices`` in order opens a chunk (consecutive reads of one chunk: once)."""
    chunks = [layout.chunk_of(i) for i in indices]
    return sum(1 for k, c in enumerate(chunks) if k == 0 or c != chunks[k - 1])


def test_each_rank_reads_whole_chunks_of_its_own_in_proportion_to_its_size():
    # 48:16 of a global batch of 64: rank 0 reads three chunks for each of rank 1's; slices of one shuffled
    # order would have both ranks open nearly every chunk at nearly every step
    ranks = samplers(2, [48, 16])
    steps = run(ranks)
    layout = ranks[0].layout
    opened = [chunk_runs(layout, [i for step in steps for i in step[r]]) for r in range(2)]
    touched = [len({layout.chunk_of(i) for step in steps for i in step[r]}) for r in range(2)]
    assert touched[0] + touched[1] <= len(CHUNKS) + 2  # chunks are not split between ranks, but at the epoch's end
    assert opened == touched  # a rank never comes back to a chunk it left
    assert 28 <= touched[0] <= 32  # 3/4 of the 40 chunks, give or take the end
    plain = samplers(2, [48, 16], chunk_sizes=None)
    plain_steps = run(plain)
    plain_opened = [chunk_runs(layout, [i for step in plain_steps for i in step[r]]) for r in range(2)]
    assert min(plain_opened) > 10 * max(opened)


def test_a_faster_rank_that_takes_more_per_step_opens_more_chunks_as_it_goes():
    ranks = samplers(2, [32, 32])
    steps = run(ranks, {10: [56, 8]})
    layout = ranks[0].layout
    before = [len({layout.chunk_of(i) for step in steps[:10] for i in step[r]}) for r in range(2)]
    after = [len({layout.chunk_of(i) for step in steps[10:] for i in step[r]}) for r in range(2)]
    assert before[0] - 1 <= before[1] <= before[0] + 1
    assert after[0] > 5 * after[1]


@pytest.mark.parametrize(("saved_world", "resumed_world"), [(2, 2), (2, 3), (3, 2)])
def test_a_resume_mid_epoch_on_another_number_of_ranks_loses_and_repeats_nothing(saved_world, resumed_world):
    sizes = {2: [40, 24], 3: [30, 10, 24]}
    ranks = samplers(saved_world, sizes[saved_world])
    ranks[0].set_epoch(1)
    for s in ranks[1:]:
        s.set_epoch(1)
    before = run(ranks, {4: [s + 1 if r == 0 else s for r, s in enumerate(sizes[saved_world])]}, stop=9)
    state = ranks[0].state_dict(step=9)
    assert all(s.state_dict(step=9) == state for s in ranks[1:])  # every rank saves the same state
    resumed = samplers(resumed_world, sizes[resumed_world])
    for s in resumed:
        s.load_state_dict(state)
    after = run(resumed)
    taken = flat(before) + flat(after)
    assert sorted(taken) == list(range(SAMPLES))
    if saved_world == resumed_world:  # on as many ranks, the rest of the epoch is the uninterrupted run's
        again = samplers(saved_world, sizes[saved_world])
        for s in again:
            s.set_epoch(1)
        whole = run(again, {4: [s + 1 if r == 0 else s for r, s in enumerate(sizes[saved_world])]})
        assert after == whole[9:]
    # resumed with the saved state's epoch, the next one starts afresh and complete
    for s in resumed:
        s.set_epoch(2)
    assert sorted(flat(run(resumed))) == list(range(SAMPLES))


def test_a_step_split_anew_keeps_its_samples_and_the_epoch_stays_exact():
    ranks = samplers(2, [40, 24])
    iterators = [iter(s) for s in ranks]
    produced = [[next(it) for it in iterators] for _ in range(4)]  # step 3 is being trained when it does not fit
    for s in ranks:
        s.resplit(3, [10, 54])
    rebuilt = [[s.indices_at(3) for s in ranks]]
    assert [len(b) for b in rebuilt[0]] == [10, 54]
    assert sorted(flat(rebuilt)) == sorted(flat(produced[3:]))  # the step keeps its samples
    rest = [[next(it) for it in iterators] for _ in range(len(ranks[0]) - 4)]
    assert [len(b) for b in rest[0]] == [10, 54]
    taken = flat(produced[:3]) + flat(rebuilt) + flat(rest)
    assert sorted(taken) == list(range(SAMPLES))


def test_a_dataset_in_chunks_is_refused_with_what_would_be_valid():
    with pytest.raises(ValueError, match=r"`chunk_sizes` sum to 100 samples, but the dataset has 1987"):
        samplers(2, [8, 8], chunk_sizes=[50, 50])
    with pytest.raises(ValueError, match=r"`chunk_sizes` must hold ints >= 1.*got 0"):
        samplers(2, [8, 8], chunk_sizes=[0, *CHUNKS])
    with pytest.raises(ValueError, match="`group_by_length` and `chunk_sizes` cannot be combined"):
        samplers(2, [8, 8], group_by_length=4, lengths=[1] * SAMPLES)
    saved = samplers(2, [8, 8], chunk_sizes=None)[0].state_dict(step=0)
    with pytest.raises(ValueError, match=r"the saved sampler read None chunks .* this one 40"):
        samplers(2, [8, 8])[0].load_state_dict(saved)


class Numbers:
    """A dataset that can be indexed, with no chunks: the view keeps it as it is."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def test_a_view_reads_what_can_be_indexed_and_refuses_what_cannot():
    view = StreamingView(Numbers(10), chunk_sizes=[4, 6])
    assert (len(view), view[7], view.chunk_sizes) == (10, 7, (4, 6))
    assert StreamingView(Numbers(3)).chunk_sizes is None
    with pytest.raises(ValueError, match=r"`dataset` \(list\) has no length or cannot be indexed|cannot be indexed"):
        StreamingView(iter([1, 2]))
    with pytest.raises(ValueError, match=r"`dataset` \(Numbers\) holds no samples"):
        StreamingView(Numbers(0))
    with pytest.raises(ValueError, match=r"`chunk_sizes` sum to 9 samples, but the dataset has 10"):
        StreamingView(Numbers(10), chunk_sizes=[4, 5])


def test_chunks_read_in_their_own_order_when_asked_each_sample_still_once():
    ranks = samplers(2, [48, 16], shuffle_within_chunks=False)
    steps = run(ranks, {5: [20, 44]})
    assert sorted(flat(steps)) == list(range(SAMPLES))
    layout = ranks[0].layout
    for r in range(2):  # within a chunk a rank reads on in the chunk's order (until another rank takes its tail)
        mine = [i for step in steps for i in step[r]]
        same_chunk = [(a, b) for a, b in itertools.pairwise(mine) if layout.chunk_of(a) == layout.chunk_of(b)]
        assert sum(b == a + 1 for a, b in same_chunk) >= 0.98 * len(same_chunk)
    assert flat(run(samplers(2, [48, 16]))) != flat(steps)  # shuffled within chunks by default
    # the view carries the setting to the sampler, and a resume must keep it
    view = StreamingView(Numbers(SAMPLES), chunk_sizes=CHUNKS, shuffle_within_chunks=False)
    assert HeterogeneousBatchSampler(view, [8, 8], rank=0, world_size=2).layout.shuffle_within_chunks is False
    with pytest.raises(ValueError, match="the saved sampler had shuffle_within_chunks=False, this one True"):
        samplers(2, [8, 8])[0].load_state_dict(ranks[0].state_dict(step=3))
    with pytest.raises(ValueError, match="`shuffle_within_chunks` must be True or False, got 'no'"):
        StreamingView(Numbers(3), shuffle_within_chunks="no")
