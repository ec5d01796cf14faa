"""Lightning DDP where every rank trains on its own batch size, with exact gradients.

:class:`HeterogeneousDDPStrategy` is Lightning's ``DDPStrategy`` plus three things:

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/strategies/heterogeneous_ddp.py``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dynamix import _compat
from lightning_dynamix._checks import require_bool
from lightning_dynamix.batch_core import PerRankBatchCore
from lightning_dynamix.data.items import ItemCounter
from lightning_dynamix.data.schedule import BatchSizes
from lightning_dynamix.distributed import (
    LossReduction,
    StaleRanks,
    can_leave_gradient_sync,
    let_backend_threads_finish,
    training_ranks_groups,
    weighted_allreduce_hook,
    zero_gradient_loss,
)
from lightning_dynamix.distributed.batch_norm import has_global_batch_norm, statistics_over
from lightning_dynamix.strategies.layer_sync import GlobalBatchNormSync
from lightning_dynamix.strategies.memory_recovery import OutOfMemoryRecovery, recovery_obstacles
from lightning_dynamix.strategies.per_rank import PerRankBatchStrategy

log = logging.getLogger(__name__)

STRATEGY_NAME = "heterogeneous_ddp"
_UNSUPPORTED_DDP_ARGUMENTS = ("ddp_comm_hook", "ddp_comm_state", "model_averaging_period")


class HeterogeneousDDPStrategy(PerRankBatchStrategy, DDPStrategy):
    """DDP with a batch size per rank that can change at any step, and exact gradients.

    Args:
        batch_sizes: one initial batch size per rank; default: the training DataLoader's
            ``batch_size`` on every rank.
        min_batch_size: the smallest size any rank may be given; 0 lets a rank sit steps out (see
            above). Default: 1, or 2 for a model with BatchNorm (without ``sync_batchnorm``).
        max_batch_size: the largest size any rank may be given, at least 1; ``None`` for no limit.
            (The last step of an epoch may give a rank one sample more, or a few more where ranks
            sit out; see :mod:`lightning_dynamix.data.schedule`.)
        loss_reduction: ``"mean"`` if the training loss averages over the rank's samples (the
            usual case), ``"sum"`` if it sums over them. The synchronised gradient then equals the
            gradient of the same loss computed by one process on the whole global batch.
        shuffle: reshuffle the training data every epoch (seeded with ``seed + epoch``).
        seed: seed of the training order; the same on every rank.
        drop_last: skip the incomplete last step of each epoch instead of spreading the
            remaining samples over the ranks (also on when the DataLoader has ``drop_last=True``).
        batch_size_caps: the largest size each rank's machine holds, one entry per rank (``None`` for no cap of
            its own); every decision keeps within them. Default: no caps; on a GPU the callbacks also measure
            what the device's memory holds.
        recover_out_of_memory: a step at which a rank trains more samples than it ever did and runs out of
            memory is trained again, split anew, with that rank capped (see
            :mod:`~lightning_dynamix.strategies.memory_recovery`). ``None`` (default): wherever it can be (automatic
            optimisation, no gradient accumulation, no ``GlobalBatchNorm``); ``True``: required (an error at set-up
            where it cannot be); ``False``: never, the error ends the job.
        count_items: for a loss that is a mean over *items* (a language model's tokens): ``count(batch) -> int``,
            the items of a batch (:class:`~lightning_dynamix.LabelTokens` counts labels not ignored); the
            gradients are then weighted by every rank's share of the global batch's items, gathered before each
            backward. ``None`` (default): by samples.
        group_by_length: batch by length (a language model's sequences): each run of this many samples of the
            epoch's order is sorted by length, longest first, so a step's samples have alike lengths and little
            padding; several global batches (e.g. 50x). Lengths are the dataset's ``lengths`` or each sample's
            ``input_ids``. ``None`` (default): not. See docs/transformers.md.
        **ddp_kwargs: any other ``DDPStrategy`` argument (``process_group_backend``, ``timeout``,
            ``start_method``, ``ddp_comm_wrapper``, ``find_unused_parameters``...), except a
            custom ``ddp_comm_hook``/``ddp_comm_state`` or post-local-SGD averaging: this strategy
            owns the communication hook.

    Raises:
        ValueError: at construction, for sizes that are not ints, lie outside
            ``[min_batch_size, max_batch_size]`` or are all 0, bad bounds, an unknown ``loss_reduction`` or an
            unsupported DDP argument.
        MisconfigurationException: at set-up, for a number of sizes other than the world size,
            an iterable-style dataset, a dataset smaller than one global batch, a custom sampler
            or batch sampler, more than one training DataLoader, manual optimisation with
            ``min_batch_size=0``, or a ``min_batch_size`` or size a model's BatchNorm layer cannot train
            (naming the layer).
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
        recover_out_of_memory: bool | None = None,
        count_items: ItemCounter | None = None,
        group_by_length: int | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        for name in _UNSUPPORTED_DDP_ARGUMENTS:
            if ddp_kwargs.get(name) is not None:
                raise ValueError(
                    f"`{name}` is not supported by HeterogeneousDDPStrategy, which registers its own"
                    " weighted all-reduce hook; wrap it with `ddp_comm_wrapper` (e.g. fp16 compression)"
                    f" instead, or use Lightning's DDPStrategy. Got {name}={ddp_kwargs[name]!r}."
                )
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
        """The per-rank batch core: sizes, bounds, caps, the training DataLoader and the gradient weights."""
        self.recover_out_of_memory = (
            None if recover_out_of_memory is None else require_bool("recover_out_of_memory", recover_out_of_memory)
        )
        self._memory: OutOfMemoryRecovery | None = None
        super().__init__(**ddp_kwargs)
        self._start_per_rank()
        self._stale = StaleRanks()
        self._left_step = False  # whether this rank skips the step being trained
        self._global_batch_norm = False

    @property
    def steps_recovered_from_out_of_memory(self) -> int:
        """Steps trained again, split anew, after a rank ran out of memory."""
        return self._memory.recovered if self._memory is not None else 0

    # ------------------------------------------------------------------ DDP set-up
    @override
    def setup_environment(self) -> None:
        device = self.root_device
        if self.process_group_backend == "nccl" and device.type != "cuda":
            # before the process group: NCCL would fail later, on this rank's first collective, without saying why
            raise MisconfigurationException(
                f"HeterogeneousDDPStrategy(process_group_backend='nccl') on rank {self.global_rank}, which trains on"
                f" {device}: NCCL carries CUDA tensors only, so every rank must train on a GPU. For a job that mixes"
                " GPU and CPU ranks use process_group_backend='gloo' (which carries CUDA and CPU tensors alike)."
            )
        super().setup_environment()

    @override
    def setup(self, trainer: Any) -> None:
        sync = isinstance(_compat.layer_sync(self), TorchSyncBatchNorm) and trainer.state.fn == TrainerFn.FITTING
        if sync:  # torch's SyncBatchNorm needs GPUs and one group for good; ours any device and the ranks that train
            _compat.set_layer_sync(self, GlobalBatchNormSync())
            given = self._ddp_kwargs.get("broadcast_buffers")
            if given and self.min_batch_size == 0:
                raise MisconfigurationException(
                    "HeterogeneousDDPStrategy(broadcast_buffers=True) with sync_batchnorm=True and min_batch_size=0:"
                    " a rank that sits steps out holds stale running statistics, and DDP would broadcast them from"
                    " rank 0. Leave broadcast_buffers unset (the synchronised statistics are the same on every rank)."
                )
            self._ddp_kwargs.setdefault("broadcast_buffers", False)
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._fit_batch_dependent_layers()

    def _fit_batch_dependent_layers(self) -> None:
        """Raise the smallest size to what the model's batch-dependent layers need; refuse an explicit smaller one."""
        module = self.lightning_module
        assert module is not None
        try:
            self.batch_core.fit_model(module, self.world_size)
        except ValueError as error:
            raise MisconfigurationException(str(error)) from None

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        let_backend_threads_finish()
        caps = self.batch_core.check_world_size(self.world_size)
        if self._memory is None:
            self._memory = OutOfMemoryRecovery(
                self.world_size, self.global_rank, caps, self.recover_out_of_memory is not False
            )
            self._memory.setup(self._timeout)  # a collective at a process's first fit: every rank configures DDP

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning's DDPStrategy registers hooks on CUDA only; the weights must apply everywhere
        assert isinstance(self.model, DistributedDataParallel)
        hook = weighted_allreduce_hook
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        self.model.register_comm_hook(state=self.batch_core.hook_state, hook=hook)

    # ------------------------------------------------------------------ per-step hooks
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._stale.clear()
        self._global_batch_norm = has_global_batch_norm(self.lightning_module)
        trainer = self.lightning_module.trainer
        self._check_training_setup(trainer)
        if self._memory is not None:
            self._memory.enabled = self.recover_out_of_memory is not False and self._can_recover_out_of_memory(trainer)
        if self.min_batch_size == 0 and not self.lightning_module.automatic_optimization:
            raise MisconfigurationException(
                "HeterogeneousDDPStrategy(min_batch_size=0) needs automatic optimisation: a rank that sits a step"
                " out does not run training_step, so it could not join the backward passes and optimizer steps a"
                " manually optimised training_step makes. Use min_batch_size >= 1, or automatic optimisation."
            )

    def _can_recover_out_of_memory(self, trainer: Any) -> bool:
        """Whether a failed attempt can be the whole optimizer step, trained again. Raises where it was required."""
        reasons = recovery_obstacles(
            self.lightning_module.automatic_optimization, trainer.accumulate_grad_batches, self._global_batch_norm
        )
        reasons += self._out_of_memory_obstacles()
        if reasons and self.recover_out_of_memory:
            raise MisconfigurationException(
                f"{type(self).__name__}(recover_out_of_memory=True) cannot retry a step here: {'; '.join(reasons)}."
                " Leave recover_out_of_memory=None (recovery where it can be) or set it to False."
            )
        return not reasons

    def _out_of_memory_obstacles(self) -> list[str]:
        """What else keeps a step from being trained again (a subclass's own reasons)."""
        return []

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        loader = self.batch_core.loader
        self._left_step = False
        if loader is not None and loader.current_step >= 0 and isinstance(self.model, DistributedDataParallel):
            sizes = loader.current_batch_sizes
            # every rank, those that sit out too, agrees on the group of the ranks that train, before they use it
            group = training_ranks_groups().prepare(sizes, self._timeout)
            out = self._ranks_leaving(sizes)
            # with GlobalBatchNorm a rank without samples misses the running statistics' update, left or joined
            out_of_step = {r for r, b in enumerate(sizes) if b == 0} if self._global_batch_norm else out
            # a rank that skipped steps and trains again needs the others' state first; these miss this step's update
            self._stale.at_step(out_of_step, self.lightning_module, self.lightning_module.trainer.optimizers)
            if loader.sits_out:
                return self._loss_without_samples(left=self.global_rank in out)
            # the ranks that train all-reduce among themselves while others are away
            self.batch_core.hook_state.process_group = group if out else None
            statistics = group  # None where every rank trains
            memory = self._memory
            if memory is not None and (memory.retry_pending or memory.is_trial(sizes)):
                self._in_training_step = True
                try:  # without DDP's all-reduce: see backward
                    return memory.train_attempt(
                        self.model, self.root_device, self._step_clock, super().training_step, *args, **kwargs
                    )
                finally:
                    self._in_training_step = False
        else:
            statistics = None
        self._in_training_step = True
        try:
            # GlobalBatchNorm's statistics: over the ranks that train this step
            with statistics_over(statistics, self._step_clock):
                return super().training_step(*args, **kwargs)
        finally:
            self._in_training_step = False

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        memory = self._memory
        if memory is not None and memory.enabled:
            closure = functools.partial(memory.until_trained, closure)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _loss_without_samples(self, left: bool) -> Tensor:
        """The loss of a rank with no samples: it leaves the step (``left``), or joins the all-reduce with nothing."""
        self._left_step = left
        if left:  # a loss without parameters: nothing of DDP runs
            return torch.zeros((), device=self.root_device, requires_grad=True)
        # a loss of 0 through DDP's forward: a zero gradient of weight 0
        with self.precision_plugin.train_step_context():
            return zero_gradient_loss(self.model)

    def _ranks_leaving(self, sizes: BatchSizes) -> set[int]:
        """The ranks with no samples that skip this step altogether: away from the gradient all-reduce.

        Only where one step is one synchronisation (no gradient accumulation, whose window's later
        sizes may still change), no GradScaler (its scale follows every optimizer step) and DDP makes no
        collective of its own in forward or backward (:func:`can_leave_gradient_sync`); elsewhere they
        join the all-reduce with a zero gradient.
        """
        if min(sizes) > 0:
            return set()
        model, module = self.model, self.lightning_module
        assert isinstance(model, DistributedDataParallel)
        assert module is not None
        if (
            module.trainer.accumulate_grad_batches != 1
            or getattr(self.precision_plugin, "scaler", None) is not None
            or not can_leave_gradient_sync(model)
        ):
            return set()
        return {r for r, b in enumerate(sizes) if b == 0}

    def _sync_stale_ranks(self) -> None:
        """Give the ranks that skipped optimizer steps the others' state (a collective, on every rank)."""
        module = self.lightning_module
        assert module is not None
        self._stale.sync(module, module.trainer.optimizers)

    @override
    def on_validation_start(self) -> None:
        self._sync_stale_ranks()
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        self._sync_stale_ranks()
        super().on_train_end()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._sync_stale_ranks()  # a checkpoint: every rank makes it, rank 0 writes it
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        self._sync_stale_ranks()
        return super().optimizer_state(optimizer)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._memory is not None and self._memory.in_trial:
            assert isinstance(self.model, DistributedDataParallel)
            return self._memory.settle(
                self.model,
                self.root_device,
                self._step_clock,
                self.batch_core,
                closure_loss,
                lambda loss: super(HeterogeneousDDPStrategy, self).backward(loss, optimizer, *args, **kwargs),
                self.batch_to_device,
            )
        if self._left_step:  # the rank skips this step: no weights, no synchronisation
            output = super().backward(closure_loss, optimizer, *args, **kwargs)
            if self._step_clock is not None:
                self._step_clock.backward_end()
            return output
        module = self.lightning_module
        syncing = False
        training = module is not None and module.trainer.training and self.batch_core.loader is not None
        if training and isinstance(self.model, DistributedDataParallel):
            trainer = module.trainer
            accumulate = trainer.accumulate_grad_batches if module.automatic_optimization else 1
            syncing = self.model.require_backward_grad_sync
            self.batch_core.weight_backward(closure_loss, 1.0 / accumulate, self._window_end(accumulate), syncing)
        output = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self._step_clock is not None:
            self._step_clock.backward_end()
        if syncing:
            self.batch_core.end_window()
        return output

    @override
    def _training_group(self, sizes: BatchSizes) -> Any:
        # ranks that sit a step out do not run training_step: the others reduce among themselves
        return training_ranks_groups().group(sizes, self._timeout)

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(
                STRATEGY_NAME,
                cls,
                description="DDP with a batch size per rank, changeable at any step, and exactly weighted gradients",
            )


HeterogeneousDDPStrategy.register_strategies(StrategyRegistry)
