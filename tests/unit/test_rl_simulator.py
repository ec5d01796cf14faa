"""The cluster simulator: the ClusterStates it produces and the training it models."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest

from lightning_dynamix.control import PIDController, StaticController
from lightning_dynamix.metrics import ClusterState
from lightning_dynamix.rl import ClusterSimulator, Scenario, ScenarioSpace, with_world_size


def two_ranks(**overrides) -> Scenario:
    """Rank 1 computes 3x slower than rank 0; no drift, no slowdowns, little jitter."""
    values = {
        "world_size": 2,
        "compute_per_sample": (1e-3, 3e-3),
        "step_overhead": (0.0, 0.0),
        "data_per_sample": (1e-4, 1e-4),
        "memory_limit": (1024, 1024),
        "gradient_bytes": 4e6,
        "bandwidth": 1e9,
        "initial_batch_size": 64,
        "jitter": 0.01,
        "drift": 0.0,
    }
    return Scenario(**{**values, **overrides})


def run(simulator: ClusterSimulator, sizes, intervals: int = 5):
    outcomes = [simulator.run_interval(sizes)[1] for _ in range(intervals)]
    return outcomes


def test_states_are_the_cluster_states_real_runs_produce():
    simulator = ClusterSimulator(two_ranks(), seed=0)
    state = simulator.reset()
    assert isinstance(state, ClusterState)
    assert state.batch_sizes == (64, 64)
    assert state.is_finite()
    assert state.step == 10  # one interval of interval_steps steps
    slow, fast = state.workers[1], state.workers[0]
    assert slow.compute_time == pytest.approx(3 * fast.compute_time, rel=0.05)
    # the fast rank waits for the slow one; the slow one only for the exposed transfer
    assert fast.sync_wait > slow.sync_wait > 0
    assert fast.step_time == slow.step_time
    # bytes over the ring's time: at 2 ranks the ring moves each byte once, so the link's bandwidth
    assert state.bandwidth == pytest.approx(1e9, rel=0.2)
    obs = state.observation()
    assert all(np.isfinite(v).all() for v in obs.values())


def test_sizes_in_proportion_to_speed_reach_the_ideal_and_equal_sizes_half_of_it():
    # static equal batches at speeds 1:3 reach n * min(s) / sum(s) = 2 * 1 / 4 of the ideal
    scenario = two_ranks(data_per_sample=(0.0, 0.0), gradient_bytes=0.0)
    equal = run(ClusterSimulator(scenario, 0), [64, 64])[-1]
    balanced = run(ClusterSimulator(scenario, 0), [96, 32])[-1]
    ideal = scenario.ideal_throughput([96, 32])
    assert balanced.samples / balanced.elapsed == pytest.approx(ideal, rel=0.05)
    assert (equal.samples / equal.elapsed) / scenario.ideal_throughput([64, 64]) == pytest.approx(0.5, rel=0.05)


def test_ring_allreduce_time_follows_world_size_bandwidth_and_latency():
    scenario = two_ranks(latency=1e-4)
    assert scenario.allreduce_time == pytest.approx(2 * 1 / 2 * 4e6 / 1e9 + 2 * 1e-4)
    eight = with_world_size(scenario, 8)
    assert eight.allreduce_time == pytest.approx(2 * 7 / 8 * 4e6 / 1e9 + 14e-4)
    assert with_world_size(scenario, 1).allreduce_time == 0.0
    slower_link = replace(scenario, bandwidth=1e8)
    assert slower_link.allreduce_time > 9 * scenario.allreduce_time


def test_a_slow_host_link_bounds_the_ring_and_its_step():
    scenario = two_ranks(latency=0.0)
    slow = replace(scenario, link_bandwidth=(1e9, 1e7))  # rank 1's host on a 100x slower link
    assert slow.allreduce_time == pytest.approx(2 * 1 / 2 * 4e6 / 1e7)
    assert slow.allreduce_time_at([1.0, 4.0]) == pytest.approx(slow.allreduce_time / 4)  # the link recovers
    # the fabric is a bound too: a host link faster than it changes nothing
    assert replace(scenario, link_bandwidth=(1e12, 1e12)).allreduce_time == pytest.approx(scenario.allreduce_time)
    assert with_world_size(slow, 4).link_bandwidth == (1e9, 1e7, 1e9, 1e7)
    fast_step = run(ClusterSimulator(scenario, 0), [64, 64])[-1]
    slow_step = run(ClusterSimulator(slow, 0), [64, 64])[-1]
    exposed = slow.allreduce_time * (1 - slow.overlap)
    assert slow_step.elapsed - fast_step.elapsed == pytest.approx(
        scenario.interval_steps * (exposed - scenario.allreduce_time * (1 - scenario.overlap)), rel=0.1
    )


def test_links_slow_down_and_recover_on_their_own_stream_leaving_the_speeds_as_they_were():
    still = two_ranks(drift=0.2, drift_time=1.0, latency=0.0)
    changing = replace(still, link_change_rate=0.5, link_change_duration=2.0, link_change_factor=(10.0, 10.0))
    a, b = ClusterSimulator(still, seed=4), ClusterSimulator(changing, seed=4)
    times = np.arange(0.0, 60.0, 0.25)
    np.testing.assert_array_equal([a.speed_multipliers(t) for t in times], [b.speed_multipliers(t) for t in times])
    links = np.array([b.link_multipliers(t) for t in times])
    assert set(np.round(links.ravel(), 6)) == {1.0, 0.1}  # slowed 10x, and back
    assert np.all(np.array([a.link_multipliers(t) for t in times]) == 1.0)
    slowed = next(t for t, row in zip(times, links) if row.min() < 1.0)
    normal = next(t for t, row in zip(times, links) if row.min() == 1.0)
    assert b.allreduce_time(slowed) == pytest.approx(10 * b.allreduce_time(normal), rel=1e-6)


def test_bad_link_values_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"`link_bandwidth` must hold one finite rate > 0 .* per rank \(2\)"):
        two_ranks(link_bandwidth=(1e9,))
    with pytest.raises(ValueError, match=r"`link_bandwidth`.*got \(1000000000.0, 0.0\)"):
        two_ranks(link_bandwidth=(1e9, 0.0))
    with pytest.raises(ValueError, match=r"`link_change_factor` must be \(low, high\) with 1 <= low <= high"):
        two_ranks(link_change_factor=(0.5, 2.0))
    with pytest.raises(ValueError, match="link_change_rate"):
        two_ranks(link_change_rate=-1.0)


def test_the_speed_trajectory_depends_on_time_and_seed_only_not_on_the_decisions():
    scenario = two_ranks(drift=0.2, drift_time=1.0, slowdown_rate=0.5, slowdown_duration=2.0)
    a, b = ClusterSimulator(scenario, seed=3), ClusterSimulator(scenario, seed=3)
    run(a, [64, 64], 30)
    run(b, [200, 10], 30)
    for t in (0.5, 1.0, 2.0, 3.0):
        np.testing.assert_array_equal(a.speed_multipliers(t), b.speed_multipliers(t))
    other = ClusterSimulator(scenario, seed=4)
    assert not np.array_equal(other.speed_multipliers(3.0), a.speed_multipliers(3.0))
    # slowdowns happen and end: some rank runs at <= 1/2 of its speed at some time, and at full speed later
    grid = np.array([a.speed_multipliers(t) for t in np.arange(0.0, 60.0, 0.25)])
    assert grid.min() < 0.55
    assert (grid > 0.6).all(axis=1).any()


def test_bigger_batches_train_more_samples_per_second_but_make_less_progress_per_sample():
    scenario = two_ranks(noise_scale_start=128.0, noise_scale_end=128.0)
    small = run(ClusterSimulator(scenario, 0), [32, 32])[-1]
    big = run(ClusterSimulator(scenario, 0), [512, 512])[-1]
    assert big.samples / big.elapsed > small.samples / small.elapsed
    assert big.progress / big.samples < 0.5 * small.progress / small.samples


def test_the_noise_scale_grows_as_the_loss_falls():
    scenario = two_ranks(convergence_samples=20_000.0)
    simulator = ClusterSimulator(scenario, 0)
    noise, loss = [simulator.noise_scale], [simulator.loss]
    for _ in range(30):
        simulator.run_interval([64, 64])
        noise.append(simulator.noise_scale)
        loss.append(simulator.loss)
    assert all(b < a for a, b in itertools.pairwise(loss))
    assert all(b > a for a, b in itertools.pairwise(noise))
    assert noise[0] < 2 * scenario.noise_scale_start
    assert noise[-1] > scenario.noise_scale_end / 2


def test_batches_beyond_the_noise_scale_lower_the_accuracy_training_can_reach():
    scenario = two_ranks(noise_scale_start=64.0, noise_scale_end=64.0, generalization_gap=0.03, initial_batch_size=32)
    small = ClusterSimulator(scenario, 0)
    big = ClusterSimulator(scenario, 0)
    for _ in range(50):
        small.run_interval([32, 32])
        big.run_interval([512, 512])
    assert small.accuracy_ceiling == pytest.approx(scenario.best_accuracy)
    # 1024 samples is 4 doublings beyond a noise scale of 64 (the first interval ran at the initial 64)
    assert scenario.best_accuracy - 0.03 * 4 < big.accuracy_ceiling < scenario.best_accuracy - 0.03 * 3.9


def test_a_batch_above_a_ranks_memory_is_counted_and_run_at_the_limit():
    simulator = ClusterSimulator(two_ranks(memory_limit=(1024, 100), has_gpu=False), 0)
    state, outcome = simulator.run_interval([64, 150])
    assert outcome.out_of_memory == (1,)
    assert outcome.batch_sizes == (64, 100)
    assert state.batch_sizes == (64, 100)
    assert state.workers[1].mem_util == pytest.approx(100.0)  # CPU-only scenarios report memory as mem_util


def test_the_pid_controller_balances_a_simulated_cluster_and_beats_static():
    scenario = two_ranks(convergence_samples=50_000.0)
    finish = {}
    for controller in (StaticController(), PIDController()):
        simulator = ClusterSimulator(scenario, 0)
        state = simulator.reset()
        for _ in range(200):
            state, outcome = simulator.run_interval(controller.decide(state).batch_sizes)
            if outcome.accuracy >= scenario.target_accuracy:
                break
        finish[type(controller).__name__] = (outcome.time, state.batch_sizes)
    assert finish["PIDController"][1][0] > 2 * finish["PIDController"][1][1]
    assert finish["PIDController"][0] < 0.8 * finish["StaticController"][0]


def test_sampled_scenarios_cover_the_space_the_policy_is_trained_on():
    space = ScenarioSpace()
    rng = np.random.default_rng(0)
    scenarios = [space.sample(rng) for _ in range(200)]
    sizes = {s.world_size for s in scenarios}
    assert min(sizes) == 1
    assert max(sizes) == 64
    ratios = [max(s.compute_per_sample) / min(s.compute_per_sample) for s in scenarios]
    assert max(ratios) > 4
    assert max(ratios) <= 8 + 1e-9
    bandwidths = [s.bandwidth for s in scenarios]
    assert max(bandwidths) / min(bandwidths) > 30
    assert any(s.slowdown_rate > 0 for s in scenarios)
    assert any(s.slowdown_rate == 0 for s in scenarios)
    # hosts on slow links, where the all-reduce bounds the step, and links that slow and recover
    slow = [s for s in scenarios if s.link_bandwidth is not None]
    assert 20 < len(slow) < 100
    assert max(s.allreduce_time / (min(s.compute_per_sample) * s.initial_batch_size) for s in slow) > 10
    assert min(min(s.link_bandwidth) for s in slow) < 1e7  # below 80 Mbit/s
    assert any(s.link_change_rate > 0 for s in scenarios)
    assert any(s.link_change_rate == 0 and s.world_size > 1 for s in scenarios)
    # a space without them draws the very scenarios it drew before they existed
    plain = ScenarioSpace(slow_link_probability=0.0, link_change_probability=0.0)
    first, again = space.sample(np.random.default_rng(1)), plain.sample(np.random.default_rng(1))
    assert replace(first, link_bandwidth=None, link_change_rate=0.0) == again
    for s in scenarios[:20]:
        state = ClusterSimulator(s, 0).reset()
        assert state.world_size == s.world_size
        assert state.is_finite()


def test_a_scenario_round_trips_through_plain_values():
    scenario = two_ranks(slowdown_factor=(2.0, 3.0))
    assert Scenario.from_dict(scenario.to_dict()) == scenario
    with pytest.raises(ValueError, match="unknown Scenario fields"):
        Scenario.from_dict({**scenario.to_dict(), "gpus": 2})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"compute_per_sample": (1e-3,)}, "`compute_per_sample` must hold one value per rank"),
        ({"compute_per_sample": (1e-3, -1.0)}, "`compute_per_sample` must be finite and > 0"),
        ({"memory_limit": (0, 10)}, "`memory_limit` must be ints >= 1"),
        ({"bandwidth": 0.0}, "`bandwidth` must be a finite number > 0"),
        ({"target_accuracy": 0.99, "best_accuracy": 0.9}, "`target_accuracy` must be a number in"),
        ({"slowdown_factor": (3.0, 2.0)}, "`slowdown_factor` must be"),
    ],
)
def test_bad_scenarios_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        two_ranks(**overrides)


def test_a_measured_noise_scale_is_noisy_but_centred_on_the_true_one():
    simulator = ClusterSimulator(two_ranks(noise_scale_start=500.0, noise_scale_end=500.0), 0)
    measured = [simulator.run_interval([64, 64])[0].gradient_noise_scale for _ in range(200)]
    assert np.std(np.log(measured)) == pytest.approx(0.3, rel=0.2)
    assert math.exp(np.median(np.log(measured))) == pytest.approx(500.0, rel=0.1)
