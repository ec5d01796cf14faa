"""Load that changes during a run: schedule entries, their checks, and a rank applying its own."""

from __future__ import annotations

import os
import re

import psutil
import pytest

from lightning_dynamix.bench import contention
from lightning_dynamix.bench.load import LoadChange, LoadSchedule, check_changes, parse_change


def test_changes_are_parsed_and_bad_ones_named():
    assert parse_change(100, 1, "busy+2") == LoadChange(100, 1, "busy", 2.0)
    assert parse_change(250, 1, "busy-2") == LoadChange(250, 1, "busy", -2.0)
    assert parse_change(5, 0, "quota=0.5") == LoadChange(5, 0, "quota", 0.5)
    assert parse_change(5, 0, "link=0") == LoadChange(5, 0, "link", 0.0)
    assert str(parse_change(250, 1, "busy-2")) == "250:1:busy-2"
    for bad in ("busy", "busy+0", "busy+x", "quota=0", "quota=2", "link=-1", "link=fast", "slow"):
        with pytest.raises(ValueError, match=re.escape(f"--schedule entry '3:1:{bad}'")):
            parse_change(3, 1, bad)


@pytest.mark.parametrize(
    ("entries", "mode", "links", "message"),
    [
        (["5:1:busy+1"], "emulate", False, "'5:1:busy\\+1': a busy change needs --contention busy"),
        (["5:1:quota=0.5"], "busy", False, "needs --contention quota"),
        (["5:1:link=10"], "busy", False, "needs --links"),
        (["5:2:link=10"], "emulate", True, "rank 2 is not one of the 2 ranks"),
        (["5:1:busy+1", "9:1:busy-2"], "busy", False, "'9:1:busy-2' stops more busy processes beside rank 1"),
    ],
)
def test_changes_this_run_cannot_make_are_refused(entries, mode, links, message):
    changes = [parse_change(int(s), int(r), c) for s, r, c in (e.split(":") for e in entries)]
    with pytest.raises(ValueError, match=message):
        check_changes(changes, mode, 2, links)


@pytest.mark.distributed
def test_a_co_tenant_arrives_beside_the_rank_on_its_cores_and_leaves():
    changes = [parse_change(3, 0, "busy+2"), parse_change(6, 0, "busy-1"), parse_change(4, 1, "busy+1")]
    schedule = LoadSchedule(changes, rank=0)  # rank 1's entry is not this rank's
    try:
        schedule.at_step(2)
        assert schedule.busy == []
        schedule.at_step(3)
        assert len(schedule.busy) == 2
        for process in schedule.busy:  # beside this rank: on its cores, a spin loop running
            assert psutil.Process(process.pid).cpu_affinity() == sorted(os.sched_getaffinity(0))
            assert process.poll() is None
        first, second = schedule.busy
        schedule.at_step(7)  # a step missed is applied late, not skipped
        assert schedule.busy == [first]
        assert second.poll() is not None
        assert [str(c) for c in schedule.applied] == ["3:0:busy+2", "6:0:busy-1"]
    finally:
        schedule.stop()
    assert first.poll() is not None  # the run's end stops the rest


def test_a_quota_changed_at_a_step_is_the_ranks_cgroup_quota():
    try:
        contention.check_cgroup_rights()
    except ValueError as error:
        pytest.skip(str(error))
    places = contention.plan("quota", [1, 2], cpus=[0, 1])
    with contention.Contention(places):
        quota = contention._group_file(0, "cpu.cfs_quota_us")
        assert quota.read_text().strip() == "-1"  # a rank at full speed has a group too, without a quota
        schedule = LoadSchedule([parse_change(5, 0, "quota=0.25")], rank=0)
        schedule.at_step(5)
        assert quota.read_text().strip() == "25000"
