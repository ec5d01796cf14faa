""":class:`HeterogeneousLayerOffloadStrategy`: the layer offload with a batch size per trainer rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_dynamix.data.items import ItemCounter
from lightning_dynamix.distributed import LossReduction
from lightning_dynamix.metrics.clocks import Mark
from lightning_dynamix.strategies.heterogeneous_ddp import HeterogeneousDDPStrategy
from lightning_dynamix.strategies.layer_offload.embedding_offload import (
    EmbeddingOffload,
    advertises_offload_arguments,
    offload_arguments,
)
from lightning_dynamix.strategies.layer_offload.hooks import EmbeddingOffloadHooks

HETEROGENEOUS_STRATEGY_NAME = "heterogeneous_layer_offload"


class HeterogeneousLayerOffloadStrategy(EmbeddingOffloadHooks, HeterogeneousDDPStrategy):
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
        min_batch_size, max_batch_size, loss_reduction, shuffle, seed, drop_last, batch_size_caps,
            group_by_length: as for :class:`~lightning_dynamix.strategies.HeterogeneousDDPStrategy`.
        recover_out_of_memory: ``None`` or ``False``: a trainer that runs out of memory ends the job (an
            attempt's row gradients reach the servers, so a step cannot be trained again); ``True`` is refused
            at set-up.
        count_items: only ``None`` (weights by samples): the servers weight the rows by samples, so a
            ``count_items`` is refused (ValueError).
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
        count_items: ItemCounter | None = None,
        group_by_length: int | None = None,
        **kwargs: Any,
    ) -> None:
        if count_items is not None:
            raise ValueError(
                f"`count_items` is not supported by {type(self).__name__}: the servers weight the tables' rows by"
                f" each trainer's samples, so a loss that is a mean over items would not be exact. Got"
                f" count_items={count_items!r}; weight by samples (count_items=None)."
            )
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
            group_by_length=group_by_length,
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

    @override
    def _row_gradient_weight(self) -> float:
        # the trainer's share of the global batch is in its gradients already (the factor on its loss's gradient);
        # the all-reduce multiplies the dense ones by the window's correction and sums: so do the servers
        return self.sync_weight

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
