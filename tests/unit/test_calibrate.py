"""dynamix calibrate: a scenario fitted to logged metrics reproduces the run it came from."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from lightning_dynamix.control import PIDController
from lightning_dynamix.decisions import IntervalRecord, interval_metrics
from lightning_dynamix.rl import ClusterSimulator, Scenario
from lightning_dynamix.rl.calibrate import calibrate, replay

TRUTH = Scenario(
    world_size=3,
    compute_per_sample=(1e-3, 2e-3, 4e-3),
    step_overhead=(5e-3, 5e-3, 8e-3),
    data_per_sample=(1e-4, 1e-4, 1e-4),
    memory_limit=(4096,) * 3,
    gradient_bytes=8e6,
    bandwidth=2e9,
    overlap=0.3,
    initial_batch_size=64,
    noise_scale_start=300.0,
    noise_scale_end=3000.0,
    convergence_samples=40_000.0,
    loss_start=2.0,
    loss_end=0.2,
    jitter=0.03,
    drift=0.0,
)


def logged_run(scenario: Scenario, intervals: int = 30):
    """What DynamixCallback would log for a PID-controlled run of ``scenario``: the report's series."""
    simulator = ClusterSimulator(scenario, 0)
    state = simulator.reset()
    controller = PIDController(dead_band=0.0)
    series: dict[str, list] = {}
    ranks: dict[int, dict[str, list]] = {r: {} for r in range(scenario.world_size)}
    for _ in range(intervals):
        decision = controller.decide(state)
        for name, value in interval_metrics(IntervalRecord(state.step, 0.0, state, decision)).items():
            if not math.isfinite(value):
                continue
            parts = name.split("/")
            if len(parts) == 3:
                ranks[int(parts[1].removeprefix("rank_"))].setdefault(parts[2], []).append((state.step, value))
            else:
                series.setdefault(parts[1], []).append((state.step, value))
        state, _ = simulator.run_interval(decision.batch_sizes)
    return series, ranks


def test_a_scenario_fitted_to_a_runs_logs_recovers_the_cluster_and_replays_the_run():
    series, ranks = logged_run(TRUTH)
    fitted, report = calibrate(series, ranks, dataset_size=50_000)
    assert report.intervals == 30
    assert report.interval_steps == TRUTH.interval_steps
    for got, want in zip(fitted.compute_per_sample, TRUTH.compute_per_sample):
        assert got == pytest.approx(want, rel=0.15)
    assert fitted.allreduce_time == pytest.approx(TRUTH.allreduce_time, rel=0.15)
    assert fitted.overlap == pytest.approx(TRUTH.overlap, abs=0.1)
    assert fitted.noise_scale_start == pytest.approx(TRUTH.noise_scale_start, rel=0.5)
    assert fitted.noise_scale_end > 2 * fitted.noise_scale_start
    assert fitted.loss_start == pytest.approx(TRUTH.loss_start, rel=0.15)
    assert "memory_limit" in report.assumed
    rows = replay(fitted, ranks, report)
    assert len(rows) == 30
    assert report.replay_step_time_error < 0.1


def test_a_slow_host_link_is_learned_from_the_runs_all_reduce():
    # rank 2's host on a 30 Mbit/s link: the all-reduce, not the compute, bounds the step
    truth = replace(TRUTH, gradient_bytes=4e6, link_bandwidth=(2e9, 2e9, 30e6 / 8), overlap=0.0)
    series, ranks = logged_run(truth)
    fitted, _ = calibrate(series, ranks, dataset_size=50_000)
    assert fitted.bandwidth * 8 / 1e6 == pytest.approx(30, rel=0.1)  # Mbit/s: the ring's slowest hop
    assert fitted.allreduce_time == pytest.approx(truth.allreduce_time, rel=0.1)
    assert fitted.allreduce_time > 5 * max(a + b * 64 for a, b in zip(fitted.step_overhead, fitted.compute_per_sample))


def test_a_single_interval_is_not_enough():
    series, ranks = logged_run(TRUTH, intervals=1)
    with pytest.raises(ValueError, match="at least 2 logged intervals, got 1"):
        calibrate(series, ranks)
