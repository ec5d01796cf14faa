"""What a policy reads and chooses, as gymnasium spaces: the simulator's environment and PPO's policy class use them.

Observation: the rank rows of :meth:`ClusterState.observation` padded to ``max_world_size``, the job's
features and a mask of the real ranks (:func:`~lightning_dynamix.control.ppo.network.padded_observation`).
Action: ``1 + max_world_size`` indices into :data:`~lightning_dynamix.control.ppo.network.ADJUSTMENTS`,
the job's then one per rank.
"""

from __future__ import annotations

import numpy as np
from gymnasium import spaces

from lightning_dynamix.control.ppo.network import ADJUSTMENTS
from lightning_dynamix.metrics.state import GLOBAL_FEATURES, LOCAL_FEATURES


def observation_space(max_world_size: int) -> spaces.Dict:
    """The padded observation of a job of up to ``max_world_size`` ranks."""
    local, cluster = len(LOCAL_FEATURES), len(GLOBAL_FEATURES)
    return spaces.Dict(
        {
            "ranks": spaces.Box(-10.0, 10.0, (max_world_size, local), np.float32),
            "cluster": spaces.Box(-10.0, 10.0, (cluster,), np.float32),
            "mask": spaces.Box(0.0, 1.0, (max_world_size,), np.float32),
        }
    )


def action_space(max_world_size: int) -> spaces.MultiDiscrete:
    """The job's adjustment, then one per rank (padding ranks' entries are ignored)."""
    return spaces.MultiDiscrete([len(ADJUSTMENTS)] * (1 + max_world_size))
