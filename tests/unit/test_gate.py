"""Controllers that settle on the right split: a deviation that keeps its direction is followed, noise is not.

A virtual clock, as ``DynamixCallback`` measures: rank r's step takes ``(4 ms + c_r b_r)`` seconds times a factor
drawn uniformly in ``[0.8, 1.2]`` for each step, and each interval reports the mean of its 10 steps. Two ranks,
``c = 0.1`` and ``0.2`` ms a sample: a global batch of 256 balances at 170.7:85.3. Twenty seeds each; the counts the
gate before this one (commit f91ae78) gave on the same seeds are in the comments.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from itertools import pairwise

import pytest

from lightning_dynamix.control import BatchController, GoodputController, PIDController
from lightning_dynamix.control.ppo import PPOController
from lightning_dynamix.control.step_times import equal_time_sizes
from tests.unit.test_controllers import make_state

FIXED = (4e-3, 4e-3)
PER_SAMPLE = (1e-4, 2e-4)
SEEDS = range(20)

CONTROLLERS: dict[str, Callable[[], BatchController]] = {
    "pid": PIDController,
    "goodput": lambda: GoodputController(min_global_batch=256, max_global_batch=256),  # the split alone
    "ppo": lambda: PPOController(keep_global_batch=True),
}
controllers = pytest.mark.parametrize("name", list(CONTROLLERS))


def run(
    controller: BatchController, sizes: Sequence[int], per_sample: Sequence[float], intervals: int, rng: random.Random
) -> list[tuple[int, ...]]:
    """The split before each of ``intervals`` decisions and after the last."""
    history = [tuple(sizes)]
    for _ in range(intervals):
        times = [
            statistics.mean((a + c * b) * rng.uniform(0.8, 1.2) for _ in range(10))
            for a, c, b in zip(FIXED, per_sample, sizes)
        ]
        sizes = controller.decide(make_state(sizes, times)).batch_sizes
        history.append(tuple(sizes))
    return history


def balance(per_sample: Sequence[float], total: int = 256) -> list[float]:
    return equal_time_sizes(total, FIXED, per_sample, [1, 1], [None, None])


def step(sizes: Sequence[int], per_sample: Sequence[float]) -> float:
    return max(a + c * b for a, c, b in zip(FIXED, per_sample, sizes))


def settled(name: str, seed: int) -> tuple[BatchController, tuple[int, ...], random.Random]:
    """A controller after 40 intervals from the even split, where it ended, and the clock's generator."""
    rng = random.Random(seed)
    controller = CONTROLLERS[name]()
    return controller, run(controller, (128, 128), PER_SAMPLE, 40, rng)[-1], rng


def intervals_until_within(history: Sequence[tuple[int, ...]], per_sample: Sequence[float]) -> int | None:
    """Decisions until rank 0 is within 2% of the global batch of its balanced size (None: never)."""
    target = balance(per_sample)[0]
    return next((k for k, sizes in enumerate(history) if abs(sizes[0] - target) <= 0.02 * 256), None)


@controllers
def test_from_the_even_split_the_job_is_balanced_from_the_second_decision(name):
    # decision 1 moves on one interval's speeds (short where the step has a fixed cost); decision 2 on the step
    # model the two sizes give. Today's gate: pid and ppo held that second move in their dead band (median 5.4%)
    excess = []
    for seed in SEEDS:
        history = run(CONTROLLERS[name](), (128, 128), PER_SAMPLE, 2, random.Random(seed))
        excess.append(step(history[2], PER_SAMPLE) / step(balance(PER_SAMPLE), PER_SAMPLE) - 1)
    assert statistics.median(excess) <= 0.025, excess
    # what two intervals of +-20% steps can tell: a slope from two noisy sizes is off by a third in a few seeds
    assert sum(e <= 0.05 for e in excess) >= 16, excess


@controllers
def test_a_split_eight_percent_of_the_global_batch_off_balance_is_corrected_within_three_intervals(name):
    # rank 1 becomes slower per sample, by what puts the settled split 8% of the global batch off its new balance
    # (as 190:66 against 208:48 in the run that froze); today's gate: pid and ppo never corrected 4 of the 20
    taken = []
    for seed in SEEDS:
        controller, sizes, rng = settled(name, seed)
        low, high = 1.0, 4.0  # the slowdown factor, by bisection
        for _ in range(60):
            factor = (low + high) / 2
            low, high = (
                (factor, high)
                if balance((PER_SAMPLE[0], PER_SAMPLE[1] * factor))[0] - sizes[0] < 20.48
                else (low, factor)
            )
        slower = (PER_SAMPLE[0], PER_SAMPLE[1] * low)
        taken.append(intervals_until_within(run(controller, sizes, slower, 10, rng), slower))
    assert all(k is not None and k <= 3 for k in taken), taken


@controllers
def test_a_deviation_below_what_counts_as_a_change_is_followed_where_the_gate_before_froze(name):
    # rank 1 20% slower per sample: its step 16% longer, below the 25% that counts as a change, and the balance moves
    # by 4% of the global batch. Today's gate: pid and ppo never got within 2% in 9 of the 20 seeds (14 intervals)
    slower = (PER_SAMPLE[0], PER_SAMPLE[1] * 1.2)
    taken = []
    for seed in SEEDS:
        controller, sizes, rng = settled(name, seed)
        taken.append(intervals_until_within(run(controller, sizes, slower, 14, rng), slower))
    assert all(k is not None and k <= 12 for k in taken), taken
    assert statistics.median(taken) <= 5, taken  # type: ignore[type-var]


# moves over the second half of 60 intervals begun at the balance point (255 = 170:85 exactly), 20 seeds, with the
# gate before this one: pid 0, goodput 3, ppo 0
MOVES_BEFORE = {"pid": 0, "goodput": 3, "ppo": 0}


@controllers
def test_noise_alone_around_the_balance_point_moves_the_split_no_more_than_the_gate_before(name):
    moves = 0
    for seed in SEEDS:
        controller = CONTROLLERS[name]()
        if isinstance(controller, GoodputController):
            controller = GoodputController(min_global_batch=255, max_global_batch=255)
        history = run(controller, (170, 85), PER_SAMPLE, 60, random.Random(seed))
        moves += sum(1 for before, after in pairwise(history[30:]) if before != after)
    assert moves <= MOVES_BEFORE[name]


def test_right_after_a_change_a_flat_slope_moves_no_further_than_the_proportional_model():
    from lightning_dynamix.control.step_times import StepTimes

    # rank 1 on a core shared with a busy process: settled at 315:197, its step then 25 ms at 197 samples and at
    # 166 alike (its time barely grew with its batch); a slope from those two intervals says almost nothing
    times = StepTimes(8)
    for k in range(12):  # settled, with some noise measured
        times.observe([315, 197], [0.0193 * (1 + 0.02 * (-1) ** k), 0.0180 * (1 - 0.02 * (-1) ** k)])
    times.observe([315, 197], [0.0193, 0.0250])  # a suspect, then confirmed: rank 1 changed
    times.observe([315, 197], [0.0193, 0.0251])
    assert times.changed == [False, True]
    times.observe([346, 166], [0.0172, 0.0250])  # the first move after it
    assert times.settling
    fixed, per_sample = times.models()[1]  # type: ignore[misc]
    assert per_sample == pytest.approx(0.0250 / 166)  # proportional: the least move to balance, never an overshoot
    assert fixed == 0.0


@controllers
def test_a_controller_restored_mid_run_decides_as_the_one_that_kept_running(name):
    import json

    # what the gate has gathered (the intervals at the split, the CUSUMs, a suspect interval, the brackets) is
    # saved with the controller: a job resumed from a checkpoint moves its split as the uninterrupted one would
    slower = (PER_SAMPLE[0], PER_SAMPLE[1] * 1.2)
    for seed in range(5):
        original, sizes, rng = settled(name, seed)
        sizes = run(original, sizes, slower, 3, rng)[-1]  # the balance moved: deviations being measured
        for _ in range(6):
            saved = json.loads(json.dumps(original.state_dict()))
            restored = CONTROLLERS[name]()
            restored.load_state_dict(saved)
            clock = rng.getstate()
            ahead = run(original, sizes, slower, 3, rng)
            rng.setstate(clock)
            assert run(restored, sizes, slower, 3, rng) == ahead, (seed, ahead)
            sizes = ahead[-1]
