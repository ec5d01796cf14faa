"""The global schedule: how an epoch is cut into steps, the final step, size changes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dynamix.data import EpochSchedule, final_step_sizes, validate_batch_sizes


def reference_steps(num_samples, initial, changes, drop_last):
    """Walk the documented rule step by step: (cursor, sizes) of every step, and the sizes in force at the end."""
    world_size = len(initial)
    sizes, cursor, step, out = initial, 0, 0, []
    while True:
        sizes = changes.get(step, sizes)
        total, remaining = sum(sizes), num_samples - cursor
        if drop_last:
            if remaining < total:
                return out, sizes
            out.append((cursor, sizes))
            cursor += total
        elif remaining >= total + world_size:
            out.append((cursor, sizes))
            cursor += total
        else:
            out.append((cursor, final_step_sizes(sizes, remaining)))
            return out, sizes
        step += 1


sizes_lists = st.integers(1, 5).flatmap(lambda w: st.lists(st.integers(1, 7), min_size=w, max_size=w))


@given(sizes=sizes_lists, data=st.data())
def test_final_step_uses_every_remaining_sample_and_gives_each_rank_one(sizes, data):
    world_size, total = len(sizes), sum(sizes)
    remaining = data.draw(st.integers(world_size, total + world_size - 1))
    final = final_step_sizes(tuple(sizes), remaining)
    assert sum(final) == remaining
    assert all(f >= 1 for f in final)
    if remaining >= total:  # a merge: at most one extra sample per rank
        assert all(b <= f <= b + 1 for f, b in zip(final, sizes))
    else:  # a short tail: nobody above its own size
        assert all(f <= b for f, b in zip(final, sizes))


def test_final_step_extra_samples_go_to_the_largest_ranks_first():
    assert final_step_sizes((2, 8, 8, 1), 20) == (2, 9, 8, 1)
    assert final_step_sizes((2, 8, 8, 1), 21) == (2, 9, 9, 1)
    assert final_step_sizes((1, 3), 2) == (1, 1)
    assert final_step_sizes((4, 4), 4) == (2, 2)


@settings(max_examples=300)
@given(
    sizes=sizes_lists,
    data=st.data(),
    drop_last=st.booleans(),
)
def test_schedule_matches_the_documented_rule_under_random_changes(sizes, data, drop_last):
    world_size = len(sizes)
    num_samples = data.draw(st.integers(sum(sizes), sum(sizes) * 6 + world_size))
    schedule = EpochSchedule(num_samples, tuple(sizes), drop_last=drop_last)
    changes = {}
    for _ in range(data.draw(st.integers(0, 4))):
        step = data.draw(st.integers(0, len(schedule) + 1))
        new = tuple(data.draw(st.lists(st.integers(1, 7), min_size=world_size, max_size=world_size)))
        if sum(new) > num_samples:
            continue
        if schedule.change(step, new):
            changes = {k: v for k, v in changes.items() if k < step}
            changes[step] = new
        else:
            assert step >= len(reference_steps(num_samples, tuple(sizes), changes, drop_last)[0])
    expected, sizes_at_end = reference_steps(num_samples, tuple(sizes), changes, drop_last)
    assert len(schedule) == len(expected)
    assert [schedule.step_at(k) for k in range(len(schedule))] == expected
    in_force = tuple(sizes)
    for k in range(len(schedule)):  # the final step adjusts its sizes, the nominal ones are those set
        in_force = changes.get(k, in_force)
        assert schedule.nominal_batch_sizes_at(k) == in_force
    used = sum(sum(s) for _, s in expected)
    if drop_last:  # only the incomplete last global batch is skipped
        assert num_samples - used < sum(sizes_at_end)
    else:
        assert used == num_samples
    rebuilt = EpochSchedule.from_segments(num_samples, schedule.segments, drop_last=drop_last)
    assert [rebuilt.step_at(k) for k in range(len(rebuilt))] == expected


def test_change_past_the_end_of_the_epoch_is_refused_and_changes_nothing():
    schedule = EpochSchedule(20, (2, 2))
    assert len(schedule) == 5
    assert not schedule.change(5, (1, 1))
    assert len(schedule) == 5
    assert schedule.latest_batch_sizes == (2, 2)


def test_later_change_replaces_changes_scheduled_after_it():
    schedule = EpochSchedule(100, (2, 2))
    assert schedule.change(10, (4, 4))
    assert schedule.change(5, (1, 3))
    assert schedule.segments == [(0, (2, 2)), (5, (1, 3))]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([-1, 2], "ints >= 0"),
        ([0, 2], "min_batch_size=0 lets a rank sit steps out"),
        ([2, 2.5], "ints >= 0"),
        ([True, 2], "ints >= 0"),
        ("22", "one int per rank"),
        ([], "empty"),
        ([2, 2, 2], "world size is 2"),
        ([2, 9], r"\[1, 8\]"),
    ],
)
def test_bad_batch_sizes_are_named_with_their_value(value, message):
    with pytest.raises(ValueError, match=message) as info:
        validate_batch_sizes(value, world_size=2, max_batch_size=8)
    assert "`batch_sizes`" in str(info.value)
