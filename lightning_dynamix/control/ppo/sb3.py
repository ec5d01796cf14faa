"""stable-baselines3's PPO with the rank-shared network: the policy class PPO trains.

:class:`SharedRankPolicy` is an ``ActorCriticPolicy`` whose actor and critic are one
:class:`~lightning_dynamix.control.ppo.network.RankPolicyNetwork`, so what PPO trains (in the simulator,
:mod:`lightning_dynamix.rl.train`, or on a real job, :mod:`~lightning_dynamix.control.ppo.finetune`) is exactly
what a policy file stores and what :class:`~lightning_dynamix.control.ppo.controller.PPOController` runs.
The action distribution is a ``MultiCategoricalDistribution`` over the padded ranks, one batched
``Categorical`` for all of them (padding ranks keep their size with probability one).
"""

from __future__ import annotations

from typing import Any

import torch
from gymnasium import spaces
from stable_baselines3.common.distributions import MultiCategoricalDistribution
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.policies import ActorCriticPolicy
from stable_baselines3.common.type_aliases import PyTorchObs
from torch.distributions import Categorical
from typing_extensions import override

from lightning_dynamix.control.ppo.network import RankPolicyNetwork


class SharedRankPolicy(ActorCriticPolicy):
    """PPO's actor-critic with parameters shared across ranks.

    Args (beyond ``ActorCriticPolicy``'s):
        hidden: width of the network's hidden layers.
        layers: hidden layers of the actor and the critic.
    """

    def __init__(
        self,
        observation_space: spaces.Dict,
        action_space: spaces.MultiDiscrete,
        lr_schedule: Any,
        hidden: int = 64,
        layers: int = 2,
        **kwargs: Any,
    ) -> None:
        self.hidden, self.layers = hidden, layers
        super().__init__(observation_space, action_space, lr_schedule, **kwargs)

    @override
    def _build(self, lr_schedule: Any) -> None:
        self.network = RankPolicyNetwork(hidden=self.hidden, layers=self.layers)
        if not isinstance(self.action_space, spaces.MultiDiscrete):
            raise ValueError(f"SharedRankPolicy needs a MultiDiscrete action space, got {self.action_space!r}")
        self.action_dist = RankCategoricalDistribution(list(self.action_space.nvec))
        self.optimizer = self.optimizer_class(self.network.parameters(), lr=lr_schedule(1), **self.optimizer_kwargs)

    @override
    def _get_constructor_parameters(self) -> dict[str, Any]:
        return {**super()._get_constructor_parameters(), "hidden": self.hidden, "layers": self.layers}

    def _inputs(self, obs: PyTorchObs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert isinstance(obs, dict)
        return obs["ranks"].float(), obs["cluster"].float(), obs["mask"].float()

    def _distribution(self, obs: PyTorchObs) -> RankCategoricalDistribution:
        logits = self.network.logits(*self._inputs(obs))
        return self.action_dist.proba_distribution(action_logits=logits.flatten(1))  # type: ignore[attr-defined]

    @override
    def forward(self, obs: PyTorchObs, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        distribution = self._distribution(obs)
        actions = distribution.get_actions(deterministic=deterministic)
        values = self.network.value(*self._inputs(obs))
        return actions.reshape((-1, *self.action_space.shape)), values, distribution.log_prob(actions)  # type: ignore[misc]

    @override
    def evaluate_actions(
        self, obs: PyTorchObs, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        distribution = self._distribution(obs)
        values = self.network.value(*self._inputs(obs))
        return values, distribution.log_prob(actions), distribution.entropy()

    @override
    def get_distribution(self, obs: PyTorchObs) -> RankCategoricalDistribution:
        return self._distribution(obs)

    @override
    def predict_values(self, obs: PyTorchObs) -> torch.Tensor:
        return self.network.value(*self._inputs(obs))


class RankCategoricalDistribution(MultiCategoricalDistribution):
    """``MultiCategoricalDistribution`` with every rank's choice in one batched ``Categorical``.

    stable-baselines3's version builds one ``Categorical`` per rank (64 objects per forward pass at
    64 ranks); the distribution is the same.
    """

    @override
    def proba_distribution(self, action_logits: torch.Tensor) -> RankCategoricalDistribution:
        logits = action_logits.view(action_logits.shape[0], len(self.action_dims), -1)
        self.categorical = Categorical(logits=logits, validate_args=False)
        return self

    @override
    def log_prob(self, actions: torch.Tensor) -> torch.Tensor:
        return self.categorical.log_prob(actions.long()).sum(dim=1)

    @override
    def entropy(self) -> torch.Tensor:
        return self.categorical.entropy().sum(dim=1)

    @override
    def sample(self) -> torch.Tensor:
        return self.categorical.sample()

    @override
    def mode(self) -> torch.Tensor:
        return self.categorical.logits.argmax(dim=-1)


def silent_logger() -> Logger:
    """A stable-baselines3 logger that writes nothing anywhere. PPO's own default (``verbose=0``, no log
    folder) writes nothing either, but makes a directory ``SB3-<date>`` in the temporary folder at every
    ``learn``, and so does ``configure(None, [])``."""
    return Logger(folder=None, output_formats=[])
