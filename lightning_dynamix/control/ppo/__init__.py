"""DYNAMIX, the learned controller: everything a real job needs to run a policy trained with PPO.

* :mod:`~lightning_dynamix.control.ppo.controller`: :class:`PPOController`, the controller.
* :mod:`~lightning_dynamix.control.ppo.network`: the rank-shared policy network, its actions and how they
  adjust the balancer's proposal.
* :mod:`~lightning_dynamix.control.ppo.files`: policy files (safetensors and JSON metadata) and the policy
  that ships with the package (``policies/default.safetensors``).
* :mod:`~lightning_dynamix.control.ppo.finetune`: PPO updates from a job's own decisions (``finetune=True``),
  with the reward a job measures (:mod:`~lightning_dynamix.control.ppo.reward`), stable-baselines3's policy
  class for the network (:mod:`~lightning_dynamix.control.ppo.sb3`) and its spaces
  (:mod:`~lightning_dynamix.control.ppo.spaces`).

Training a policy in the cluster simulator is :mod:`lightning_dynamix.rl`'s, which imports this package,
never the other way round. Importing this package imports neither stable-baselines3 nor gymnasium; only
fine-tuning does.
"""

from lightning_dynamix.control.ppo.controller import PPOController
from lightning_dynamix.control.ppo.files import (
    PolicyFile,
    PolicyFileError,
    default_policy_path,
    load_policy,
    save_policy,
)
from lightning_dynamix.control.ppo.network import RankPolicyNetwork

__all__ = [
    "PPOController",
    "PolicyFile",
    "PolicyFileError",
    "RankPolicyNetwork",
    "default_policy_path",
    "load_policy",
    "save_policy",
]
