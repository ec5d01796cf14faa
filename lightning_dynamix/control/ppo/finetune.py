"""Online fine-tuning: PPO updates of a policy from a real job's own decisions.

:class:`OnlineFinetuner` keeps a stable-baselines3 ``PPO`` whose policy network *is* the
controller's network. Every decision adds one transition (the observation, the sampled
adjustments, their log-probability and the critic's value); the reward is measured on the next
decision's state (:func:`~lightning_dynamix.control.ppo.reward.measured_reward`, the simulator's
reward as far as a real job can measure it). Every ``n_steps`` transitions stable-baselines3's own
PPO update runs on them (its ``RolloutBuffer``, GAE and clipped loss), and the job's next
decisions use the updated weights.

:class:`~lightning_dynamix.control.ppo.controller.PPOController` builds one with ``finetune=True``,
and only then imports this module: a controller that does not fine-tune never imports stable-baselines3
or gymnasium.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from stable_baselines3 import PPO

from lightning_dynamix import _compat
from lightning_dynamix.control.ppo.network import RankPolicyNetwork, padded_observation
from lightning_dynamix.control.ppo.reward import RewardWeights, measured_reward
from lightning_dynamix.control.ppo.sb3 import SharedRankPolicy, silent_logger
from lightning_dynamix.control.ppo.spaces import action_space, observation_space
from lightning_dynamix.metrics.state import ClusterState


class _SpacesOnly(gym.Env):
    """An environment for its spaces alone: PPO needs one to build its policy and buffer, and is never asked
    to collect from it (the job's decisions are the transitions)."""

    def __init__(self, max_world_size: int) -> None:
        super().__init__()
        self.observation_space = observation_space(max_world_size)
        self.action_space = action_space(max_world_size)

    def step(self, action: Any) -> Any:
        raise RuntimeError("OnlineFinetuner's PPO learns from the job's decisions, never by stepping an environment")


class OnlineFinetuner:
    """PPO updates of ``network`` from transitions a real job produces.

    Args:
        network: the controller's network; updated in place.
        max_world_size: the policy's rank rows (observations are padded to it).
        n_steps: decisions per PPO update.
        learning_rate: Adam's learning rate (small: the policy is already trained).
        n_epochs: passes over each rollout.
        batch_size: minibatch size (<= n_steps).
        gamma: discount per decision.
        clip_range: PPO's clip range.
        seed: seeds the sampled adjustments.
        reward_weights: the reward's oscillation weight.
    """

    def __init__(
        self,
        network: RankPolicyNetwork,
        max_world_size: int,
        n_steps: int = 16,
        learning_rate: float = 1e-4,
        n_epochs: int = 4,
        batch_size: int = 16,
        gamma: float = 0.99,
        clip_range: float = 0.1,
        seed: int = 0,
        reward_weights: RewardWeights | None = None,
    ) -> None:
        if batch_size > n_steps:
            raise ValueError(f"`batch_size` ({batch_size}) must be <= `n_steps` ({n_steps})")
        self.model = PPO(
            SharedRankPolicy,
            _SpacesOnly(max_world_size),
            n_steps=n_steps,
            batch_size=batch_size,
            n_epochs=n_epochs,
            learning_rate=learning_rate,
            gamma=gamma,
            clip_range=clip_range,
            policy_kwargs={"hidden": network.hidden, "layers": network.layers},
            seed=seed,
            device="cpu",
        )
        self.model.set_logger(silent_logger())
        _compat.set_progress_remaining(self.model, 1.0)  # constant schedules: learn() would set it
        self.model.policy.network = network  # the controller's network: updates reach it at once
        self.model.policy.optimizer = self.model.policy.optimizer_class(
            network.parameters(), lr=learning_rate, **self.model.policy.optimizer_kwargs
        )
        self.network = network
        self.max_world_size = max_world_size
        self.weights = reward_weights or RewardWeights()
        self.updates = 0
        self._pending: tuple[dict[str, np.ndarray], np.ndarray, torch.Tensor, torch.Tensor] | None = None
        self._previous_change: np.ndarray | None = None
        self._previous_sizes: tuple[int, ...] | None = None
        self._episode_start = True

    def act(self, state: ClusterState, base_global_batch: int) -> np.ndarray:
        """Record the interval that ended in ``state`` (its reward) and sample this decision's adjustments."""
        obs = padded_observation(state, self.max_world_size)
        batch = {k: torch.as_tensor(v).unsqueeze(0) for k, v in obs.items()}
        policy = self.model.policy
        policy.set_training_mode(False)
        with torch.no_grad():
            actions, value, log_prob = policy(batch)
        if self._pending is not None and self._previous_sizes is not None:
            previous = self._previous_change
            if previous is None or len(previous) != state.world_size:
                previous = np.zeros(state.world_size)
            reward, self._previous_change = measured_reward(
                state, self._previous_sizes, previous, base_global_batch, self.weights
            )
            self._add(reward)
            if self.model.rollout_buffer.full:
                self._update(value)
        self._pending = (obs, actions.numpy(), value, log_prob)
        self._previous_sizes = state.batch_sizes
        return actions.numpy()[0, : 1 + state.world_size]

    def _add(self, reward: float) -> None:
        assert self._pending is not None
        obs, actions, value, log_prob = self._pending
        self.model.rollout_buffer.add(
            {k: v[None] for k, v in obs.items()},
            actions,
            np.array([reward], dtype=np.float32),
            np.array([self._episode_start], dtype=np.float32),
            value,
            log_prob,
        )
        self._episode_start = False

    def _update(self, last_value: torch.Tensor) -> None:
        buffer = self.model.rollout_buffer
        buffer.compute_returns_and_advantage(last_values=last_value, dones=np.zeros(1, dtype=np.float32))
        self.model.train()
        buffer.reset()
        self.network.eval()
        self.updates += 1

    def regroup(self) -> None:
        """The job now runs on another group: the transition begun on the old one has no reward to come."""
        self._pending, self._previous_sizes, self._previous_change = None, None, None

    def state_dict(self) -> dict[str, Any]:
        """The network's weights and the optimizer's state (a rollout in progress starts over on resume)."""
        return {
            "network": {k: v.detach().clone() for k, v in self.network.state_dict().items()},
            "optimizer": self.model.policy.optimizer.state_dict(),
            "updates": self.updates,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.network.load_state_dict(state_dict["network"])
        self.model.policy.optimizer.load_state_dict(state_dict["optimizer"])
        self.updates = int(state_dict["updates"])
        self._pending, self._previous_sizes, self._previous_change = None, None, None
        self._episode_start = True
