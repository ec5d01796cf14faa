"""The policy network and its actions: kept so that ``lightning_dynamix.rl.policy`` imports keep working.

The code lives in :mod:`lightning_dynamix.control.ppo.network`, beside the controller that runs it
(:class:`~lightning_dynamix.control.PPOController`), so that the controllers import nothing of
:mod:`lightning_dynamix.rl`.
"""

from lightning_dynamix.control.ppo.network import (
    ADJUSTMENTS,
    APPLIED_TO,
    KEEP,
    KEEP_PRIOR,
    RankPolicyNetwork,
    apply_adjustments,
    balancer,
    padded_observation,
)

__all__ = [
    "ADJUSTMENTS",
    "APPLIED_TO",
    "KEEP",
    "KEEP_PRIOR",
    "RankPolicyNetwork",
    "apply_adjustments",
    "balancer",
    "padded_observation",
]
