"""Lightning DDP for models that are mostly embedding tables: the tables on CPU embedding servers.

:class:`LayerOffloadStrategy` trains a LightningModule unchanged. At set-up it takes the module's
``nn.Embedding`` / ``nn.EmbeddingBag`` layers out (all of them with ``offload="auto"``, or the ones
named), shards their rows over ``num_embedding_servers`` CPU processes, and puts remote stand-ins
in their place (:mod:`lightning_dynamix.offload.remote`). The dense rest of the model trains with
DDP among the trainer ranks, the devices the Trainer was given; the servers apply a sparse
optimiser to the rows each step touched. With ``staleness=0`` this is exactly the training of the
same model in one process; ``staleness=1`` lets each step's embedding update overlap the next
step (PERSIA's bounded staleness, made exact: step ``k`` sees the tables after update ``k - 2``).

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/strategies/layer_offload/__init__.py``.
"""

from lightning_dynamix.strategies.layer_offload.checkpoints import CHECKPOINT_KEY
from lightning_dynamix.strategies.layer_offload.embedding_offload import EmbeddingOffload, OffloadingStrategy
from lightning_dynamix.strategies.layer_offload.heterogeneous import (
    HETEROGENEOUS_STRATEGY_NAME,
    HeterogeneousLayerOffloadStrategy,
)
from lightning_dynamix.strategies.layer_offload.runner_profile import profile_runner
from lightning_dynamix.strategies.layer_offload.server_processes import threads_beside_servers
from lightning_dynamix.strategies.layer_offload.strategy import STRATEGY_NAME, LayerOffloadStrategy

__all__ = [
    "CHECKPOINT_KEY",
    "HETEROGENEOUS_STRATEGY_NAME",
    "STRATEGY_NAME",
    "EmbeddingOffload",
    "HeterogeneousLayerOffloadStrategy",
    "LayerOffloadStrategy",
    "OffloadingStrategy",
    "profile_runner",
    "threads_beside_servers",
]
