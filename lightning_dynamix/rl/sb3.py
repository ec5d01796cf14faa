"""stable-baselines3's policy class for the rank-shared network: kept so that ``lightning_dynamix.rl.sb3``
imports keep working.

The code lives in :mod:`lightning_dynamix.control.ppo.sb3`: simulator training
(:mod:`lightning_dynamix.rl.train`) and a real job's fine-tuning (:mod:`lightning_dynamix.control.ppo.finetune`)
share it.
"""

from lightning_dynamix.control.ppo.sb3 import RankCategoricalDistribution, SharedRankPolicy, silent_logger

__all__ = ["RankCategoricalDistribution", "SharedRankPolicy", "silent_logger"]
