"""Online fine-tuning: kept so that ``lightning_dynamix.rl.finetune`` imports keep working.

The code lives in :mod:`lightning_dynamix.control.ppo.finetune` (:class:`OnlineFinetuner`) and
:mod:`lightning_dynamix.control.ppo.reward` (:func:`measured_reward`), beside the controller that
fine-tunes (``PPOController(finetune=True)``).
"""

from lightning_dynamix.control.ppo.finetune import OnlineFinetuner
from lightning_dynamix.control.ppo.reward import measured_reward

__all__ = ["OnlineFinetuner", "measured_reward"]
