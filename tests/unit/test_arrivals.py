"""Who waited for whom inside a step: clock offsets from stamped all-gathers, and arrivals split into waiting and
one's own time (lightning_dynamix.metrics.arrivals), on hand-made time lines; and the step clock's record of them."""

from __future__ import annotations

import pytest

from lightning_dynamix.metrics import StepClock
from lightning_dynamix.metrics.arrivals import clock_offsets, own_time_inside
from tests.unit.test_metrics import ManualTime


def test_offsets_come_from_the_tightest_rounds_whatever_each_rank_s_origin():
    # rank 1's clock reads 5 s more than rank 0's; a round takes 1 ms, and in one round rank 1 entered 4 ms late
    true = [(10.000, 10.001), (10.010, 10.011), (10.020, 10.025)]
    late = [(10.000, 10.001), (10.010, 10.011), (10.024, 10.025)]
    offsets = clock_offsets([true, [(b + 5.0, a + 5.0) for b, a in late]])
    assert offsets[0] == 0.0
    assert offsets[1] == pytest.approx(5.0, abs=1e-3)  # within half a round


def test_offsets_refuse_ranks_with_different_rounds():
    with pytest.raises(ValueError, match="the same rounds"):
        clock_offsets([[(0.0, 1.0)], []])


def test_the_last_to_arrive_waited_for_nobody_and_the_others_waited_for_it():
    # one step, two collectives. Rank 1 arrives 30 ms late at the first, then is descheduled inside it for 20 ms
    # after every rank arrived (the collective takes 1 ms more on both); rank 0 arrives 5 ms late at the second
    rank0 = [[(1.000, 1.051), (1.100, 1.101)]]
    rank1 = [[(1.030, 1.051), (1.095, 1.101)]]
    own, steps = own_time_inside([rank0, rank1], [0.0, 0.0])
    assert steps == 1
    # rank 0: 51 ms inside the first, 30 of them waiting; 1 ms inside the second, none waiting
    assert own[0] == pytest.approx(0.021 + 0.001)
    # rank 1: 21 ms inside the first, none waiting; 6 ms inside the second, 5 of them waiting
    assert own[1] == pytest.approx(0.021 + 0.001)


def test_clock_offsets_are_taken_out_before_arrivals_are_compared():
    rank0 = [[(1.000, 1.040)]]
    rank1 = [[(101.030, 101.040)]]  # its clock 100 s ahead: it arrived 30 ms after rank 0
    own, _ = own_time_inside([rank0, rank1], [0.0, 100.0])
    assert own == pytest.approx([0.010, 0.010])


def test_steps_whose_collectives_do_not_pair_up_are_left_out_and_none_that_pair_gives_none():
    # at step 1 rank 1 sat out (GlobalBatchNorm among the ranks that train): no collectives to compare
    rank0 = [[(1.0, 1.5)], [(2.0, 2.5)]]
    rank1 = [[(1.4, 1.5)], []]
    own, steps = own_time_inside([rank0, rank1], [0.0, 0.0])
    assert steps == 1
    assert own == pytest.approx([0.1, 0.1])
    assert own_time_inside([[[]], [[(1.0, 2.0)]]], [0.0, 0.0]) is None
    assert own_time_inside([rank0, rank1[:1]], [0.0, 0.0]) is None  # different steps: nothing to tell


def test_the_clock_keeps_each_step_s_collectives_before_the_gradients_on_the_host_s_time_line():
    t = ManualTime()
    clock = StepClock(timer=t)
    for step in range(2):
        clock.data_start()
        t.advance(0.01)
        clock.data_end(16 if step == 0 else 8)  # a new size: the means restart, the interval's collectives do not
        t.advance(0.02)
        clock.collective(t.now, t.now + 0.03)
        t.advance(0.03)
        t.advance(0.01)
        clock.backward_end()
        clock.collective(t.now, t.now + 0.002)  # after the gradients: not among them
        t.advance(0.002)
        clock.step_end()
    summary = clock.summary()
    assert summary.steps == 1
    assert len(summary.collectives) == 2
    ((arrival, release),) = summary.collectives[1]
    assert arrival == pytest.approx(100.072 + 0.03)
    assert release - arrival == pytest.approx(0.03)
    clock.reset_interval()
    assert clock.summary().collectives == ()


def test_a_clock_whose_intervals_nobody_gathers_keeps_only_the_latest_steps_arrivals():
    # the emulator alone enables the clock and never gathers: a long job must not keep every step's collectives
    from lightning_dynamix.metrics.timers import _MAX_INTERVAL_STEPS

    t = ManualTime()
    clock = StepClock(timer=t)
    for _ in range(_MAX_INTERVAL_STEPS + 10):
        clock.data_start()
        clock.data_end(4)
        clock.collective(t.now, t.now + 0.001)
        t.advance(0.002)
        clock.backward_end()
        clock.step_end()
    kept = clock.summary().collectives
    assert len(kept) == _MAX_INTERVAL_STEPS
    assert kept[-1][0][0] == pytest.approx(t.now - 0.002)  # the latest step's is among them
