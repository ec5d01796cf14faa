"""Sharded data parallel (FSDP2) where every rank trains on its own batch size, with exact gradients.

:class:`HeterogeneousFSDPStrategy` is Lightning's ``ModelParallelStrategy`` (``configure_model`` applies
``fully_shard``) with the per-rank batch core: one global schedule of per-rank batches, each rank's loss scaled by
its share of the global batch times the world size (FSDP2's reduce-scatter averages), a window's correction on the
sharded gradients, and a rank without samples running one sample of the step at weight 0, so that it takes part in
every all-gather and reduce-scatter.

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/strategies/heterogeneous_fsdp.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Sequence
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dynamix import _compat
from lightning_dynamix.batch_core import GradientNormSink, PerRankBatchCore
from lightning_dynamix.data.items import ItemCounter
from lightning_dynamix.distributed import LossReduction
from lightning_dynamix.distributed.batch_norm import statistics_over
from lightning_dynamix.distributed.sharded import (
    check_fully_sharded,
    fsdp_modules,
    is_sharded,
    scale_gradients,
    set_gradient_sync,
    time_collectives,
)
from lightning_dynamix.metrics.clocks import TimeSource
from lightning_dynamix.metrics.timers import StepClock
from lightning_dynamix.strategies.per_rank import PerRankBatchStrategy

STRATEGY_NAME = "heterogeneous_fsdp"


class HeterogeneousFSDPStrategy(PerRankBatchStrategy, ModelParallelStrategy):
    """FSDP2 (``fully_shard``) with a batch size per rank that can change at any step, and exact gradients.

    Shard the model in the LightningModule's ``configure_model``, over the strategy's data-parallel mesh::

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    Args:
        batch_sizes, min_batch_size, max_batch_size, loss_reduction, shuffle, seed, drop_last, batch_size_caps,
            count_items, group_by_length: as for :class:`~lightning_dynamix.strategies.HeterogeneousDDPStrategy`.
            A rank given 0 samples (``min_batch_size=0``) still runs the model, on one sample of the step at
            weight 0: FSDP's all-gathers and reduce-scatters need every rank.
        save_distributed_checkpoint: each rank saves its shard with torch distributed checkpoint (a folder), or
            rank 0 saves the full state (one file); as ``ModelParallelStrategy``.
        process_group_backend: ``"gloo"`` (CPU, or CUDA tensors too) or ``"nccl"``; ``None``: the device's default.
        timeout: the process group's timeout.

    Every rank is one data-parallel rank (the mesh's ``"data_parallel"`` dimension spans the job; tensor
    parallelism is not combined with per-rank batches).

    Raises:
        ValueError: at construction, as ``HeterogeneousDDPStrategy`` raises for the batch arguments.
        MisconfigurationException: at set-up, for a model ``configure_model`` left with parameters that are not
            sharded (their gradients would never be synchronised), manual optimisation, and as
            ``HeterogeneousDDPStrategy`` raises for the data and the sizes.
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        batch_sizes: Sequence[int] | None = None,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        loss_reduction: LossReduction = "mean",
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        batch_size_caps: Sequence[int | None] | None = None,
        count_items: ItemCounter | None = None,
        group_by_length: int | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        self.batch_core = PerRankBatchCore(
            type(self).__name__,
            batch_sizes,
            min_batch_size=min_batch_size,
            max_batch_size=max_batch_size,
            loss_reduction=loss_reduction,
            count_items=count_items,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            group_by_length=group_by_length,
            batch_size_caps=batch_size_caps,
            world_size_hint=" (devices x num_nodes)",
            setup_error=MisconfigurationException,
        )
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._start_per_rank()
        self._placeholder = False  # whether this rank runs the step being trained on a placeholder at weight 0
        self._gradient_sync_blocked = False
        self._fsdp_modules: list[FSDPModule] = []

    # ------------------------------------------------------------------ set-up
    @override
    def setup_environment(self) -> None:
        # the data-parallel dimension spans every rank: each has its own batch
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    @override
    def setup(self, trainer: Any) -> None:
        if _compat.layer_sync(self) is not None:
            # ModelParallelStrategy applies no layer sync, and swapping layers after fully_shard would unhook FSDP
            raise MisconfigurationException(
                "HeterogeneousFSDPStrategy does not take Trainer(sync_batchnorm=True): convert the model's BatchNorm"
                " layers in configure_model, before fully_shard (lightning_dynamix.distributed.batch_norm."
                "convert_batch_norm), for statistics over the global batch."
            )
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        assert self.model is not None
        check_fully_sharded(self.model, "HeterogeneousFSDPStrategy: after configure_model", MisconfigurationException)
        self._fsdp_modules = fsdp_modules(self.model)
        module = self.lightning_module
        assert module is not None
        try:
            self.batch_core.fit_model(module, self.world_size)
        except ValueError as error:
            raise MisconfigurationException(str(error)) from None
        self.batch_core.check_world_size(self.world_size)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        module = self.lightning_module
        assert module is not None
        self._check_training_setup(module.trainer)
        if self._step_clock is not None:  # FSDP's all-gathers and reduce-scatters: waiting, not compute
            assert self.model is not None
            time_collectives(self.model, self._step_clock)
        if not module.automatic_optimization:
            raise MisconfigurationException(
                "HeterogeneousFSDPStrategy needs automatic optimisation: it weights each backward pass by the rank's"
                " share of the step and synchronises at the end of the accumulation window Lightning runs. Use"
                " HeterogeneousDDPStrategy (min_batch_size >= 1) for a manually optimised training_step."
            )

    # ------------------------------------------------------------------ per-step hooks
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        loader = self.batch_core.loader
        module = self.lightning_module
        assert module is not None
        self._placeholder = loader is not None and loader.current_step >= 0 and loader.sits_out
        if self._placeholder:
            assert loader is not None
            # FSDP's all-gathers and reduce-scatters need every rank: one sample of the step, trained at weight 0
            args = (self.batch_to_device(loader.placeholder_batch()), *args[1:])
            _compat.logged_results(module.trainer).batch_size = 0  # what it logs weighs nothing in the epoch's means
        self._in_training_step = True
        try:
            with statistics_over(None, self._step_clock, placeholder=self._placeholder):
                return super().training_step(*args, **kwargs)
        finally:
            self._in_training_step = False

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Inside the block FSDP2 keeps the unsharded gradients (no reduce-scatter): Lightning accumulates."""
        set_gradient_sync(self._fsdp_modules, False)
        self._gradient_sync_blocked = True
        try:
            yield
        finally:
            self._gradient_sync_blocked = False
            set_gradient_sync(self._fsdp_modules, True)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        module = self.lightning_module
        loader = self.batch_core.loader
        training = module is not None and module.trainer.training and loader is not None and loader.current_step >= 0
        syncing = False
        if training:
            assert module is not None
            accumulate = module.trainer.accumulate_grad_batches
            syncing = not self._gradient_sync_blocked
            # FSDP2's reduce-scatter averages over the ranks where DDP's hook sums: the loss carries W times the share
            scale = 0.0 if self._placeholder else float(self.world_size)
            self.batch_core.weight_backward(
                closure_loss, 1.0 / accumulate, self._window_end(accumulate), syncing, scale
            )
        output = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self._step_clock is not None:
            self._step_clock.backward_end()
        if syncing:
            assert self.model is not None  # the window's correction, where sizes changed inside it (else 1)
            scale_gradients(self.model, self.batch_core.hook_state.weight)
            self.batch_core.end_window()
        return output

    @override
    def enable_step_clock(self, time_source: TimeSource | None = None) -> StepClock:
        clock = super().enable_step_clock(time_source)
        if self.model is not None and is_sharded(self.model):  # else at the start of training, once sharded
            time_collectives(self.model, clock)
        return clock

    @override
    def enable_gradient_norms(self, sink: GradientNormSink | None) -> None:
        """Not measured under FSDP2 (its reduce-scatter hands no rank its own gradient): the noise scale stays NaN."""
        if sink is not None:
            rank_zero_warn(
                "HeterogeneousFSDPStrategy measures no gradient noise scale: FSDP2's reduce-scatter hands no rank its"
                " own full gradient. Controllers that use it (goodput) keep the global batch; pass"
                " gradient_noise_scale=False to the callback to silence this."
            )

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(
                STRATEGY_NAME,
                cls,
                description="FSDP2 with a batch size per rank, changeable at any step, and exactly weighted gradients",
            )


HeterogeneousFSDPStrategy.register_strategies(StrategyRegistry)
