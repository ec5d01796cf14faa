"""The best fixed split that ``dynamix bench balance --oracle`` measures controllers against."""

from __future__ import annotations

import pytest

from lightning_dynamix.bench.oracle import find_best_fixed_split, neighbour_splits


def affine_cluster(speeds, fixed=0.0):
    """Samples/s of a split when rank r takes ``fixed + size / speeds[r]`` s and a step waits for the slowest."""

    def measure(split):
        measure.calls.append(split)
        return sum(split) / max(fixed + size / speed for size, speed in zip(split, speeds, strict=True))

    measure.calls = []
    return measure


def test_neighbours_move_delta_samples_between_two_ranks_down_to_the_lower_bound_itself():
    assert sorted(neighbour_splits((4, 2), 2)) == [(2, 4), (5, 1)]  # rank 1 gives the one sample it can
    assert sorted(neighbour_splits((4, 1), 2)) == [(2, 3)]
    assert sorted(neighbour_splits((4, 1), 2, low=0)) == [(2, 3), (5, 0)]
    assert sorted(neighbour_splits((3, 3, 3), 1)) == sorted(
        [(2, 4, 3), (2, 3, 4), (4, 2, 3), (3, 2, 4), (4, 3, 2), (3, 4, 2)]
    )


@pytest.mark.parametrize(
    ("speeds", "expected"),
    [((1.0, 3.0), (16, 48)), ((1.0, 1.0), (32, 32)), ((1.0, 2.0, 5.0), (8, 16, 40))],
)
def test_the_search_finds_the_split_that_equalises_the_ranks_and_measures_each_split_once(speeds, expected):
    measure = affine_cluster(speeds)
    best, rate, measured = find_best_fixed_split(measure, 64, len(speeds))
    assert best == expected
    assert rate == pytest.approx(64 / (expected[0] / speeds[0]))
    # each split once in the search, then the three best once more
    searched = measure.calls[:-3]
    assert len(searched) == len(set(searched)) == len(measured)
    assert sorted(measure.calls[-3:]) == sorted(sorted(measured, key=measured.get)[-3:])
    assert all(sum(split) == 64 and min(split) >= 1 for split in measured)


def test_a_split_that_measured_lucky_once_is_not_chosen_over_the_best_measured_again():
    lucky = (17, 47)  # the best split is 16:48; its neighbour reads 10% high the first time it is measured

    def cluster():
        honest = affine_cluster((1.0, 3.0))

        def measure(split):
            first = split not in honest.calls
            return honest(split) * (1.1 if split == lucky and first else 1.0)

        return measure

    best, _, _ = find_best_fixed_split(cluster(), 64, 2, confirm=0)
    assert best == lucky  # the search alone keeps the lucky reading
    best, rate, _ = find_best_fixed_split(cluster(), 64, 2)
    assert best == (16, 48)
    assert rate == pytest.approx(4.0)


def test_a_rank_whose_one_sample_outlasts_the_others_step_is_left_at_the_bound_even_below_the_finest_move():
    def measure(split):  # rank 1 at 1 sample outlasts rank 0 at 512; at 0 it sits out
        step = max(0.002 + split[0] / 10_000, 0.0 if split[1] == 0 else 0.06 + split[1] / 1250)
        return sum(split) / step

    best, _, _ = find_best_fixed_split(measure, 512, 2, finest=8)
    assert best == (511, 1)
    best, _, _ = find_best_fixed_split(measure, 512, 2, finest=8, low=0)
    assert best == (512, 0)


def test_a_coarser_finest_step_stops_earlier_with_fewer_measurements():
    fine, coarse = affine_cluster((1.0, 3.0)), affine_cluster((1.0, 3.0))
    find_best_fixed_split(fine, 256, 2)
    best, _, _ = find_best_fixed_split(coarse, 256, 2, finest=8)
    assert len(coarse.calls) < len(fine.calls)
    assert abs(best[0] - 64) <= 8


def test_a_fixed_global_batch_scales_the_split_and_the_learning_rate_by_the_rule():
    from lightning_dynamix.bench.tta import fixed_global_batch

    assert fixed_global_batch((96, 32), 512, 0.1, "linear") == ((384, 128), pytest.approx(0.4))
    assert fixed_global_batch((96, 32), 512, 0.1, "sqrt") == ((384, 128), pytest.approx(0.2))
    # a fixed run measures no noise scale: adascale is its fallback, sqrt
    assert fixed_global_batch((96, 32), 512, 0.1, "adascale") == ((384, 128), pytest.approx(0.2))
    assert fixed_global_batch((96, 32), 128, 0.1, "none") == ((96, 32), 0.1)
    assert fixed_global_batch((127, 1), 16, 0.1, "none")[0] == (15, 1)  # every rank keeps a sample


def run_with_decisions(*decisions):
    """A bench run whose intervals made ``decisions``: ``(step, next sizes)`` each."""
    from lightning_dynamix.bench.harness import RunResult

    intervals = [{"step": step, "next_batch_sizes": list(sizes)} for step, sizes in decisions]
    return RunResult({}, 1.0, decisions[-1][0], 0, 1.0, None, 0.0, intervals=intervals)


def test_a_controller_settles_at_the_first_decision_within_two_percent_of_its_final_split():
    from lightning_dynamix.bench.balance import settled_at_step

    # 256 samples: 2% is 5.12 samples of a rank's share; 200:56 is 4 away from the final 204:52, 198:58 six
    run = run_with_decisions((10, (128, 128)), (20, (198, 58)), (30, (200, 56)), (40, (196, 60)), (50, (204, 52)))
    assert settled_at_step(run) == 30  # the first time within 2%, whether or not it stayed
    # shares, not sizes: a global batch that doubled on the final split's shares is settled
    assert settled_at_step(run_with_decisions((10, (100, 28)), (20, (150, 106)), (30, (200, 56)))) == 10
    assert settled_at_step(run_with_decisions((10, (128, 128)))) == 10  # a run that never moves
    assert settled_at_step(run_with_decisions((10, ()))) is None  # no decision
