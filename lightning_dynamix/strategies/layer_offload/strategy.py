""":class:`LayerOffloadStrategy`: Lightning's DDP for the dense layers, the embedding tables on CPU servers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from typing_extensions import override

from lightning_dynamix.offload import SparseRowOptimizer
from lightning_dynamix.placement import PlacementPlan
from lightning_dynamix.strategies.layer_offload.embedding_offload import EmbeddingOffload
from lightning_dynamix.strategies.layer_offload.hooks import EmbeddingOffloadHooks

STRATEGY_NAME = "layer_offload"


class LayerOffloadStrategy(EmbeddingOffloadHooks, DDPStrategy):
    """DDP for the dense layers, with the embedding tables on CPU embedding servers.

    The offload is the strategy's :class:`~lightning_dynamix.strategies.layer_offload.EmbeddingOffload`
    (``embedding_offload``), to which its hooks delegate; its arguments are the strategy's attributes too
    (``strategy.num_embedding_servers``, ``strategy.plan``, ``strategy.client``, ...).

    Args:
        num_embedding_servers: CPU processes the tables' rows are sharded over; default 1, or with a
            plan the units of its CPU stages that hold tables.
        offload: ``"auto"`` for every ``nn.Embedding`` / ``nn.EmbeddingBag`` of the LightningModule,
            the names of the ones to offload (as in ``named_modules()``), or a
            :class:`~lightning_dynamix.placement.PlacementPlan` (or the path of one, ``.json`` or
            ``.yaml``): the tables it puts on CPU resource types.
        sparse_optimizer: the servers' optimiser: ``"sgd"``, ``"adagrad"`` or a
            :class:`~lightning_dynamix.offload.SparseRowOptimizer`; None (default) mirrors the
            LightningModule's optimizer (``torch.optim.SGD`` without momentum or weight decay, or
            ``torch.optim.Adagrad``) with its hyperparameters.
        sparse_optimizer_args: arguments of a named ``sparse_optimizer``; ``lr`` defaults to the
            LightningModule's optimizer's.
        staleness: updates an embedding lookup may miss: 0 is synchronous; 1 overlaps each step's
            embedding update with the next step.
        launch_servers: start the servers as local processes (one machine); False when they are
            started with ``python -m lightning_dynamix.serve`` (a cluster).
        server_port: the port on trainer rank 0's machine where trainers and servers meet; required
            with ``launch_servers=False``, a free one by default otherwise.
        return_embeddings: at the end of ``fit``, copy the trained tables back into the
            LightningModule's embedding modules on every trainer; set False for tables too large for a
            trainer (the checkpoint holds them).
        prefetch_depth: training batches read ahead, whose rows are asked for while the steps before
            them run (their lookups then overlap the trainer's compute). Needs the LightningModule's
            ``embedding_ids``, one optimizer step per batch (no ``accumulate_grad_batches``), and a
            DataLoader that keeps no state of what it handed out (a stateful loader or batch sampler would
            count the batch read ahead as trained), or a ``HeterogeneousDataLoader``, which reads ahead
            beneath its count. 0 looks each step up when it starts. None (default): 1 where all hold, else 0.
        trainer_threads: torch's intra-op threads in each trainer process while it trains. None
            (default): on the machine that runs the launched servers, at most its cores less one per
            server, shared by its trainers (at least 1), so the servers have cores of their own (idle
            intra-op threads spin on a core and the servers' answers wait for it); elsewhere as set.
        **kwargs: Lightning's ``DDPStrategy`` arguments (``timeout`` also bounds every wait for a server).
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        num_embedding_servers: int | None = None,
        offload: str | Sequence[str] | PlacementPlan = "auto",
        sparse_optimizer: str | SparseRowOptimizer | None = None,
        sparse_optimizer_args: Mapping[str, Any] | None = None,
        staleness: int = 0,
        launch_servers: bool = True,
        server_port: int | None = None,
        return_embeddings: bool = True,
        prefetch_depth: int | None = None,
        trainer_threads: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.embedding_offload = EmbeddingOffload(
            num_embedding_servers=num_embedding_servers,
            offload=offload,
            sparse_optimizer=sparse_optimizer,
            sparse_optimizer_args=sparse_optimizer_args,
            staleness=staleness,
            launch_servers=launch_servers,
            server_port=server_port,
            return_embeddings=return_embeddings,
            prefetch_depth=prefetch_depth,
            trainer_threads=trainer_threads,
        )

    # set-up ----------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Any) -> None:
        self.embedding_offload.take_tables(self, trainer, self._timeout.total_seconds())
        super().setup(trainer)  # DDP over the dense rest; the optimizers are configured from it
        self.embedding_offload.create_tables(trainer)

    @override
    def _row_gradient_weight(self) -> float:
        return 1.0 / self.world_size  # the servers take the mean of the trainers' row gradients, as DDP's dense ones

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            STRATEGY_NAME,
            cls,
            description="DDP for the dense layers with the embedding tables on CPU embedding servers",
        )


LayerOffloadStrategy.register_strategies(StrategyRegistry)
