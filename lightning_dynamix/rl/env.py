"""The gymnasium environment a batch-size policy is trained in: one step is one decision interval.

Observation: :meth:`ClusterState.observation` of the simulated job (the very encoding a real job's
callback produces), rank rows padded to ``max_world_size`` with a mask of the real ranks
(:func:`~lightning_dynamix.rl.policy.padded_observation`).

Action: ``1 + max_world_size`` indices into :data:`~lightning_dynamix.rl.policy.ADJUSTMENTS`
(-25%, -10%, keep, +10%, +25%): the job's, which scales the global batch, then one per rank, which
moves that rank's size (:func:`~lightning_dynamix.rl.policy.apply_adjustments`). They apply to the
sizes the balancer proposes (:func:`~lightning_dynamix.rl.policy.balancer`: the PID controller,
which equalises the ranks' own step times at the current global batch), clamped to the scenario's
bounds; entries for padding ranks are ignored. Keeping everything is the PID controller.

Reward of an interval (documented in docs/controllers/ppo.md):

    goodput / reference_goodput
    - oscillation * mean over ranks of |log2 change| where a rank's change reverses its previous one
    - memory * fraction of ranks given more samples than fit in their memory
    - generalization * accuracy ceiling lost to this interval's batch / (best - target accuracy)

The accuracy ceiling lost to an interval's batch is ``generalization_gap x log2(B / B_noise)`` (0
for a global batch within the noise scale): what the run would lose if it kept that batch. Its
weight prices it in time to accuracy: with the target at 90% of the best accuracy, a ceiling lower
by ``d`` makes a run need about ``4 d / best`` more of its progress, so a margin's worth of ceiling
(``0.1 best``) costs about 40% of the run's time, 0.4 of an interval's goodput reward per interval.

``goodput`` is the interval's progress (ideal small-batch samples: throughput x statistical
efficiency) per second; ``reference_goodput`` is what a perfectly balanced job at the initial
sizes would make at the same speeds and noise scale, so a reward near 1 is "as good as perfect
balancing at the starting batch" on every cluster. Episodes are truncated after
``episode_intervals`` decisions; they never end on reaching the target, since a reward per unit of
time would otherwise pay for training slowly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from lightning_dynamix._checks import require_int, require_number
from lightning_dynamix.metrics.state import GLOBAL_FEATURES, LOCAL_FEATURES
from lightning_dynamix.rl.policy import ADJUSTMENTS, apply_adjustments, balancer, padded_observation
from lightning_dynamix.rl.simulator import ClusterSimulator, IntervalOutcome, Scenario, ScenarioSpace


@dataclass(frozen=True)
class RewardWeights:
    """Weights of the reward's penalties (the goodput term has weight 1).

    Attributes:
        oscillation: per unit of log2 batch change that reverses the previous change.
        memory: per fraction of ranks over their memory limit.
        generalization: per loss of accuracy ceiling equal to the margin between best and target accuracy.
    """

    oscillation: float = 0.2
    memory: float = 1.0
    generalization: float = 0.4

    def __post_init__(self) -> None:
        for name in ("oscillation", "memory", "generalization"):
            require_number(name, getattr(self, name), 0.0)


def oscillation(change: np.ndarray, previous_change: np.ndarray) -> float:
    """Mean over ranks of ``|change|`` where a rank's log2 change reverses its previous one."""
    reversed_change = np.sign(change) * np.sign(previous_change) < 0
    return float(np.abs(change)[reversed_change].sum()) / len(change)


def interval_reward(
    scenario: Scenario,
    outcome: IntervalOutcome,
    previous_sizes: Sequence[int],
    sizes: Sequence[int],
    previous_change: np.ndarray,
    weights: RewardWeights,
) -> tuple[float, dict[str, float], np.ndarray]:
    """The reward of one interval, its terms, and each rank's log2 change (the next call's ``previous_change``)."""
    n = scenario.world_size
    change = np.log2(np.asarray(sizes, dtype=np.float64) / np.asarray(previous_sizes, dtype=np.float64))
    memory = len(outcome.out_of_memory) / n
    global_batch = float(sum(outcome.batch_sizes))
    excess = max(0.0, math.log2(global_batch / outcome.noise_scale))
    margin = scenario.best_accuracy - scenario.target_accuracy
    generalization = scenario.generalization_gap * excess / margin if margin > 0 else 0.0
    goodput = outcome.goodput / outcome.reference_goodput
    terms = {
        "goodput": goodput,
        "oscillation": -weights.oscillation * oscillation(change, previous_change),
        "memory": -weights.memory * memory,
        "generalization": -weights.generalization * generalization,
    }
    return float(sum(terms.values())), terms, change


class DynamixEnv(gym.Env):
    """A simulated heterogeneous job; the agent sets every rank's batch size once per interval.

    Args:
        scenarios: a :class:`ScenarioSpace` to draw a new scenario from at every reset, or a list
            of scenarios to cycle through (one per reset), or one scenario; default:
            ``ScenarioSpace()``.
        max_world_size: rank rows of the observation (and entries of the action); scenarios may
            have up to this many ranks.
        episode_intervals: decisions per episode.
        reward_weights: the penalties' weights.
        seed: seeds the scenario draws and the simulators (also settable through ``reset(seed=...)``).
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        scenarios: ScenarioSpace | Scenario | Sequence[Scenario] | None = None,
        max_world_size: int = 64,
        episode_intervals: int = 64,
        reward_weights: RewardWeights = RewardWeights(),
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
        m, local, cluster = self.max_world_size, len(LOCAL_FEATURES), len(GLOBAL_FEATURES)
        self.observation_space = spaces.Dict(
            {
                "ranks": spaces.Box(-10.0, 10.0, (m, local), np.float32),
                "cluster": spaces.Box(-10.0, 10.0, (cluster,), np.float32),
                "mask": spaces.Box(0.0, 1.0, (m,), np.float32),
            }
        )
        self.action_space = spaces.MultiDiscrete([len(ADJUSTMENTS)] * (1 + m))  # the job's, then per rank
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
        reward, terms, self._previous_change = interval_reward(
            simulator.scenario, outcome, self.sizes, sizes, self._previous_change, self.reward_weights
        )
        self.sizes = sizes
        self._intervals += 1
        truncated = self._intervals >= self.episode_intervals
        info = {"outcome": outcome, "reward_terms": terms}
        return padded_observation(self.state, self.max_world_size), reward, False, truncated, info
