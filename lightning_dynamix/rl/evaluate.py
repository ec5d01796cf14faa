"""Controllers compared in the simulator: time to target accuracy, final accuracy, throughput.

Every controller trains the same scenario, with the same seed (so the same speed trajectory in
wall-clock time), for the same number of samples: the sample budget is what a user fixes when
they choose a number of epochs. The budget is 1.5 times the samples the static controller needs to
reach the target accuracy (a generous bound if it never does), so a controller
that reaches the target in fewer samples has room left to show its final accuracy, and one whose
large batches need more samples may run out of them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lightning_dynamix.control import BatchController, Decision, make_controller
from lightning_dynamix.metrics.state import ClusterState
from lightning_dynamix.rl.simulator import ClusterSimulator, Scenario

# the most intervals one evaluation run may take, whatever its budget
MAX_INTERVALS = 5000


@dataclass(frozen=True)
class RunResult:
    """One controller on one scenario.

    Attributes:
        controller: the controller's name.
        time_to_target: seconds until the target accuracy was reached; ``inf`` if it never was.
        final_accuracy: accuracy once the sample budget was spent.
        time: seconds to spend the budget.
        samples: samples trained on.
        throughput: samples per second over the run.
        out_of_memory: rank-intervals whose batch did not fit in memory.
        final_global_batch: the global batch at the end, samples.
    """

    controller: str
    time_to_target: float
    final_accuracy: float
    time: float
    samples: int
    throughput: float
    out_of_memory: int
    final_global_batch: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


ControllerFactory = Callable[[Scenario], BatchController]


class OracleController:
    """A reference, not a controller: decides from what only the simulator knows.

    Every decision it reads the simulator's true speeds and link rates (drift and slowdowns included,
    the moment they happen) and true gradient noise scale, and runs the global batch, among the initial one
    times ``2^(k/4)`` for ``k`` in -12..12, whose split into equal own step times (within the memory
    limits) has the most goodput, discounted for the accuracy ceiling large batches cost. No
    controller that measures can know these, so how close one comes to it is what there was to win.
    """

    def __init__(self) -> None:
        self.simulator: ClusterSimulator | None = None

    def decide(self, state: ClusterState) -> Decision:
        simulator = self.simulator
        if simulator is None:
            raise RuntimeError("OracleController runs only inside run_controller, which hands it the simulator")
        s = simulator.scenario
        speeds = simulator.speed_multipliers(simulator.time)
        noise = simulator.noise_scale
        overhead, per_sample = np.asarray(s.step_overhead) / speeds, np.asarray(s.compute_per_sample) / speeds
        load, memory = np.asarray(s.data_per_sample), np.asarray(s.memory_limit, dtype=np.float64)
        exposed = simulator.allreduce_time(simulator.time) * (1.0 - s.overlap)
        margin = s.best_accuracy - s.target_accuracy
        best: tuple[float, tuple[int, ...]] = (-np.inf, state.batch_sizes)
        for k in range(-12, 13):
            total = s.world_size * s.initial_batch_size * 2.0 ** (k / 4)
            sizes = self._equal_time_split(total, overhead, per_sample, load, memory)
            own = np.maximum(overhead + per_sample * sizes, load * sizes)
            batch = float(sizes.sum())
            goodput = batch / (own.max() + exposed) * noise / (noise + batch)
            excess = max(0.0, np.log2(batch / noise))
            if margin > 0:  # the ceiling a run at this batch would lose, against the margin it has
                goodput *= max(0.0, 1.0 - s.generalization_gap * excess / margin)
            if goodput > best[0]:
                best = (goodput, tuple(int(b) for b in sizes))
        return Decision(best[1])

    @staticmethod
    def _equal_time_split(
        total: float, overhead: np.ndarray, per_sample: np.ndarray, load: np.ndarray, memory: np.ndarray
    ) -> np.ndarray:
        """Sizes summing to about ``total`` on which every rank's own step takes the same time ``T``."""

        def sizes_at(t: float) -> np.ndarray:
            fits = (t - overhead) / per_sample  # compute within t
            fits = np.where(load > 0, np.minimum(fits, t / np.where(load > 0, load, 1.0)), fits)  # and loading
            return np.clip(np.floor(fits), 1, memory)

        low, high = 0.0, float((overhead + per_sample * total).max() + (load * total).max())
        for _ in range(50):
            middle = (low + high) / 2
            low, high = (middle, high) if sizes_at(middle).sum() < total else (low, middle)
        return sizes_at(high)


def controller_factory(name: str, policy: str | None = None) -> ControllerFactory:
    """A fresh controller per run, by name (``"ppo"`` loads ``policy``, default: the shipped policy)."""
    if name == "ppo":
        from lightning_dynamix.control.ppo import PPOController, load_policy

        loaded = load_policy(policy)
        return lambda scenario: PPOController(loaded)
    make_controller(name)  # fails early for an unknown name
    return lambda scenario: make_controller(name)


def run_controller(
    scenario: Scenario, controller: BatchController, name: str, seed: int, sample_budget: int
) -> RunResult:
    """Train ``scenario`` with ``controller`` until ``sample_budget`` samples are spent (or MAX_INTERVALS)."""
    simulator = ClusterSimulator(scenario, seed)
    if isinstance(controller, OracleController):
        controller.simulator = simulator
    state = simulator.reset()
    time_to_target = math.inf
    out_of_memory = 0
    samples = 0
    outcome = None
    for _ in range(MAX_INTERVALS):
        decision = controller.decide(state)
        state, outcome = simulator.run_interval(decision.batch_sizes)
        samples += outcome.samples
        out_of_memory += len(outcome.out_of_memory)
        if math.isinf(time_to_target) and outcome.accuracy >= scenario.target_accuracy:
            time_to_target = outcome.time
        if samples >= sample_budget:
            break
    assert outcome is not None
    return RunResult(
        controller=name,
        time_to_target=time_to_target,
        final_accuracy=outcome.accuracy,
        time=outcome.time,
        samples=samples,
        throughput=samples / outcome.time,
        out_of_memory=out_of_memory,
        final_global_batch=sum(outcome.batch_sizes),
    )


def sample_budget(scenario: Scenario, seed: int) -> int:
    """1.5 x the samples the static controller needs to reach the target (a generous bound if it never does)."""
    from lightning_dynamix.control import StaticController

    simulator = ClusterSimulator(scenario, seed)
    state = simulator.reset()
    samples = 0
    # static progress per sample is at least B_noise_start / (B_noise_start + B0): a bound on what it needs
    global_batch = scenario.world_size * scenario.initial_batch_size
    limit = int(5 * scenario.convergence_samples * (1 + global_batch / scenario.noise_scale_start))
    for _ in range(MAX_INTERVALS):
        state, outcome = simulator.run_interval(StaticController().decide(state).batch_sizes)
        samples += outcome.samples
        if outcome.accuracy >= scenario.target_accuracy:
            return int(1.5 * samples)
        if samples >= limit:
            break
    return limit


def compare(
    scenarios: Sequence[Scenario],
    controllers: dict[str, ControllerFactory],
    seed: int = 0,
) -> list[dict[str, RunResult]]:
    """Every controller on every scenario (seed ``seed + i`` for scenario ``i``); one dict per scenario."""
    results = []
    for i, scenario in enumerate(scenarios):
        budget = sample_budget(scenario, seed + i)
        results.append(
            {
                name: run_controller(scenario, factory(scenario), name, seed + i, budget)
                for name, factory in controllers.items()
            }
        )
    return results


def summarize(results: Sequence[dict[str, RunResult]], baseline: str = "static") -> dict[str, dict[str, float]]:
    """Per controller: median time to target relative to ``baseline`` (per scenario), share reaching it, accuracy.

    A run that never reached the target counts as infinitely slow, so the median is ``inf`` when
    more than half never did.
    """
    names = list(results[0]) if results else []
    summary: dict[str, dict[str, float]] = {}
    for name in names:
        ratios = []
        for per_scenario in results:
            base = per_scenario[baseline].time_to_target
            mine = per_scenario[name].time_to_target
            ratios.append(mine / base if math.isfinite(base) else (1.0 if math.isinf(mine) else 0.0))
        summary[name] = {
            "median_time_to_target_vs_" + baseline: statistics.median(ratios),
            "reached_target": sum(math.isfinite(r[name].time_to_target) for r in results) / len(results),
            "median_final_accuracy": statistics.median(r[name].final_accuracy for r in results),
            "median_throughput_vs_" + baseline: statistics.median(
                r[name].throughput / r[baseline].throughput for r in results
            ),
        }
    return summary


def paired(results: Sequence[dict[str, RunResult]], name: str, other: str) -> dict[str, float]:
    """``name`` against ``other`` scenario by scenario: the median of their times to target, and how often each
    was faster.

    A median over a few scenarios moves by several percent with the scenarios drawn; the same scenarios run by
    both controllers tell more. A run that never reached the target is slower than one that did (two that
    never did are level). ``sign_test_p``: the two-sided probability of so lopsided a count of faster and
    slower scenarios if each were as likely.

    Returns:
        ``{"median_ratio", "faster", "slower", "level", "sign_test_p"}``.
    """
    ratios, faster, slower = [], 0, 0
    for per_scenario in results:
        mine, theirs = per_scenario[name].time_to_target, per_scenario[other].time_to_target
        if math.isfinite(mine) and math.isfinite(theirs):
            ratios.append(mine / theirs)
        elif math.isfinite(mine) or math.isfinite(theirs):
            ratios.append(0.0 if math.isfinite(mine) else math.inf)
        faster += mine < theirs
        slower += mine > theirs
    decided = faster + slower
    low = min(faster, slower)
    tail = sum(math.comb(decided, k) for k in range(low + 1)) / 2**decided if decided else 1.0
    return {
        "median_ratio": statistics.median(ratios) if ratios else math.nan,
        "faster": faster,
        "slower": slower,
        "level": len(results) - decided,
        "sign_test_p": min(1.0, 2 * tail),
    }
