"""Property tests: any sequence of per-rank sizes, ranks sitting out (0) and coming back, on 2-4 ranks.

Hypothesis draws the first sizes and a sequence of decisions (after which training batch, which
sizes; about half of all sizes are 0), and an optimizer and set-up: under Lightning one where a
rank with no samples leaves the step (one step, one synchronisation) and ones where it must join
the all-reduce with a zero gradient (gradient accumulation, DDP's ``find_unused_parameters``);
under ``DynamixAccelerate`` a rank always joins with ``zero_loss()``. For every sequence: the run
ends (no hang: a collective waits at most the pool's process-group timeout of 60 s, and a task
that outlives its deadline fails the test), every rank ran the same steps, every sample was
trained exactly once per epoch, and every rank's parameters equal one process trained on the
concatenated global batches (float64, 1e-6). Each world size keeps one pool of rank processes
for all its sequences, shared with the other job scripts of the session (:mod:`tests.distributed.pool`).

The sequences are the same on every run (``derandomize``), so that CI never fails on a draw, and a
failing one is reported as drawn; set ``DYNAMIX_HYPOTHESIS=explore`` to draw new ones (5 times as
many) and shrink a failing one to its smallest.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from lightning_dynamix.distributed import MAX_TRAINING_GROUPS

pytestmark = pytest.mark.distributed

NUM_SAMPLES, EPOCHS, TIMEOUT = 40, 2, 60.0  # TIMEOUT: the pools' process groups' (tests/distributed/pool.py)
EXPLORE = os.environ.get("DYNAMIX_HYPOTHESIS") == "explore"
# sequences per world size and framework: 6 x 35 = 210 in a run
EXAMPLES = 175 if EXPLORE else 35
# (optimizer, accumulate_grad_batches, find_unused_parameters): the first two leave the all-reduce
LIGHTNING_SETUPS = [("sgd", 1, False), ("adam", 1, False), ("sgd", 2, False), ("adam", 1, True), ("adam", 3, False)]
ACCELERATE_SETUPS = [("sgd", 1), ("adam", 1), ("sgd", 2)]
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not EXPLORE,
    database=None,
    # a failing sequence is reported as drawn: shrinking it retries runs that may each wait out a timeout
    phases=list(Phase) if EXPLORE else [Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)


def sizes(world_size: int) -> st.SearchStrategy[list[int]]:
    """One size per rank, about half of them 0, at least one rank training."""
    size = st.one_of(st.just(0), st.integers(1, 6))
    return st.lists(size, min_size=world_size, max_size=world_size).filter(lambda s: sum(s) > 0)


def sequences(world_size: int) -> st.SearchStrategy[tuple[list[int], list[tuple[int, list[int]]]]]:
    """The first sizes, and decisions: the training batch after which each applies, and its sizes."""
    gaps = st.lists(st.tuples(st.integers(1, 3), sizes(world_size)), min_size=1, max_size=6)

    def at_batches(first_and_gaps):
        first, decisions = first_and_gaps
        plan, batch = [], -1
        for gap, decided in decisions:
            batch += gap
            plan.append((batch, decided))
        return first, plan

    return st.tuples(sizes(world_size), gaps).map(at_batches)


def check_like_one_process(
    job_helpers,
    results: list[dict],
    optimizer: str,
    accumulate: int,
    num_samples: int = NUM_SAMPLES,
    epochs: int = EPOCHS,
) -> None:
    steps = [r["steps"] for r in results]
    assert len({len(s) for s in steps}) == 1, "the ranks ran different numbers of steps"
    for epoch in range(epochs):
        seen = sorted(i for rank in steps for (e, _, indices) in rank if e == epoch for i in indices)
        assert seen == list(range(num_samples)), f"epoch {epoch} did not train every sample exactly once"
    expected, _ = job_helpers.reference_training(steps, num_samples, optimizer, accumulate)
    for rank, result in enumerate(results):
        worst = max((result["params"][k] - expected[k]).abs().max().item() for k in expected)
        assert worst <= 1e-6, f"rank {rank}: parameters differ from one process by {worst}"


def check_epoch_metrics(results: list[dict], num_samples: int = NUM_SAMPLES, epochs: int = EPOCHS) -> None:
    """Every rank ends every epoch with the exact reductions of jobs/sit_out_sequences.py's ``LoggingNet``."""
    n = num_samples
    expected = {"trained": 1.0, "every_rank": 1.0, "index_max": n - 1, "index_min": 0.0}
    expected.update(index_mean_epoch=(n - 1) / 2, samples=n, samples_metric=n)
    for rank, result in enumerate(results):
        assert len(result["epoch_metrics"]) == epochs
        for epoch, metrics in enumerate(result["epoch_metrics"]):
            assert metrics == pytest.approx(expected, abs=1e-9), f"rank {rank}, epoch {epoch}"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_lightning_any_sequence_of_sizes_with_zeros_trains_like_one_process(pools, job_helpers, world_size):
    pool = pools(world_size)

    @PROPERTY
    @given(sequence=sequences(world_size), setup=st.sampled_from(LIGHTNING_SETUPS), seed=st.integers(0, 3))
    def run(sequence, setup, seed):
        (first, plan), (optimizer, accumulate, find_unused) = sequence, setup
        results = pool.run(
            "sit_out_sequences", "lightning", first=first, plan=plan, optimizer=optimizer, accumulate=accumulate,
            find_unused_parameters=find_unused, num_samples=NUM_SAMPLES, epochs=EPOCHS, timeout=TIMEOUT, seed=seed,
        )  # fmt: skip
        check_like_one_process(job_helpers, results, optimizer, accumulate)
        check_epoch_metrics(results)
        # however many sets of training ranks the run saw, a process holds a bounded number of groups
        assert all(r["groups_held"] <= MAX_TRAINING_GROUPS for r in results)

    run()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_accelerate_any_sequence_of_sizes_with_zeros_trains_like_one_process(pools, job_helpers, world_size):
    pool = pools(world_size)

    @PROPERTY
    @given(sequence=sequences(world_size), setup=st.sampled_from(ACCELERATE_SETUPS), seed=st.integers(0, 3))
    def run(sequence, setup, seed):
        (first, plan), (optimizer, accumulate) = sequence, setup
        results = pool.run(
            "sit_out_sequences", "accelerate", first=first, plan=plan, optimizer=optimizer, accumulate=accumulate,
            num_samples=NUM_SAMPLES, epochs=EPOCHS, seed=seed,
        )  # fmt: skip
        check_like_one_process(job_helpers, results, optimizer, accumulate)

    run()


# the reported hang (3 ranks: rank 0 sits out, then rank 1 instead) and 4 ranks with two out at once, the
# sitting set changing three times; decided after training batch k, so applied from step k + 1 or later
REPORTED = {
    "3-ranks": ([2, 5, 3], [(2, [0, 6, 4]), (8, [3, 0, 7])]),
    "4-ranks": ([2, 5, 3, 4], [(1, [0, 0, 6, 4]), (4, [3, 0, 0, 7]), (7, [0, 5, 5, 0]), (10, [2, 2, 2, 2])]),
}


@pytest.mark.parametrize("name", REPORTED)
def test_the_sitting_set_changing_on_three_and_four_ranks_trains_like_one_process(pools, job_helpers, name):
    first, plan = REPORTED[name]
    results = pools(len(first)).run(
        "sit_out_sequences", "lightning", first=first, plan=plan, optimizer="sgd", accumulate=1,
        find_unused_parameters=False, num_samples=150, epochs=1, timeout=TIMEOUT, seed=1,
    )  # fmt: skip
    check_like_one_process(job_helpers, results, "sgd", 1, num_samples=150, epochs=1)
    check_epoch_metrics(results, num_samples=150, epochs=1)
    # the groups of training ranks wait for their members as long as the strategy's timeout says (other
    # strategies the pool's processes ran before made theirs with their own), never torch's 30 minutes
    assert all(TIMEOUT in r["group_timeouts"] and 1800.0 not in r["group_timeouts"] for r in results)
    steps = len(results[0]["steps"])
    sitting = [frozenset(r for r, rank in enumerate(results) if not rank["steps"][k][2]) for k in range(steps)]
    seen = [s for k, s in enumerate(sitting) if s and (k == 0 or s != sitting[k - 1])]
    decided = [frozenset(r for r, b in enumerate(sizes) if b == 0) for _, sizes in plan]
    assert [s for s in seen if s in decided] == [s for s in decided if s], "every decided set sat out, in order"


def test_pid_moves_the_sitting_rank_as_the_straggler_changes_and_the_job_finishes(pools, job_helpers):
    # each rank in turn is 40 times slower: pid sends it to 0 samples and, once a probe finds it fast
    # again, takes it back; the ranks that train keep changing (sets of training ranks never seen before).
    # Time is virtual (the job's VirtualCompute): what pid measures, and so decides, is the same on every run.
    schedule = [[0, 2, 40.0], [12, 2, 1.0], [30, 0, 40.0], [45, 0, 1.0], [60, 1, 40.0]]
    results = pools(3).run(
        "sit_out_sequences", "controller_moves_the_sitting_rank", num_samples=600, epochs=4, schedule=schedule,
        timeout=TIMEOUT,
    )  # fmt: skip
    steps = [r["steps"] for r in results]
    sitting = [frozenset(r for r in range(3) if not steps[r][k][2]) for k in range(len(steps[0]))]
    # decisions every 2 steps from step 4: the first one whose interval measured a slowdown sends the rank out
    # (rank 2 slow from the start, rank 0 from step 30, rank 1 from step 60)
    out_from = {rank: next(k for k, s in enumerate(sitting) if rank in s) for rank in range(3)}
    assert out_from == {2: 4, 0: 34, 1: 64}
    # a sitting rank is probed 8 decisions after it left; fast again by then, it stays
    back_from = {r: next(k for k in range(out_from[r], len(sitting)) if r not in sitting[k]) for r in (2, 0)}
    assert back_from == {2: 18, 0: 48}
    assert all(rank not in s for rank in (2, 0) for s in sitting[back_from[rank] : out_from[rank] + 30])
    assert all(1 in s for s in sitting[64:78])  # still slow when the job ends
    check_like_one_process(job_helpers, results, "sgd", 1, num_samples=600, epochs=4)  # decided by pid, still exact


def test_a_process_holds_at_most_capacity_groups_of_training_ranks_each_made_by_every_rank(pools):
    sets = [[0, 1], [1, 2], [0, 2], [0], [1], [2], [0, 1], [1, 2]]  # more sets than the 2 groups held
    results = pools(3).run("sit_out_sequences", "groups_bounded", sets=sets, capacity=2)
    for rank, result in enumerate(results):
        assert result["held"] == [1, 2, 2, 2, 2, 2, 2, 2]
        assert result["created"] == 8  # [0, 1] and [1, 2] were retired before they came back: made again
        # each group all-reduces over exactly its members
        assert result["sums"] == [float(sum(s)) if rank in s else None for s in sets]
