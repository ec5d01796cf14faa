"""Lightning DDP for models that are mostly embedding tables: the tables on CPU embedding servers.

:class:`LayerOffloadStrategy` trains a LightningModule unchanged. At set-up it takes the module's
``nn.Embedding`` / ``nn.EmbeddingBag`` layers out (all of them with ``offload="auto"``, or the ones
named), shards their rows over ``num_embedding_servers`` CPU processes, and puts remote stand-ins
in their place (:mod:`lightning_dynamix.offload.remote`). The dense rest of the model trains with
DDP among the trainer ranks, the devices the Trainer was given; the servers apply a sparse
optimiser to the rows each step touched. With ``staleness=0`` this is exactly the training of the
same model in one process; ``staleness=1`` lets each step's embedding update overlap the next
step (PERSIA's bounded staleness, made exact: step ``k`` sees the tables after update ``k - 2``).

Servers and trainers talk over ``torch.distributed.rpc``. On one machine the strategy starts the
servers itself; on a cluster, start them with ``python -m lightning_dynamix.serve`` and give the
strategy ``launch_servers=False`` and the ``server_port`` they were told.

Checkpoints: every server writes its shards, with their optimiser state, beside the checkpoint
file (``<checkpoint>.embeddings/``); the checkpoint records them, and resuming restores them, into
any number of servers. At the end of ``fit`` the trained tables are copied back into the
LightningModule's own embedding modules (``return_embeddings=True``), so the model is whole again.

Lookups: each table's forward sends one request per server. A LightningModule that defines
``embedding_ids(batch) -> {table name: ids}`` lets the strategy look every table up before the step
in one request per server (:meth:`EmbeddingClient.prefetch`); the tables' forwards then use those
rows. Ids that differ from what a table's forward receives cost a request, never a wrong row.

Pipelined lookups: with ``prefetch_depth=1`` (the default where it applies) the training DataLoader
is read one batch ahead, and the rows of step ``t + 1`` are asked for while step ``t`` runs. The
servers answer them with the version of the tables that step must see (after update ``t`` with
``staleness=0``, so training stays exact; after update ``t - 1`` with ``staleness=1``, which they
have at once), and the rows are assembled as they arrive, beside the trainer's compute.

:class:`HeterogeneousLayerOffloadStrategy` is the same with a batch size per trainer rank, as
:class:`~lightning_dynamix.strategies.HeterogeneousDDPStrategy` gives them: each trainer's row
gradients carry its share of the global batch, as its dense gradients do, and the servers sum them,
so training stays exact; ``DynamixCallback`` balances its trainers.

The package, one idea per module:

* :mod:`.strategy`: :class:`LayerOffloadStrategy`, Lightning's ``DDPStrategy`` whose hooks delegate to
* :mod:`.embedding_offload`: :class:`EmbeddingOffload`, the offload part each strategy holds, which puts
  together
* :mod:`.tables` (which tables, their specs and optimiser, in and out of the model), :mod:`.servers` (the
  server processes and the RPC group), :mod:`.lookups` (a step's lookups, read ahead, and pushes),
  :mod:`.overflow` (fp16: the trainers agree on the rows' overflow) and :mod:`.checkpoints` (the shards);
* :mod:`.heterogeneous`: :class:`HeterogeneousLayerOffloadStrategy`, ``HeterogeneousDDPStrategy`` holding one
  :class:`EmbeddingOffload` the same way;
* :mod:`.runner_profile`: :func:`profile_runner`, what a step of the strategy costs outside the model's layers,
  for the placement planner.
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
