"""What ``dynamix bench elastic`` reads from a job's timeline: work lost, recovery times, time to accuracy."""

from __future__ import annotations

import argparse

import pytest

from lightning_dynamix.bench import elastic
from lightning_dynamix.bench.cluster import LocalElasticCluster


def timeline(*events):
    return [dict(zip(("event", "t", "world", "step"), e[:4]), **(e[4] if len(e) > 4 else {})) for e in events]


def test_a_restart_from_an_earlier_checkpoint_counts_the_steps_trained_again_and_the_time_to_catch_up():
    events = timeline(
        ("start", 0.0, 3, 0),
        ("step", 1.0, 3, 1),
        ("val", 1.5, 3, 1, {"accuracy": 0.5}),
        ("step", 2.0, 3, 2),
        ("step", 3.0, 3, 3),  # notice at 2.5; the group still trains step 3, then stops
        ("start", 10.0, 2, 1),  # resumed the checkpoint of step 1: steps 2 and 3 again
        ("step", 11.0, 2, 2),
        ("step", 12.0, 2, 3),
        ("step", 13.0, 2, 4),  # back at 13.5
        ("start", 20.0, 3, 4),
        ("step", 21.0, 3, 5),
        ("val", 21.5, 3, 5, {"accuracy": 0.9}),
    )
    result = elastic.summarise(events, {"notice": 2.5, "back": 13.5}, target=0.8)
    assert result["launches"] == [[3, 0], [2, 1], [3, 4]]
    assert result["steps_lost"] == 2
    assert result["notice_to_training"] == pytest.approx(11.0 - 2.5)
    assert result["notice_to_step_reached"] == pytest.approx(13.0 - 2.5)
    assert result["back_to_training_on_all"] == pytest.approx(21.0 - 13.5)
    assert result["time_to_target"] == pytest.approx(21.5 - 1.0)
    assert result["final_accuracy"] == 0.9
    assert result["seconds_to_end"] == pytest.approx(20.0)


def test_a_preemption_checkpoint_loses_no_step_and_a_job_that_misses_the_target_says_so():
    events = timeline(
        ("start", 0.0, 3, 0),
        ("step", 1.0, 3, 1),
        ("step", 2.0, 3, 2),  # notice at 1.5: saved at step 2
        ("start", 10.0, 2, 2),
        ("step", 11.0, 2, 3),
        ("start", 20.0, 3, 3),
        ("step", 21.0, 3, 4),
        ("val", 21.5, 3, 4, {"accuracy": 0.7}),
    )
    result = elastic.summarise(events, {"notice": 1.5, "back": 11.5}, target=0.8)
    assert result["steps_lost"] == 0
    assert result["notice_to_step_reached"] == pytest.approx(11.0 - 1.5)
    assert result["time_to_target"] is None


def test_per_step_fault_tolerance_loses_no_committed_step_and_its_pauses_are_the_waits_between_committed_steps():
    step = lambda t, world, n, node, failed=0: ("step", t, world, n, {"node": node, "failed": failed})  # noqa: E731
    events = timeline(
        ("start", 0.0, 3, 0, {"node": "a"}),
        step(1.0, 3, 1, "a"),
        step(1.01, 3, 1, "b"),  # every replica reports the step it committed: counted once
        step(2.0, 3, 2, "a"),
        step(3.0, 3, 3, "a"),  # notice at 3.2: the node dies in step 4, which a and b train again
        step(4.5, 2, 4, "a", failed=1),
        step(4.5, 2, 4, "b", failed=1),
        step(5.5, 2, 5, "a", failed=1),
        step(6.5, 2, 6, "a", failed=1),  # back at 6.6; its process starts, receives the state and joins
        step(7.5, 2, 7, "a", failed=1),
        step(9.0, 3, 8, "a", failed=1),
        step(10.0, 3, 9, "a", failed=1),
        ("val", 10.5, 1, 9, {"accuracy": 0.9, "node": "a"}),
    )
    result = elastic.summarise_replicas(events, {"notice": 3.2, "back": 6.6}, target=0.8, nodes=3)
    assert result["steps_lost"] == 0
    assert result["steps_trained_again"] == 1
    assert result["steps"] == 9
    assert result["launches"] == [[3, 0], [2, 3], [3, 8]]
    assert result["notice_to_training"] == pytest.approx(4.5 - 3.2)
    assert result["notice_to_step_reached"] == pytest.approx(4.5 - 3.2)
    assert result["pause_on_leave"] == pytest.approx(1.5)  # step 3 at 3.0 to step 4 at 4.5
    assert result["back_to_training_on_all"] == pytest.approx(9.0 - 6.6)
    assert result["pause_on_join"] == pytest.approx(1.5)  # step 7 at 7.5 to step 8 at 9.0
    assert result["median_step_seconds"] == pytest.approx(1.0)
    assert result["seconds_to_end"] == pytest.approx(9.0)
    assert result["time_to_target"] == pytest.approx(9.5)
    assert not result["back_after_the_end"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speeds", "3"], "--speeds must give at least 2"),
        (["--preempt-at", "3", "--back-at", "2"], "0 < --preempt-at < --back-at < --epochs"),
        (["--back-at", "9"], "0 < --preempt-at < --back-at < --epochs"),
        (["--rounds", "0"], "--rounds must be >= 1, got 0"),
        (["--heartbeat-timeout", "0"], "--heartbeat-timeout must be > 0 seconds, got 0.0"),
        (["--scenarios", "torchft", "--links", "0,0,50"], "--links is not supported with the torchft scenario"),
    ],
)
def test_bad_arguments_are_refused_before_any_job_starts(argv, message):
    parser = argparse.ArgumentParser()
    elastic.add_arguments(parser)
    with pytest.raises(SystemExit, match=message):
        elastic.run(parser.parse_args(argv))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("keep_alive_interval", 0),
        ("keep_alive_interval", 0.5),
        ("keep_alive_max_attempt", 0),
        ("keep_alive_max_attempt", True),
    ],
)
def test_the_local_cluster_refuses_a_keep_alive_torch_elastic_could_not_read(tmp_path, name, value):
    with pytest.raises(ValueError, match=rf"`{name}` must be an int >= 1, got {value!r}"):
        LocalElasticCluster(["job.py"], tmp_path, nnodes="2:3", **{name: value})
