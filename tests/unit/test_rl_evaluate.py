"""Controllers compared in the simulator, and the oracle that bounds what any of them can win."""

from __future__ import annotations

import math

import pytest

from lightning_dynamix.control import PIDController, StaticController
from lightning_dynamix.rl.evaluate import OracleController, RunResult, paired, run_controller, sample_budget, summarize
from tests.unit.test_rl_simulator import two_ranks


@pytest.mark.e2e
def test_the_oracle_reaches_the_target_sooner_than_pid_and_static_with_a_sudden_slowdown():
    # rank 1 is 3x slower, and either rank may slow down 2-4x for a while: the oracle sees it at once
    scenario = two_ranks(
        slowdown_rate=1 / 30, noise_scale_start=64.0, noise_scale_end=4096.0, jitter=0.05, convergence_samples=50_000.0
    )
    budget = sample_budget(scenario, 0)
    controllers = {"static": StaticController(), "pid": PIDController(), "oracle": OracleController()}
    times = {name: run_controller(scenario, c, name, 0, budget).time_to_target for name, c in controllers.items()}
    assert all(math.isfinite(t) for t in times.values()), times
    assert times["oracle"] < times["pid"] < times["static"], times


def test_the_oracle_splits_for_equal_own_times_within_memory():
    # a fixed cost per step and a noise scale far above any batch: the larger the global batch, the better
    scenario = two_ranks(
        step_overhead=(0.05, 0.05), memory_limit=(400, 4096), noise_scale_start=1e6, noise_scale_end=1e6,
        convergence_samples=50_000.0,
    )  # fmt: skip
    result = run_controller(scenario, OracleController(), "oracle", 0, sample_budget(scenario, 0))
    assert result.out_of_memory == 0
    assert result.final_global_batch >= 4 * 128  # rank 0 at its limit of 400, rank 1 a third of it


def test_the_oracle_needs_the_simulator():
    with pytest.raises(RuntimeError, match="only inside run_controller"):
        OracleController().decide(None)


def _runs(times: dict[str, float]) -> dict[str, RunResult]:
    return {name: RunResult(name, t, 0.8, 100.0, 1000, 10.0, 0, 64) for name, t in times.items()}


def test_two_controllers_compared_scenario_by_scenario_where_their_medians_against_static_disagree():
    # per scenario ppo is a little faster than goodput in three of four, but goodput's one big win lowers its
    # median against static: the medians say goodput, the scenarios ppo
    results = [
        _runs({"static": 100.0, "goodput": 50.0, "ppo": 48.0}),
        _runs({"static": 100.0, "goodput": 52.0, "ppo": 50.0}),
        _runs({"static": 100.0, "goodput": 20.0, "ppo": 60.0}),
        _runs({"static": 100.0, "goodput": math.inf, "ppo": 58.0}),  # goodput never reached the target
        _runs({"static": 100.0, "goodput": 70.0, "ppo": 70.0}),
    ]
    summary = summarize(results)
    assert summary["goodput"]["median_time_to_target_vs_static"] < summary["ppo"]["median_time_to_target_vs_static"]
    pair = paired(results, "ppo", "goodput")
    assert (pair["faster"], pair["slower"], pair["level"]) == (3, 1, 1)
    assert pair["median_ratio"] == pytest.approx(50 / 52)  # of 48/50, 50/52, 60/20, 0 (reached against never), 1
    assert pair["sign_test_p"] == pytest.approx(2 * (1 + 4) / 16)
    assert paired(results, "goodput", "ppo")["faster"] == 1
    level = paired([_runs({"static": 1.0, "a": math.inf, "b": math.inf})], "a", "b")
    assert (level["faster"], level["slower"], level["level"], level["sign_test_p"]) == (0, 0, 1, 1.0)
