""":class:`HeterogeneousLayerOffloadStrategy`: the layer offload with a batch size per trainer rank."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dynamix.distributed import LossReduction
from lightning_dynamix.metrics.clocks import Mark
from lightning_dynamix.strategies.heterogeneous_ddp import HeterogeneousDDPStrategy
from lightning_dynamix.strategies.layer_offload.embedding_offload import (
    EmbeddingOffload,
    advertises_offload_arguments,
    offload_arguments,
    with_offload_attributes,
)

HETEROGENEOUS_STRATEGY_NAME = "heterogeneous_layer_offload"


@with_offload_attributes
class HeterogeneousLayerOffloadStrategy(HeterogeneousDDPStrategy):
    """:class:`~lightning_dynamix.strategies.LayerOffloadStrategy` with a batch size per trainer rank, changeable
    at any step.

    The trainer ranks train as :class:`~lightning_dynamix.strategies.HeterogeneousDDPStrategy` trains its
    ranks (one global schedule of per-rank batches, a rank with 0 samples sitting the step out): each
    trainer's gradients, the dense ones and its tables' rows alike, carry its share of the global batch,
    the dense ones are summed by the weighted all-reduce and the rows by the servers, so training is exactly
    that of one process on the global batch. ``DynamixCallback`` measures and resizes the trainers as it
    does any heterogeneous job; the embedding servers take no batch. The offload is the strategy's
    :class:`~lightning_dynamix.strategies.layer_offload.EmbeddingOffload` (``embedding_offload``), as
    ``LayerOffloadStrategy``'s is.

    Args:
        batch_sizes: one initial batch size per trainer rank (``devices * num_nodes`` of them); default the
            training DataLoader's ``batch_size`` on every trainer.
        min_batch_size, max_batch_size, loss_reduction, shuffle, seed, drop_last, batch_size_caps: as for
            :class:`~lightning_dynamix.strategies.HeterogeneousDDPStrategy`.
        recover_out_of_memory: ``None`` or ``False``: a trainer that runs out of memory ends the job (an
            attempt's row gradients reach the servers, so a step cannot be trained again); ``True`` is refused
            at set-up.
        num_embedding_servers, offload, sparse_optimizer, sparse_optimizer_args, staleness, launch_servers,
            server_port, return_embeddings, prefetch_depth, trainer_threads: as for
            :class:`~lightning_dynamix.strategies.LayerOffloadStrategy`
            (pipelined lookups read the heterogeneous DataLoader ahead).
        **kwargs: the offload arguments above, and Lightning's ``DDPStrategy`` arguments, except a communication
            hook of its own. Every argument but ``batch_sizes`` is given by name.

    Raises:
        ValueError: at construction, as either strategy raises for its arguments.
        MisconfigurationException: at set-up, before any server starts, for a number of ``batch_sizes``
            other than the number of trainer ranks; the rest as both strategies raise.
    """

    strategy_name = HETEROGENEOUS_STRATEGY_NAME

    @advertises_offload_arguments
    def __init__(
        self,
        batch_sizes: Sequence[int] | None = None,
        *,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        loss_reduction: LossReduction = "mean",
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        batch_size_caps: Sequence[int | None] | None = None,
        recover_out_of_memory: bool | None = None,
        **kwargs: Any,
    ) -> None:
        offload = offload_arguments(kwargs)  # the rest are DDP's
        super().__init__(
            batch_sizes=batch_sizes,
            min_batch_size=min_batch_size,
            max_batch_size=max_batch_size,
            loss_reduction=loss_reduction,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            batch_size_caps=batch_size_caps,
            recover_out_of_memory=recover_out_of_memory,
            **kwargs,
        )
        self.embedding_offload = EmbeddingOffload(**offload)

    # set-up ----------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Any) -> None:
        sizes = self.batch_sizes
        if sizes is not None and len(sizes) != self.world_size:
            raise MisconfigurationException(
                f"`batch_sizes` {list(sizes)} gives {len(sizes)} trainer ranks a size, but the Trainer has"
                f" {self.world_size} (devices x num_nodes); give one size per trainer rank (the embedding servers"
                " take no batch)"
            )
        self.embedding_offload.take_tables(
            self, trainer, self._timeout.total_seconds(), server_waited=_ServerWaits(self)
        )
        super().setup(trainer)  # DDP over the dense rest; the optimizers are configured from it
        self.embedding_offload.create_tables(trainer)

    @override
    def _out_of_memory_obstacles(self) -> list[str]:
        # an attempt's lookups and row gradients reach the embedding servers: a retry would push them twice
        return ["the embedding tables' row gradients of an attempt reach the servers"]

    # training ------------------------------------------------------------------------------------------

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        closure = self.embedding_offload.before_optimizer_step(optimizer, closure)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        # the trainer's share of the global batch is in its gradients already (the factor on its loss's
        # gradient); the all-reduce multiplies the dense ones by the window's correction and sums: so do the servers
        self.embedding_offload.after_optimizer_step(row_gradient_weight=self.sync_weight)
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
            HETEROGENEOUS_STRATEGY_NAME,
            cls,
            description="LayerOffloadStrategy with a batch size per trainer rank and exactly weighted gradients",
        )


HeterogeneousLayerOffloadStrategy.register_strategies(StrategyRegistry)


class _ServerWaits:
    """A trainer's waits for the embedding servers, on its step clock: the servers answer once every trainer
    pushed the update the lookup must see, a wait for the other trainers (and the servers), which the step clock
    must not count as this trainer's compute."""

    def __init__(self, strategy: HeterogeneousLayerOffloadStrategy) -> None:
        self._strategy = strategy

    def now(self) -> Mark:
        clock = self._strategy.step_clock
        return clock.now() if clock is not None else None

    def collective(self, started: Mark, ended: Mark) -> None:
        clock = self._strategy.step_clock
        if clock is not None and started is not None and self._strategy.in_training_step:
            clock.collective(started, ended)
