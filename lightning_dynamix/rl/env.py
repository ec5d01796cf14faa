"""The gymnasium environment a batch-size policy is trained in: one step is one decision interval.

Observation: :meth:`ClusterState.observation` of the simulated job (the very encoding a real job's
callback produces), rank rows padded to ``max_world_size`` with a mask of the real ranks
(:func:`~lightning_dynamix.control.ppo.network.padded_observation`).

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/rl/env.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from lightning_dynamix._checks import require_int
from lightning_dynamix.control.ppo.network import apply_adjustments, balancer, padded_observation
from lightning_dynamix.control.ppo.reward import RewardWeights, oscillation
from lightning_dynamix.control.ppo.spaces import action_space, observation_space
from lightning_dynamix.rl.simulator import ClusterSimulator, IntervalOutcome, Scenario, ScenarioSpace

# the most progress to the target a reward counts, in units of the scenario's convergence_samples
# (reaching 90% of the best accuracy needs about 2.3 of them)
REMAINING_CAP = 10.0


@dataclass(frozen=True)
class RewardScale:
    """The units of the time-to-target reward of one scenario.

    Attributes:
        progress: ``p0``: progress of one interval at the initial sizes and the starting noise
            scale, ideal small-batch samples.
        time: ``t0``: seconds a perfectly balanced job at the initial global batch takes for one
            interval at the ranks' starting speeds.
    """

    progress: float
    time: float

    @classmethod
    def of(cls, simulator: ClusterSimulator) -> RewardScale:
        s = simulator.scenario
        b0, global_batch = s.initial_batch_size, float(s.world_size * s.initial_batch_size)
        samples = s.interval_steps * global_batch
        progress = samples * s.noise_scale_start / (s.noise_scale_start + global_batch)
        start = (simulator.speed_multipliers(0.0), simulator.link_multipliers(0.0))
        ideal = s.ideal_throughput([b0] * s.world_size, *start)
        return cls(progress, samples / ideal)


def remaining_progress(simulator: ClusterSimulator) -> float:
    """The progress to the target the reward counts: ``progress_to_target``, capped at ``REMAINING_CAP``."""
    return min(simulator.progress_to_target, REMAINING_CAP * simulator.scenario.convergence_samples)


def interval_reward(
    scale: RewardScale,
    outcome: IntervalOutcome,
    remaining_before: float,
    remaining_after: float,
    change: np.ndarray,
    previous_change: np.ndarray,
    weights: RewardWeights,
) -> tuple[float, dict[str, float]]:
    """The reward of one interval and its terms; ``change`` is each rank's log2 change of batch into it."""
    terms = {
        "progress": (remaining_before - remaining_after) / scale.progress,
        "time": -outcome.elapsed / scale.time,
        "oscillation": -weights.oscillation * oscillation(change, previous_change),
        "memory": -weights.memory * len(outcome.out_of_memory) / len(change),
    }
    return float(sum(terms.values())), terms


class DynamixEnv(gym.Env):
    """A simulated heterogeneous job; the agent sets every rank's batch size once per interval.

    Args:
        scenarios: a :class:`ScenarioSpace` to draw a new scenario from at every reset, or a list
            of scenarios to cycle through (one per reset), or one scenario; default:
            ``ScenarioSpace()``.
        max_world_size: rank rows of the observation (and entries of the action); scenarios may
            have up to this many ranks.
        episode_intervals: the most decisions per episode (an episode ends earlier when the target
            accuracy is reached).
        reward_weights: the penalties' weights.
        seed: seeds the scenario draws and the simulators (also settable through ``reset(seed=...)``).
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        scenarios: ScenarioSpace | Scenario | Sequence[Scenario] | None = None,
        max_world_size: int = 64,
        episode_intervals: int = 512,
        reward_weights: RewardWeights = RewardWeights(),  # noqa: B008 (a frozen dataclass: one shared default is safe)
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.max_world_size = require_int("max_world_size", max_world_size, 1)
        self.episode_intervals = require_int("episode_intervals", episode_intervals, 1)
        if scenarios is None:
            scenarios = ScenarioSpace()
        if isinstance(scenarios, Scenario):
            scenarios = [scenarios]
        if isinstance(scenarios, ScenarioSpace):
            largest = max(scenarios.world_sizes)
            self.space: ScenarioSpace | None = scenarios
            self.scenarios: list[Scenario] = []
        else:
            self.scenarios = list(scenarios)
            if not self.scenarios or not all(isinstance(s, Scenario) for s in self.scenarios):
                raise ValueError(
                    f"`scenarios` must be a ScenarioSpace, a Scenario or a list of them, got {scenarios!r}"
                )
            largest = max(s.world_size for s in self.scenarios)
            self.space = None
        if largest > self.max_world_size:
            raise ValueError(
                f"`scenarios` reach {largest} ranks but `max_world_size` is {self.max_world_size}; raise max_world_size"
            )
        if not isinstance(reward_weights, RewardWeights):
            raise ValueError(f"`reward_weights` must be a RewardWeights, got {reward_weights!r}")
        self.reward_weights = reward_weights
        self.observation_space = observation_space(self.max_world_size)
        self.action_space = action_space(self.max_world_size)  # the job's, then per rank
        self._next_scenario = 0
        self.simulator: ClusterSimulator | None = None
        if seed is not None:
            self.reset(seed=seed)

    @property
    def scenario(self) -> Scenario:
        if self.simulator is None:
            raise RuntimeError("DynamixEnv.reset() was not called")
        return self.simulator.scenario

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        super().reset(seed=seed)
        if self.space is not None:
            scenario = self.space.sample(self.np_random)
        else:
            scenario = self.scenarios[self._next_scenario % len(self.scenarios)]
            self._next_scenario += 1
        self.simulator = ClusterSimulator(scenario, seed=int(self.np_random.integers(0, 2**31 - 1)))
        self.state = self.simulator.reset()
        self.sizes = self.state.batch_sizes
        self.balancer = balancer()
        self._previous_change = np.zeros(scenario.world_size)
        self._intervals = 0
        self.reward_scale = RewardScale.of(self.simulator)
        self._remaining = remaining_progress(self.simulator)
        return padded_observation(self.state, self.max_world_size), {"scenario": scenario}

    def step(self, action: np.ndarray) -> tuple[dict, float, bool, bool, dict]:
        simulator = self.simulator
        if simulator is None:
            raise RuntimeError("DynamixEnv.reset() was not called")
        n = simulator.scenario.world_size
        low, high = simulator.bounds()
        proposal = self.balancer.decide(self.state).batch_sizes
        sizes = apply_adjustments(proposal, np.asarray(action)[: 1 + n], [low] * n, [high] * n)
        self.state, outcome = simulator.run_interval(sizes)
        change = np.log2(np.asarray(sizes, dtype=np.float64) / np.asarray(self.sizes, dtype=np.float64))
        remaining = remaining_progress(simulator)
        reward, terms = interval_reward(
            self.reward_scale, outcome, self._remaining, remaining, change, self._previous_change, self.reward_weights
        )
        self._remaining, self._previous_change, self.sizes = remaining, change, sizes
        self._intervals += 1
        terminated = outcome.accuracy >= simulator.scenario.target_accuracy
        truncated = not terminated and self._intervals >= self.episode_intervals
        info = {"outcome": outcome, "reward_terms": terms}
        return padded_observation(self.state, self.max_world_size), reward, terminated, truncated, info
