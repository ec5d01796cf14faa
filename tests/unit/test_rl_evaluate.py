"""Controllers compared in the simulator, and the oracle that bounds what any of them can win."""

from __future__ import annotations

import math

import pytest

from lightning_dynamix.control import PIDController, StaticController
from lightning_dynamix.rl.evaluate import OracleController, run_controller, sample_budget
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
