"""Controllers: closed-loop convergence on simulated clusters, bounds, the goodput search, lr rules, resume."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from itertools import pairwise

import pytest

from lightning_dynamix.control import (
    CONTROLLERS,
    LR_SCALING_RULES,
    BatchController,
    GoodputController,
    PIDController,
    StaticController,
    equal_time_split,
    fit_step_time,
    lr_scale,
    make_controller,
    split_in_proportion,
    validate_lr_scaling,
)
from lightning_dynamix.control.step_times import StepTimes
from lightning_dynamix.metrics.state import ClusterState, WorkerMetrics

NAN = float("nan")


def make_state(
    sizes: Sequence[int],
    times: Sequence[float],
    *,
    noise_scale: float = NAN,
    comm_time: float = NAN,
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
) -> ClusterState:
    workers = tuple(
        WorkerMetrics(rank=r, batch_size=b, compute_time=t, step_time=max(times), comm_time=comm_time)
        for r, (b, t) in enumerate(zip(sizes, times))
    )
    return ClusterState(
        workers=workers,
        gradient_noise_scale=noise_scale,
        min_batch_size=min_batch_size,
        max_batch_size=max_batch_size,
    )


def simulate(
    controller: BatchController,
    sizes: Sequence[int],
    per_sample: Sequence[float],
    *,
    fixed: Sequence[float] | None = None,
    intervals: int = 30,
    noise: float = 0.03,
    seed: int = 0,
    **state_kwargs: float,
) -> list[tuple[int, ...]]:
    """Closed loop: rank r's step takes ``(fixed_r + per_sample_r * b_r) * (1 +- noise)`` seconds."""
    rng = random.Random(seed)
    fixed = fixed if fixed is not None else [0.0] * len(sizes)
    history = [tuple(sizes)]
    for _ in range(intervals):
        times = [(a + c * b) * (1 + rng.uniform(-noise, noise)) for a, c, b in zip(fixed, per_sample, sizes)]
        sizes = controller.decide(make_state(sizes, times, **state_kwargs)).batch_sizes
        history.append(tuple(sizes))
    return history


def proportional(total: int, speeds: Sequence[float]) -> list[float]:
    return [total * s / sum(speeds) for s in speeds]


# --------------------------------------------------------------------------------------------------
# PID
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    ("sizes", "per_sample"),
    [([64, 64], [3e-3, 1e-3]), ([32, 32, 32, 32], [4e-3, 2e-3, 1e-3, 1e-3])],
    ids=["speeds-1:3", "speeds-1:2:4:4"],
)
def test_pid_reaches_speed_proportional_sizes_and_then_holds_them(sizes, per_sample, seed):
    history = simulate(PIDController(), sizes, per_sample, intervals=40, seed=seed)
    target = proportional(sum(sizes), [1 / c for c in per_sample])
    converged = history[4]
    assert all(abs(b - t) <= max(0.1 * t, 1.0) for b, t in zip(converged, target)), (converged, target)
    assert all(sum(h) == sum(sizes) for h in history)
    assert all(h == converged for h in history[4:]), "sizes moved inside the dead band"


def time_imbalance(sizes: Sequence[int], fixed: Sequence[float], per_sample: Sequence[float]) -> float:
    times = [a + c * b for a, c, b in zip(fixed, per_sample, sizes)]
    return max(times) / min(times) - 1


AFFINE_CLUSTERS = pytest.mark.parametrize(
    ("fixed", "per_sample"),
    [
        ([0.1, 0.1], [3e-3, 1e-3]),
        ([0.3, 0.3], [3e-3, 1e-3]),
        ([0.05, 0.1], [3e-3, 1e-3]),
        ([0.02, 0.02, 0.02], [2e-3, 1e-3, 1e-3]),
    ],
    ids=["fixed-half", "fixed-dominant", "unequal-fixed", "three-ranks"],
)


@pytest.mark.parametrize("seed", range(5))
@AFFINE_CLUSTERS
def test_pid_equalises_affine_step_times_within_a_few_intervals_then_holds(fixed, per_sample, seed):
    sizes = [64] * len(fixed)
    history = simulate(PIDController(), sizes, per_sample, fixed=fixed, intervals=40, seed=seed)
    assert time_imbalance(history[0], fixed, per_sample) > 0.3
    assert all(time_imbalance(h, fixed, per_sample) < 0.2 for h in history[4:]), history[:8]
    # at most two later corrections, each made on a deviation the gate measured (the first decisions overshoot where
    # the fixed cost dominates and a slope from two noisy intervals is off), then it holds
    assert len(set(history[4:])) <= 3, "sizes kept moving after convergence"
    assert len(set(history[-15:])) == 1
    assert all(sum(h) == sum(sizes) for h in history)


def arrival_state(sizes, compute, after_backward, transfer=0.002, min_batch_size=1):
    """Ranks that leave the all-reduce together: each arrives after its compute and its optimizer step."""
    arrival = [c + o for c, o in zip(compute, after_backward)]
    step = max(arrival) + transfer
    workers = tuple(
        WorkerMetrics(rank=r, batch_size=b, compute_time=c, sync_wait=step - a, step_time=step)
        for r, (b, c, a) in enumerate(zip(sizes, compute, arrival))
    )
    return ClusterState(workers=workers, min_batch_size=min_batch_size)


def test_step_time_observations_are_forgotten_when_the_rank_changed_not_when_its_batch_did():
    def affine(b):
        return 0.1 + 1e-3 * b

    # at 128 a proportional guess from 64 says 0.328 s, 44% off the 0.228 s measured: that is the fixed cost,
    # not a changed rank, so both stay and the fit finds it
    times = StepTimes(window=8)
    times.observe([64], [affine(64)])
    times.observe([128], [affine(128)])
    assert times.ranks == [[(64, affine(64)), (128, affine(128))]]
    assert fit_step_time(times.ranks[0]) == pytest.approx((0.1, 1e-3))
    # 50% slower than the fitted model predicts, at a size it has seen, once: a suspect, kept with the rest
    times.observe([128], [1.5 * affine(128)])
    assert times.ranks == [[(64, affine(64)), (128, affine(128)), (128, 1.5 * affine(128))]]
    assert times.suspect == [True]
    # slower again: the rank changed, its past is dropped, the suspect with it
    times.observe([128], [1.6 * affine(128)])
    assert times.ranks == [[(128, 1.6 * affine(128))]]
    assert times.suspect == [False]
    # once slower, then once faster: two intervals off on opposite sides confirm nothing
    times.observe([128], [3.0 * affine(128)])
    times.observe([128], [0.5 * affine(128)])
    assert len(times.ranks[0]) == 3
    assert times.suspect == [True]


def test_one_interval_of_noise_moves_pid_and_goodput_a_little_and_a_confirmed_change_at_once():
    # a rank descheduled for part of one interval (its arrival 3x late once) on a balanced, measured job: taken
    # for a changed rank (its past forgotten) it moved 337 -> 209 samples for one interval
    for controller in (PIDController(), GoodputController()):
        sizes, per_sample, fixed = (256, 256), [1e-4, 2e-4], [0.002, 0.002]
        for _ in range(10):
            sizes = controller.decide(
                arrival_state(sizes, [c * b for c, b in zip(per_sample, sizes)], fixed)
            ).batch_sizes
        settled = sizes
        noisy = [c * b for c, b in zip(per_sample, sizes)]
        noisy[0] *= 3
        once = controller.decide(arrival_state(sizes, noisy, fixed)).batch_sizes
        assert abs(once[0] - settled[0]) <= 0.15 * settled[0]
        twice = controller.decide(arrival_state(once, noisy, fixed)).batch_sizes  # the same again: it changed
        assert twice[0] < settled[0] * 0.7


def test_pid_balances_each_ranks_arrival_at_the_all_reduce_not_only_its_compute():
    # equal compute per sample, but rank 1's optimizer step and per-step work take 20 ms to rank 0's 2 ms:
    # equal arrivals need b0 - b1 = 180 (346:166); equal compute alone would keep 256:256
    pid, sizes = PIDController(), (256, 256)
    for _ in range(12):
        sizes = pid.decide(arrival_state(sizes, [1e-4 * b for b in sizes], [0.002, 0.02])).batch_sizes
    assert abs(sizes[0] - 346) <= 10
    assert sum(sizes) == 512


def test_pid_lands_on_the_split_its_fitted_fixed_and_per_sample_costs_give():
    # 100 ms fixed per step on both ranks, rank 1 three times slower per sample: equal steps at 384:128. The
    # plain law with its secant gain stops inside the dead band at 379:133; the model lands on it and holds. Its
    # first move is bounded (a slope from two intervals whose noise is not measured yet is taken as at least a
    # third of the proportional one); once the noise is measured (none) the slope stands, and the split lands
    # within the sample whose gain (0.3%) is not worth a move
    pid, sizes, history = PIDController(), (256, 256), []
    for _ in range(6):
        compute = [0.1 + 1e-4 * sizes[0], 0.1 + 3e-4 * sizes[1]]
        sizes = pid.decide(arrival_state(sizes, compute, [0.0, 0.0])).batch_sizes
        history.append(sizes)
    assert all(abs(b - 384) <= 1 for b, _ in history[2:]), history
    assert len(set(history[2:])) == 1, history
    models = pid.step_models()
    assert models is not None
    assert models[1] == pytest.approx((0.1, 3e-4))
    assert pid.predicted_step((384, 128)) == pytest.approx(0.1384)


@pytest.mark.parametrize(("low", "expected"), [(0, (128, 0)), (1, (127, 1))])
def test_pid_leaves_a_rank_whose_fixed_cost_outlasts_the_others_step_at_its_lower_bound(low, expected):
    # rank 1's fixed cost alone (100 ms) is four times rank 0's whole step with every sample (23 ms)
    pid, sizes, history = PIDController(), (64, 64), []
    for _ in range(8):
        compute = [0.01 + 1e-4 * sizes[0], 0.001 if sizes[1] == 0 else 0.1 + 8e-4 * sizes[1]]
        sizes = pid.decide(arrival_state(sizes, compute, [0.0, 0.0], min_batch_size=low)).batch_sizes
        history.append(sizes)
    assert history[2:] == [expected] * 6, history


@pytest.mark.parametrize("seed", range(5))
@AFFINE_CLUSTERS
def test_pid_without_adaptive_gain_converges_monotonically_on_affine_times(fixed, per_sample, seed):
    sizes = [64] * len(fixed)
    history = simulate(PIDController(adaptive_gain=False), sizes, per_sample, fixed=fixed, intervals=40, seed=seed)
    assert time_imbalance(history[-1], fixed, per_sample) < 0.05
    for rank in range(len(sizes)):  # every rank's size moves one way only: no oscillation
        steps = [h[rank] - g[rank] for g, h in pairwise(history) if h[rank] != g[rank]]
        # but for one sample that a measured deviation moves back between two equal ranks the first moves rounded apart
        steps = [s for s in steps if abs(s) > 1]
        assert all(s > 0 for s in steps) or all(s < 0 for s in steps), history


@pytest.mark.parametrize("seed", range(5))
def test_pid_noise_gate_holds_a_balanced_split_that_noise_alone_would_keep_moving(seed):
    # intervals that scatter by +-20% (a shared core): with neither gate nor dead band, the split at balance keeps
    # following the noise
    def second_half_spread(controller: PIDController) -> tuple[float, tuple[int, ...]]:
        history = simulate(
            controller,
            [128, 128],
            [1e-4, 2e-4],
            fixed=[4e-3, 4e-3],
            intervals=60,
            noise=0.2,
            seed=seed,
        )
        rank0 = [sizes[0] for sizes in history[30:]]
        return (max(rank0) - min(rank0)) / 256, history[-1]

    ungated, _ = second_half_spread(PIDController(noise_gate=None, dead_band=0.0))
    gated, final = second_half_spread(PIDController())
    assert ungated > 0.05
    assert gated <= 0.05
    # held near balance (4 + 0.1 b0 = 4 + 0.2 b1 ms at 170.7:85.3), within what +-20% intervals can tell apart: at
    # 3.5 standard errors an excess of 10% between the ranks (the slowest 5% long) takes about 30 intervals there
    slowest = max(4e-3 + 1e-4 * final[0], 4e-3 + 2e-4 * final[1])
    assert slowest <= 1.06 * (4e-3 + 1e-4 * 512 / 3)


@pytest.mark.parametrize("seed", range(5))
def test_pid_noise_gate_follows_a_real_change_once_the_next_interval_confirms_it(seed):
    controller = PIDController()
    settled = simulate(controller, [128, 128], [1e-4, 2e-4], fixed=[4e-3, 4e-3], intervals=30, noise=0.1, seed=seed)
    # rank 1 becomes twice as fast (a co-tenant left): balance moves from 171:85 to 128:128
    after = simulate(controller, settled[-1], [1e-4, 1e-4], fixed=[4e-3, 4e-3], intervals=15, noise=0.1, seed=seed)
    assert after[1] == settled[-1]  # the first such interval could be noise
    assert after[2][0] <= settled[-1][0] - 20  # the second confirms it: a move, ungated
    assert all(abs(sizes[0] - 128) <= 0.1 * 256 for sizes in after[4:])
    # then it holds, but for one correction of what the first move left, once measured beyond the noise
    assert len(set(after[6:])) <= 2


def test_step_time_scatter_is_each_ranks_relative_noise_about_its_model():
    times = StepTimes(8)
    assert times.scatter([64, 64]) is None  # no ranks seen
    times.observe([64, 0], [0.064, 0.0])
    assert times.scatter([64, 0]) == [None, 0.0]  # one observation: no degrees of freedom; a rank sitting out: none
    for t in (0.066, 0.062, 0.064):
        times.observe([64, 0], [t, 0.0])
    variance = times.scatter([64, 0])[0]
    # about their mean (the model at one size): relative deviations 0, +1/32, -1/32, 0 over 3 degrees of freedom
    assert variance == pytest.approx(2 * (1 / 32) ** 2 / 3, rel=1e-9)
    affine = StepTimes(8)
    for b in (32, 64, 96, 128):  # exact affine times: no scatter about the fitted model (2 degrees of freedom)
        affine.observe([b], [0.01 + 0.001 * b])
    assert affine.scatter([64])[0] == pytest.approx(0.0, abs=1e-20)


def test_pid_raises_the_global_batch_while_the_all_reduce_bounds_the_step_where_allowed_and_lowers_it_after():
    def decide(controller: PIDController, sizes: tuple[int, ...], transfer: float) -> tuple[tuple[int, ...], float]:
        decision = controller.decide(arrival_state(sizes, [1e-4 * b for b in sizes], [0.002, 0.002], transfer=transfer))
        return decision.batch_sizes, decision.lr_scale

    # two equal ranks at 128 each; a slow link: 0.1 s of all-reduce against 15 ms of work a step
    allowed = PIDController(max_global_batch_size=1024, lr_scaling="linear")
    kept = PIDController(lr_scaling="linear")
    sizes, scale = decide(allowed, (128, 128), transfer=0.1)
    assert sizes == (512, 512)
    assert scale == pytest.approx(4.0)
    assert decide(kept, (128, 128), transfer=0.1) == ((128, 128), 1.0)  # without it the global batch stays
    # the link recovers: 1 ms of all-reduce, well under a fifth of the step; back to the first global batch
    sizes, scale = decide(allowed, sizes, transfer=0.001)
    assert sizes == (128, 128)
    assert scale == pytest.approx(1.0)
    # in between: the global batch at which the all-reduce is a fifth of the step (work taken as proportional)
    sizes, _ = decide(PIDController(max_global_batch_size=4096), (128, 128), transfer=0.02)
    own = 0.0128 + 0.002
    assert sum(sizes) == round(256 * 0.02 * 0.8 / (0.2 * own))
    assert sizes[0] == sizes[1]  # equal ranks, an exact split of it


def test_pid_follows_a_change_of_speed_without_overshooting():
    controller = PIDController()
    history = simulate(controller, [64, 64], [3e-3, 1e-3], intervals=10, noise=0.0)
    assert history[-1] == (32, 96)
    # rank 0 becomes the fast one: the smoothed speeds lag, but no step goes past the new balance
    history = simulate(controller, history[-1], [1e-3, 3e-3], intervals=10, noise=0.0)
    assert all(h[0] <= 96 for h in history)
    assert history[-1] == (96, 32)


def test_pid_follows_a_sudden_slowdown_once_confirmed_but_averages_ordinary_noise():
    controller = PIDController()
    history = simulate(controller, [64, 64], [1e-3, 1e-3], intervals=5)
    assert history[-1] == (64, 64)
    # rank 1 becomes 3x slower: the first such interval is averaged in as possible noise, and the move it would
    # make (part of the way) is within what that interval's scatter explains, so the sizes hold; the second
    # confirms the change, and its speed, fallen by 2/3, lands on the new balance
    history = simulate(controller, history[-1], [1e-3, 3e-3], intervals=2, noise=0.0)
    assert history[1:] == [(64, 64), (96, 32)]
    # without the noise gate the first interval moves part of the way
    ungated = PIDController(noise_gate=None)
    history = simulate(ungated, [64, 64], [1e-3, 1e-3], intervals=5)
    assert simulate(ungated, history[-1], [1e-3, 3e-3], intervals=2, noise=0.0)[1:] == [(77, 51), (96, 32)]
    # one interval 40% slower is averaged with the past (a 29% drop in speed, under the threshold); taken alone
    # it would move the sizes by 17%, beyond the 10% dead band
    steady = PIDController()
    simulate(steady, [64, 64], [1e-3, 1e-3], intervals=5, noise=0.0)
    assert steady.decide(make_state([64, 64], [0.064, 0.064 * 1.4])).batch_sizes == (64, 64)
    assert PIDController(smoothing=0.0).decide(make_state([64, 64], [0.064, 0.064 * 1.4])).batch_sizes != (64, 64)


def test_pid_at_gain_one_moves_straight_to_sizes_proportional_to_measured_speed():
    controller = PIDController(dead_band=0.0)
    decision = controller.decide(make_state([50, 50], [0.2, 0.05]))
    assert decision.batch_sizes == (20, 80)
    assert decision.lr_scale == 1.0


def test_pid_keeps_sizes_exactly_inside_dead_band():
    controller = PIDController(dead_band=0.1)
    # speeds 100 and 106 samples/s: the balanced split is within 3% of the current one
    decision = controller.decide(make_state([50, 50], [0.5, 0.47]))
    assert decision.batch_sizes == (50, 50)


def test_pid_respects_per_rank_bounds_and_spreads_the_overflow():
    controller = PIDController(max_batch_size=80, dead_band=0.0)
    decision = controller.decide(make_state([64, 64], [0.192, 0.064]))  # speeds 1:3 -> 32:96 unbounded
    assert decision.batch_sizes == (48, 80)

    controller = PIDController(min_batch_size=[40, 1], dead_band=0.0)
    assert controller.decide(make_state([64, 64], [0.192, 0.064])).batch_sizes == (40, 88)

    # the state's own bound (e.g. memory) is intersected with the controller's
    controller = PIDController(max_batch_size=100, dead_band=0.0)
    decision = controller.decide(make_state([64, 64], [0.192, 0.064], max_batch_size=70))
    assert decision.batch_sizes == (58, 70)


def test_pid_honours_a_fixed_global_batch_and_scales_the_learning_rate():
    controller = PIDController(global_batch_size=200, lr_scaling="linear")
    decision = controller.decide(make_state([64, 64], [0.192, 0.064]))
    assert decision.batch_sizes == (50, 150)
    assert decision.lr_scale == pytest.approx(200 / 128)


def test_pid_gets_as_close_as_the_bounds_allow_to_an_impossible_global_batch():
    controller = PIDController(global_batch_size=1000, max_batch_size=100)
    assert controller.decide(make_state([64, 64], [0.192, 0.064])).batch_sizes == (100, 100)


def test_pid_max_change_caps_the_relative_step_per_interval():
    controller = PIDController(max_change=0.25, dead_band=0.0)
    decision = controller.decide(make_state([64, 64], [0.192, 0.064]))
    assert decision.batch_sizes == (48, 80)
    history = simulate(PIDController(max_change=0.25), [64, 64], [3e-3, 1e-3], intervals=10, noise=0.0)
    assert history[-1] == (32, 96)


def test_pid_integral_term_settles_on_balance_without_windup():
    controller = PIDController(ki=0.3)
    # a memory bound holds the fast rank back for a while
    held = simulate(controller, [40, 40, 40], [4e-3, 4e-3, 1e-3], intervals=10, noise=0.0, max_batch_size=50)
    assert held[-1] == (35, 35, 50)
    # once it is lifted the sizes head for balance and stop there: no wound-up integral, no offset
    history = simulate(controller, held[-1], [4e-3, 4e-3, 1e-3], intervals=15, noise=0.0)
    assert all(h[2] <= 100 for h in history)
    assert len(set(history[-8:])) == 1
    assert all(abs(b - t) <= 0.1 * t for b, t in zip(history[-1], (20, 20, 80)))


def test_pid_returns_current_sizes_when_a_time_is_not_finite():
    controller = PIDController(dead_band=0.0)
    assert controller.decide(make_state([64, 64], [NAN, 0.1])).batch_sizes == (64, 64)
    assert controller.decide(make_state([64, 64], [0.0, 0.1])).batch_sizes == (64, 64)


# --------------------------------------------------------------------------------------------------
# splitting helpers
# --------------------------------------------------------------------------------------------------


def test_split_in_proportion_keeps_the_total_exactly_by_largest_remainders():
    assert split_in_proportion(100, [1, 1, 1], [1, 1, 1], [None, None, None]) == (34, 33, 33)
    assert split_in_proportion(10, [1, 2], [1, 1], [None, None]) == (3, 7)
    sizes = split_in_proportion(1001, [1.0, 2.7, 3.1, 0.2], [1] * 4, [None] * 4)
    assert sum(sizes) == 1001
    # overflow at a bound goes to the others in proportion to their weights
    assert split_in_proportion(100, [8, 1, 1], [1, 1, 1], [50, None, None]) == (50, 25, 25)
    # impossible totals: the closest the bounds allow
    assert split_in_proportion(5, [1, 1], [4, 4], [None, None]) == (4, 4)
    assert split_in_proportion(50, [1, 1], [1, 1], [10, 20]) == (10, 20)


def test_equal_time_split_equalises_affine_step_times():
    sizes = equal_time_split(200, alphas=[0.1, 0.0], betas=[1e-3, 1e-3], lower=[1, 1], upper=[None, None])
    assert sizes == (50, 150)  # 0.1 + 0.05 == 0.15
    assert equal_time_split(200, [0.0, 0.0], [3e-3, 1e-3], [1, 1], [None, None]) == (50, 150)


def test_fit_step_time_recovers_an_affine_model_and_falls_back_to_proportional():
    alpha, beta = fit_step_time([(32, 0.1 + 32e-3), (64, 0.1 + 64e-3), (128, 0.1 + 128e-3)])
    assert alpha == pytest.approx(0.1)
    assert beta == pytest.approx(1e-3)
    assert fit_step_time([(64, 0.128), (64, 0.128)]) == (0.0, pytest.approx(2e-3))


# --------------------------------------------------------------------------------------------------
# goodput
# --------------------------------------------------------------------------------------------------


def test_goodput_grows_the_global_batch_when_the_noise_scale_is_large():
    controller = GoodputController()
    decision = controller.decide(make_state([64, 64], [0.192, 0.064], noise_scale=1e6, comm_time=0.05))
    b0, b1 = decision.batch_sizes
    assert decision.global_batch > 128
    assert b1 / b0 == pytest.approx(3.0, rel=0.02)
    assert decision.lr_scale == pytest.approx(lr_scale("adascale", decision.global_batch, 128, 1e6))
    assert decision.lr_scale > 1.0


def test_goodput_keeps_the_base_batch_when_the_noise_scale_is_tiny():
    controller = GoodputController()
    decision = controller.decide(make_state([64, 64], [0.192, 0.064], noise_scale=1.0, comm_time=0.05))
    assert decision.batch_sizes == (32, 96)
    assert decision.lr_scale == 1.0


def test_goodput_only_rebalances_while_the_noise_scale_is_unknown():
    controller = GoodputController()
    decision = controller.decide(make_state([100, 20], [0.3, 0.02], comm_time=0.05))
    assert decision.batch_sizes == (30, 90)
    assert decision.lr_scale == 1.0


def test_goodput_stops_changing_once_at_its_optimum():
    controller = GoodputController()
    history = simulate(
        controller, [64, 64], [3e-3, 1e-3], fixed=[0.02, 0.02], intervals=20, noise_scale=500.0, comm_time=0.05
    )
    assert history[3] != history[0]
    assert len(set(history[5:])) == 1
    b0, b1 = history[-1]
    assert 0.02 + 3e-3 * b0 == pytest.approx(0.02 + 1e-3 * b1, rel=0.1)


def test_goodput_rebalances_after_a_rank_slows_down():
    controller = GoodputController()
    history = simulate(controller, [64, 64], [3e-3, 1e-3], fixed=[0.02, 0.02], intervals=6, comm_time=0.05)
    assert history[-1] == (32, 96)
    # the ranks swap speeds: the old observations no longer fit and are dropped
    history = simulate(controller, history[-1], [1e-3, 3e-3], fixed=[0.02, 0.02], intervals=6, comm_time=0.05)
    b0, b1 = history[-1]
    assert sum(history[-1]) == 128
    assert 0.02 + 1e-3 * b0 == pytest.approx(0.02 + 3e-3 * b1, rel=0.1)


def test_goodput_raises_the_global_batch_while_the_all_reduce_bounds_the_step_and_lowers_it_when_the_link_recovers():
    controller = GoodputController()
    kwargs = {"fixed": [0.01, 0.01], "intervals": 6, "noise_scale": 2000.0}
    fast = simulate(controller, [64, 64], [1e-3, 1e-3], comm_time=0.005, **kwargs)
    assert set(fast) == {(64, 64)}  # a fast link: the base batch is the best
    # the link slows 100x: fewer, larger steps, each rank's size still its share of the exact global batch
    slow = simulate(controller, fast[-1], [1e-3, 1e-3], comm_time=0.5, **kwargs)
    assert sum(slow[-1]) >= 4 * 128
    assert abs(slow[-1][0] - slow[-1][1]) <= 0.02 * sum(slow[-1])
    decision = controller.decide(make_state(slow[-1], [0.01 + 1e-3 * b for b in slow[-1]], noise_scale=2000.0,
                                            comm_time=0.5))  # fmt: skip
    assert decision.lr_scale == pytest.approx(lr_scale("adascale", decision.global_batch, 128, 2000.0))
    recovered = simulate(controller, slow[-1], [1e-3, 1e-3], comm_time=0.005, **kwargs)
    assert sum(recovered[-1]) <= 2 * 128


@pytest.mark.parametrize("seed", range(5))
def test_goodput_noise_gate_holds_a_split_that_noise_alone_would_keep_moving_and_follows_a_real_change(seed):
    # one global batch of 256 split between ranks whose intervals scatter by +-20% (a shared core)
    def moves_in_the_second_half(gate: float | None) -> int:
        controller = GoodputController(min_global_batch=256, max_global_batch=256, noise_gate=gate, dead_band=0.0)
        history = simulate(controller, [128, 128], [1e-4, 2e-4], fixed=[4e-3, 4e-3], intervals=60, noise=0.2, seed=seed)
        return sum(1 for before, after in pairwise(history[30:]) if before != after)

    assert moves_in_the_second_half(None) >= 4
    assert moves_in_the_second_half(GoodputController().noise_gate) <= 1
    # rank 1 becomes twice as fast: held one interval (it could be noise), then followed to the new balance
    controller = GoodputController(min_global_batch=256, max_global_batch=256)
    settled = simulate(controller, [128, 128], [1e-4, 2e-4], fixed=[4e-3, 4e-3], intervals=30, noise=0.1, seed=seed)
    after = simulate(controller, settled[-1], [1e-4, 1e-4], fixed=[4e-3, 4e-3], intervals=15, noise=0.1, seed=seed)
    assert after[2][0] <= settled[-1][0] - 20
    assert all(abs(sizes[0] - 128) <= 0.1 * 256 for sizes in after[4:])


def test_goodput_respects_global_and_per_rank_limits():
    controller = GoodputController(max_global_batch=300, max_batch_size=200)
    decision = controller.decide(make_state([64, 64], [0.192, 0.064], noise_scale=1e9, comm_time=0.05))
    assert decision.global_batch <= 300
    assert max(decision.batch_sizes) <= 200


# --------------------------------------------------------------------------------------------------
# static, registry, learning-rate rules
# --------------------------------------------------------------------------------------------------


def test_static_controller_never_changes_anything():
    controller = StaticController()
    state = make_state([10, 90], [1.0, 0.1], noise_scale=1e6)
    decision = controller.decide(state)
    assert decision.batch_sizes == (10, 90)
    assert decision.lr_scale == 1.0
    assert controller.state_dict() == {}


@pytest.mark.parametrize("name", ["static", "pid", "goodput"])
def test_make_controller_builds_every_registered_controller(name):
    controller = make_controller(name)
    assert isinstance(controller, CONTROLLERS[name])
    assert isinstance(controller, BatchController)


def test_make_controller_passes_arguments_through():
    controller = make_controller("pid", kp=0.5, dead_band=0.2)
    assert isinstance(controller, PIDController)
    assert (controller.kp, controller.dead_band) == (0.5, 0.2)


@pytest.mark.parametrize(
    ("rule", "expected"),
    [("none", 1.0), ("linear", 4.0), ("sqrt", 2.0), ("adascale", (1000 / 100 + 1) / (1000 / 400 + 1))],
)
def test_lr_scale_rules(rule, expected):
    assert lr_scale(rule, 400, 100, noise_scale=1000.0) == pytest.approx(expected)
    assert lr_scale(rule, 100, 100, noise_scale=1000.0) == 1.0


def test_adascale_limits_and_unknown_noise_scale():
    assert lr_scale("adascale", 400, 100, noise_scale=1e12) == pytest.approx(4.0)
    assert lr_scale("adascale", 400, 100, noise_scale=0.0) == pytest.approx(1.0)
    assert lr_scale("adascale", 400, 100, noise_scale=NAN) == pytest.approx(2.0)
    assert lr_scale("adascale", 100, 100, noise_scale=NAN) == 1.0
    assert set(LR_SCALING_RULES) == {"none", "linear", "sqrt", "adascale"}


# --------------------------------------------------------------------------------------------------
# bad arguments
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "argument"),
    [
        (lambda: make_controller("ppo2"), "name"),
        (lambda: PIDController(kp=0.0), "kp"),
        (lambda: PIDController(kp=-1.0), "kp"),
        (lambda: PIDController(ki=-0.1), "ki"),
        (lambda: PIDController(kd=math.nan), "kd"),
        (lambda: PIDController(smoothing=1.0), "smoothing"),
        (lambda: PIDController(dead_band=1.0), "dead_band"),
        (lambda: PIDController(restart_threshold=0.0), "restart_threshold"),
        (lambda: PIDController(dead_band=-0.1), "dead_band"),
        (lambda: PIDController(min_batch_size=-1), "min_batch_size"),
        (lambda: PIDController(max_batch_size=[8, 0]), "max_batch_size"),
        (lambda: PIDController(min_batch_size=64, max_batch_size=32), "min_batch_size"),
        (lambda: PIDController(min_batch_size=[8, 64], max_batch_size=[16, 32]), "min_batch_size"),
        (lambda: PIDController(global_batch_size=0), "global_batch_size"),
        (lambda: PIDController(max_change=0.0), "max_change"),
        (lambda: PIDController(lr_scaling="cubic"), "lr_scaling"),
        (lambda: PIDController(noise_gate=-1.0), "noise_gate"),
        (lambda: GoodputController(noise_gate=math.inf), "noise_gate"),
        (lambda: PIDController(max_global_batch_size=0), "max_global_batch_size"),
        (lambda: PIDController(global_batch_size=512, max_global_batch_size=256), "max_global_batch_size"),
        (lambda: PIDController(max_comm_share=1.0), "max_comm_share"),
        (lambda: GoodputController(min_global_batch=512, max_global_batch=256), "min_global_batch"),
        (lambda: GoodputController(window=1), "window"),
        (lambda: GoodputController(grid_points=1), "grid_points"),
        (lambda: GoodputController(dead_band=2.0), "dead_band"),
        (lambda: GoodputController(base_batch_size=0), "base_batch_size"),
        (lambda: validate_lr_scaling("cubic"), "lr_scaling"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(build, argument):
    with pytest.raises(ValueError, match=f"`{argument}`"):
        build()


def test_unknown_controller_message_lists_the_valid_names():
    with pytest.raises(ValueError, match="ppo2") as error:
        make_controller("ppo2")
    assert all(name in str(error.value) for name in ("static", "pid", "goodput"))


def test_per_rank_bounds_of_the_wrong_length_are_reported():
    controller = PIDController(min_batch_size=[1, 1, 1])
    with pytest.raises(ValueError, match="min_batch_size"):
        controller.decide(make_state([64, 64], [0.1, 0.1]))


# --------------------------------------------------------------------------------------------------
# resume
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda: PIDController(ki=0.2, kd=0.1, smoothing=0.7, dead_band=0.0),
        lambda: GoodputController(),
        StaticController,
    ],
    ids=["pid", "goodput", "static"],
)
def test_a_restored_controller_makes_the_same_next_decision(build):
    rng = random.Random(1)
    states = []
    sizes = [64, 64, 64]
    for _ in range(6):
        times = [(0.01 + c * b) * (1 + rng.uniform(-0.05, 0.05)) for c, b in zip([3e-3, 1e-3, 2e-3], sizes)]
        states.append(make_state(sizes, times, noise_scale=300.0, comm_time=0.02))
        sizes = [b + rng.randint(-8, 8) for b in sizes]
    original = build()
    for state in states[:-1]:
        original.decide(state)
    saved = json.loads(json.dumps(original.state_dict()))  # plain, JSON-able values
    restored = build()
    restored.load_state_dict(saved)
    assert restored.decide(states[-1]) == original.decide(states[-1])


# ---------------------------------------------------------------- a job resumed on another group of machines


def test_pid_regroup_keeps_the_speeds_of_machines_that_stay_and_gives_a_new_one_their_mean():
    pid = PIDController(smoothing=0.0)
    pid.decide(make_state([10, 10, 10], [1.0, 0.5, 0.25]))  # speeds 10, 20, 40 samples/s
    pid.regroup([2, 0])  # 3 -> 2: the machines of old ranks 2 and 0 stay, as new ranks 0 and 1
    assert pid.rank_speeds() == pytest.approx([40.0, 10.0])
    pid.regroup([1, None, 0])  # 2 -> 3: a machine joins as new rank 1
    assert pid.rank_speeds() == pytest.approx([10.0, 25.0, 40.0])
    with pytest.raises(ValueError, match="previous"):
        pid.regroup([0, 0, 1])


def test_pid_decides_after_a_regroup_from_the_first_interval_measured_on_the_new_group():
    pid = PIDController(smoothing=0.9, dead_band=0.0)
    for _ in range(3):
        pid.decide(make_state([10, 10, 10], [1.0, 0.5, 0.25]))
    pid.regroup([1, 0])
    # on the new group both machines now run at 20 samples/s: the split follows what was measured, not
    # the kept averages (which would move samples to the machine that used to be slow)
    decision = pid.decide(make_state([15, 15], [0.75, 0.75]))
    assert decision.batch_sizes == (15, 15)


def test_goodput_regroup_keeps_each_machines_observations():
    goodput = GoodputController()
    goodput.decide(make_state([10, 20], [1.0, 1.0]))
    goodput.regroup([None, 1, 0])
    speeds = goodput.rank_speeds()
    assert speeds == pytest.approx([15.0, 20.0, 10.0])


def test_ppo_regroup_carries_its_balancer_over():
    from lightning_dynamix.control import PPOController

    ppo = PPOController()
    state = make_state([10, 10], [1.0, 0.5], noise_scale=100.0)
    ppo.balancer.decide(state)
    ppo.regroup([1, None, 0])
    assert ppo.rank_speeds() == pytest.approx([20.0, 15.0, 10.0])


def test_decision_maker_maps_the_controller_state_by_machine_id():
    from lightning_dynamix.decisions import DecisionMaker

    saved = DecisionMaker(PIDController(smoothing=0.0), "pid", "none", "test")
    saved.join(["a", "b", "c"])
    saved.controller.decide(make_state([10, 10, 10], [1.0, 0.5, 0.25]))
    resumed = DecisionMaker(PIDController(), "pid", "none", "test")
    resumed.join(["c", "a"])  # before the checkpoint is loaded: the ids of this group
    resumed.load_state_dict(json.loads(json.dumps(saved.state_dict())))
    resumed.join(["c", "a"])
    assert resumed.regrouped_from == [2, 0]
    assert resumed.resume_weights() == pytest.approx([40.0, 10.0])
    unchanged = DecisionMaker(PIDController(), "pid", "none", "test")
    unchanged.load_state_dict(saved.state_dict())
    unchanged.join(["a", "b", "c"])
    assert unchanged.regrouped_from is None


def quota_state(sizes, per_sample, cpu_per_sample, cpu_fixed, quota, transfer=0.002):
    """Ranks whose wall-clock arrival is ``per_sample * b``; rank r under a CPU quota of ``quota[r]`` cores
    (NaN: none) spends ``cpu_fixed + cpu_per_sample * b`` CPU seconds per step, the all-reduce's included."""
    arrival = [c * b for c, b in zip(per_sample, sizes)]
    step = max(arrival) + transfer
    workers = tuple(
        WorkerMetrics(
            rank=r,
            batch_size=b,
            compute_time=a,
            sync_wait=step - a,
            step_time=step,
            cpu_time=f + c * b,
            cpu_quota=q,
            least_sync_wait=transfer,
        )
        for r, (b, a, c, f, q) in enumerate(zip(sizes, arrival, cpu_per_sample, cpu_fixed, quota))
    )
    return ClusterState(workers=workers)


@pytest.mark.parametrize("build", [PIDController, GoodputController])
def test_a_rank_under_a_cpu_quota_is_balanced_by_what_its_quota_allows_not_its_timed_arrival(build):
    # equal arrivals at 256:256, but rank 1 may use half a core and spends 4 ms + 60 us per sample of CPU
    # a step: it cannot step faster than twice that, whatever its timed parts say (its frozen time falls in
    # the all-reduce too). Equal steps: 1e-4 b0 = 2 (0.004 + 6e-5 b1) - 0.002 at b0 + b1 = 512: 306.5:205.5
    controller, sizes = build(), (256, 256)
    for _ in range(10):
        state = quota_state(sizes, [1e-4, 1e-4], [0.0, 6e-5], [0.0, 0.004], [math.nan, 0.5])
        sizes = controller.decide(state).batch_sizes
    assert abs(sizes[0] - 306.5) <= 6, sizes
    assert sum(sizes) == 512
    # without the quota the same timed arrivals are balanced as they are
    controller = build()
    state = quota_state((256, 256), [1e-4, 1e-4], [0.0, 6e-5], [0.0, 0.004], [math.nan, math.nan])
    assert controller.decide(state).batch_sizes == (256, 256)


def test_goodput_with_a_pinned_global_batch_splits_it_without_the_noise_scale_and_does_not_ask_for_it():
    pinned = GoodputController(min_global_batch=96, max_global_batch=96)
    assert not pinned.needs_gradient_noise_scale
    # the noise scale unknown and the current total off the pinned one: the pinned total is split all the same
    decision = pinned.decide(make_state([100, 20], [0.3, 0.02], comm_time=0.05))
    assert sum(decision.batch_sizes) == 96
    assert decision.batch_sizes[1] > decision.batch_sizes[0]
    assert GoodputController().needs_gradient_noise_scale
    assert GoodputController(min_global_batch=64, max_global_batch=128).needs_gradient_noise_scale


def test_the_callback_measures_the_noise_scale_only_where_the_controller_or_the_learning_rate_rule_reads_it():
    from lightning_dynamix import DynamixCallback

    pinned = {"min_global_batch": 64, "max_global_batch": 64}
    assert not DynamixCallback("goodput", controller_kwargs=pinned).measure_noise_scale
    assert DynamixCallback("goodput", controller_kwargs=pinned, lr_scaling="adascale").measure_noise_scale
    assert DynamixCallback("goodput").measure_noise_scale
    assert not DynamixCallback("ppo", controller_kwargs={"keep_global_batch": True}).measure_noise_scale
    assert DynamixCallback("ppo").measure_noise_scale
    assert DynamixCallback("ppo", controller_kwargs={"keep_global_batch": True}, finetune=True).measure_noise_scale
    assert not DynamixCallback("pid").measure_noise_scale
