""":class:`LayerOffloadStrategy`: Lightning's DDP for the dense layers, the embedding tables on CPU servers."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dynamix.offload import SparseRowOptimizer
from lightning_dynamix.placement import PlacementPlan
from lightning_dynamix.strategies.layer_offload.embedding_offload import EmbeddingOffload, with_offload_attributes

STRATEGY_NAME = "layer_offload"


@with_offload_attributes
class LayerOffloadStrategy(DDPStrategy):
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

    # training ------------------------------------------------------------------------------------------

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        closure = self.embedding_offload.before_optimizer_step(optimizer, closure)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        # the servers take the mean of the trainers' row gradients, as DDP of the dense ones
        self.embedding_offload.after_optimizer_step(row_gradient_weight=1.0 / self.world_size)
        return output

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self.embedding_offload.read_ahead(super().process_dataloader(dataloader))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.embedding_offload.prefetch_for_step(args, kwargs, training=True)
        return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self.embedding_offload.prefetch_for_step(args, kwargs)
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self.embedding_offload.prefetch_for_step(args, kwargs)
        return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self.embedding_offload.prefetch_for_step(args, kwargs)
        return super().predict_step(*args, **kwargs)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.embedding_offload.flush()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self.embedding_offload.flush()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self.embedding_offload.flush()

    # checkpoints -----------------------------------------------------------------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        self.embedding_offload.save_shards(checkpoint, filepath)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        self.embedding_offload.remove_shards(filepath)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the servers must exist to take their shards back

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self.embedding_offload.remember_checkpoint(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        self.embedding_offload.load_shards(checkpoint)

    # the end ---------------------------------------------------------------------------------------------

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.embedding_offload.note_failure()
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self.embedding_offload.teardown()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            STRATEGY_NAME,
            cls,
            description="DDP for the dense layers with the embedding tables on CPU embedding servers",
        )


LayerOffloadStrategy.register_strategies(StrategyRegistry)
