"""What every Lightning strategy with a batch size per rank shares, whatever engine synchronises the gradients.

:class:`PerRankBatchStrategy` is the Lightning side of the per-rank batch core
(:class:`~lightning_dynamix.batch_core.PerRankBatchCore`): the public API the callbacks use (the sizes, their
bounds and caps, :meth:`~PerRankBatchStrategy.set_batch_sizes`, the step clock, the gradient norms), the training
DataLoader rebuilt around the rank's batch sampler with Lightning's epoch length kept right, the position in the
data saved and resumed with the checkpoint, and ``self.log(..., sync_dist=True)`` inside ``training_step``
averaged by every rank's share of the step. ``HeterogeneousDDPStrategy`` (DDP's weighted all-reduce) and
``HeterogeneousFSDPStrategy`` (FSDP2's reduce-scatter) each add only how their engine weights and synchronises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_dynamix import _compat
from lightning_dynamix._forwarding import Forwarded
from lightning_dynamix.batch_core import GradientNormSink, PerRankBatchCore
from lightning_dynamix.data import HeterogeneousBatchSampler
from lightning_dynamix.data.schedule import BatchSizes
from lightning_dynamix.distributed import BucketNorms, mean_by_counts_all_reduce
from lightning_dynamix.metrics.clocks import TimeSource, time_source_for
from lightning_dynamix.metrics.timers import StepClock
from lightning_dynamix.strategies.epoch_metrics import EpochMetricsAgreement

if TYPE_CHECKING:
    import torch
    from lightning.pytorch import LightningModule, Trainer


def is_mean(reduce_op: object) -> bool:
    """Whether a Lightning ``reduce_op`` averages (``"mean"``, ``"avg"``, ``ReduceOp.AVG``)."""
    if isinstance(reduce_op, str):
        return reduce_op.lower() in ("mean", "avg")
    return reduce_op == dist.ReduceOp.AVG


class PerRankBatchStrategy:
    """The per-rank batch API and data handling of a Lightning strategy; mixed in before the engine's strategy.

    A subclass sets :attr:`batch_core` (then calls :meth:`_start_per_rank`) in its constructor and says, in
    :meth:`_training_group`, which ranks run ``training_step`` at a step.
    """

    batch_core: PerRankBatchCore
    """The per-rank batch core: sizes, bounds, caps, the training DataLoader and the gradient weights."""

    if TYPE_CHECKING:  # given by Lightning's strategy the subclass also derives from
        root_device: torch.device
        global_rank: int
        world_size: int
        lightning_module: LightningModule | None
        _timeout: Any

    def _start_per_rank(self) -> None:
        self._in_training_step = False
        self._loader_state_to_load: dict[str, Any] | None = None
        self._step_clock: StepClock | None = None

    min_batch_size = Forwarded("batch_core", "The smallest size any rank may be given (0: a rank may sit steps out).")
    least_batch_size = Forwarded(
        "batch_core",
        "The smallest size a rank that trains may be given: ``min_batch_size``, or with ``min_batch_size=0`` 1,"
        " raised at set-up to what the model's batch-dependent layers need (2 for BatchNorm).",
    )
    max_batch_size = Forwarded("batch_core", "The largest size any rank may be given; ``None`` for no limit.")
    batch_size_caps = Forwarded("batch_core", "The caps given, one per rank (``None`` entries for none), or ``None``.")
    loss_reduction = Forwarded(
        "batch_core", "How the training loss combines the rank's samples: ``'mean'`` or ``'sum'``."
    )
    shuffle = Forwarded("batch_core", "Whether every epoch's global order is drawn at random.")
    seed = Forwarded("batch_core", "The seed of the global order.")
    drop_last = Forwarded("batch_core", "Whether the incomplete last step of each epoch is skipped.")
    resume_weights = Forwarded(
        "batch_core",
        "Relative speeds of this job's ranks when it resumes a checkpoint saved by another number of ranks"
        " (``DynamixCallback`` sets it from its controller); ``None`` splits the global batch evenly.",
        settable=True,
    )

    @property
    def current_batch_size_caps(self) -> list[int | None] | None:
        """The largest size per rank now: ``batch_size_caps``, lowered where a rank ran out of memory."""
        return self.batch_core.current_caps

    @property
    def batch_sizes(self) -> BatchSizes | None:
        """The latest per-rank sizes set (what new steps use); ``None`` until known."""
        return self.batch_core.batch_sizes

    @property
    def current_batch_sizes(self) -> BatchSizes | None:
        """Every rank's real size in the batch being trained now; ``None`` outside training."""
        return self.batch_core.current_batch_sizes

    @property
    def train_batch_sampler(self) -> HeterogeneousBatchSampler | None:
        """The sampler of the training DataLoader; ``None`` before training starts."""
        loader = self.batch_core.loader
        return None if loader is None else loader.batch_sampler

    @property
    def step_clock(self) -> StepClock | None:
        """This rank's step timeline, once :meth:`enable_step_clock` was called."""
        return self._step_clock

    @property
    def in_training_step(self) -> bool:
        """Whether this rank is running the LightningModule's ``training_step`` now."""
        return self._in_training_step

    @property
    def sync_weight(self) -> float:
        """The factor this rank's gradients were multiplied by at its latest synchronisation (1.0 before the
        first): the correction of its share of the global batch, which the loss's gradient already carries, for
        the samples of the whole accumulation window."""
        return self.batch_core.hook_state.weight

    def enable_step_clock(self, time_source: TimeSource | None = None) -> StepClock:
        """Time every training step of this rank from now on (data, compute, sync wait, synchronisation).

        Returns the :class:`~lightning_dynamix.metrics.StepClock`; calling it again returns the same one. By
        default it times the device with CUDA events on the rank's stream on a GPU, elsewhere the host;
        ``time_source`` chooses another (the first call's is kept).
        """
        if self._step_clock is None:
            source = time_source if time_source is not None else time_source_for(self.root_device)
            self._step_clock = StepClock(time_source=source)
            self.batch_core.set_step_clock(self._step_clock)
        return self._step_clock

    def enable_gradient_norms(self, sink: GradientNormSink | None) -> None:
        """Report the gradient's squared norms at every synchronisation to ``sink``; ``None`` stops it.

        ``sink(local_sq_norm, local_samples, global_sq_norm, global_samples)`` receives the squared
        norm of this rank's mean gradient over its own samples since the last synchronisation and
        the squared norm of the synchronised mean gradient over all ranks' samples, as 0-dim tensors
        on the gradients' device, with the sample counts they are means over. Computing them costs
        two reads of the gradients per synchronisation, none where a rank synchronises alone (a job of
        one rank, or a step one rank trains while every other rank sits it out): its gradient is the
        global one, which says nothing of the gradient's noise.
        """
        self.batch_core.norm_sink = sink
        self.batch_core.hook_state.norms = BucketNorms() if sink is not None else None

    def set_batch_sizes(self, batch_sizes: Sequence[int], from_step: int | None = None) -> int | None:
        """Give each rank a new batch size from an agreed step of the current epoch on.

        A collective while training: call it on every rank with the same arguments. It checks
        that all ranks agree and, for ``from_step=None``, applies the sizes from the first step
        that no rank has produced yet (DataLoader workers prefetch, so that can be a few steps
        after the one being trained). Before training starts it only sets the initial sizes.

        Args:
            batch_sizes: one size per rank within ``[min_batch_size, max_batch_size]``.
            from_step: step of the current epoch to apply them from; one that is at or past the
                end of the epoch means from the start of the next epoch.

        Returns:
            The step they apply from (the epoch's length when from the next epoch), or ``None``
            before training has started.

        Raises:
            ValueError: for invalid sizes, a step already produced, or ranks that disagree.
        """
        # the sampler notifies _sync_trainer_epoch_length
        device = self.root_device if self.batch_core.loader is not None else None  # no device before set-up
        return self.batch_core.set_batch_sizes(batch_sizes, from_step, device=device)

    # ------------------------------------------------------------------ data
    def process_dataloader(self, dataloader: object) -> object:
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        loader = self.batch_core.training_loader(
            dataloader,
            self.global_rank,
            self.world_size,
            instead="Use DataLoader(dataset, batch_size=...), or build a HeterogeneousDataLoader yourself and"
            " train with Trainer(use_distributed_sampler=False).",
            epoch=trainer.current_epoch,  # DataLoader workers start prefetching before Lightning sets it
        )
        if self._loader_state_to_load is not None:
            loader.load_state_dict(self._loader_state_to_load)
            self._loader_state_to_load = None
        # keep Lightning's epoch length right whenever sizes or the epoch change
        loader.batch_sampler.on_schedule_change = self._sync_trainer_epoch_length
        return loader

    def _sync_trainer_epoch_length(self) -> None:
        """Tell Lightning's fit loop how many batches the current epoch now has.

        Called by the sampler on every schedule change: a resize, or a new epoch (Lightning sets
        it before it reads the epoch's length for the progress bar and the data fetcher).
        """
        loader = self.batch_core.loader
        module = self.lightning_module
        if loader is None or module is None:
            return
        trainer = module.trainer
        num_batches = _compat.parse_num_batches(RunningStage.TRAINING, len(loader), trainer.limit_train_batches)
        _compat.set_epoch_length(trainer, loader, num_batches)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        # Lightning restores a resumable DataLoader only when it restarts mid-epoch; the sizes and
        # schedule decided before an end-of-epoch checkpoint must survive as well
        loader_states = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader")
        module = self.lightning_module
        fitting = module is not None and module.trainer.state.fn == TrainerFn.FITTING
        if loader_states and fitting:
            self._loader_state_to_load = loader_states[0]
        return checkpoint

    def _check_training_setup(self, trainer: Trainer) -> None:
        """At the start of training: one training DataLoader, and the epoch's logs paired up where ranks sit out."""
        if self.min_batch_size == 0 and not any(isinstance(c, EpochMetricsAgreement) for c in trainer.callbacks):
            # a rank that sits out may log nothing from training_step: the epoch's reductions must still pair up
            trainer.callbacks.insert(0, EpochMetricsAgreement())
        loaders = _compat.training_dataloaders(trainer)
        if loaders is not None and len(loaders) != 1:
            raise MisconfigurationException(
                f"{type(self).__name__} trains from one training DataLoader, got {len(loaders)};"
                " combine the datasets into one (e.g. torch.utils.data.ConcatDataset)."
            )

    def _window_end(self, accumulate: int) -> int | None:
        """The step after the last of the accumulation window being trained (``None``: this step ends it)."""
        loader = self.batch_core.loader
        if accumulate == 1 or loader is None or loader.current_step < 0:
            return None
        step = loader.current_step
        return min(step - step % accumulate + accumulate, self.lightning_module.trainer.num_training_batches)

    # ------------------------------------------------------------------ logging
    def _training_group(self, sizes: BatchSizes) -> Any:
        """The process group of the ranks that run ``training_step`` at a step of these sizes (``None``: all)."""
        return None

    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Tensor | Any:
        distributed = dist.is_available() and dist.is_initialized()
        if not (self._in_training_step and isinstance(tensor, Tensor) and distributed):
            if distributed and isinstance(tensor, Tensor) and not tensor.is_floating_point() and is_mean(reduce_op):
                # Lightning averages an integer in place, truncating: the samples behind an epoch-level mean
                # (uneven over the ranks, 150 over 4) would count 37 a rank, 148 in all: the mean 1.4% high
                summed = super().reduce(tensor, group=group, reduce_op="sum")  # type: ignore[misc]
                return summed.double() / dist.get_world_size(group)  # float64: exact for any count below 2**53
            return super().reduce(tensor, group=group, reduce_op=reduce_op)  # type: ignore[misc]
        # inside training_step (self.log(..., sync_dist=True)) every rank waits here for the slowest
        started = self._step_clock.now() if self._step_clock is not None else None
        loader = self.batch_core.loader
        if group is None and is_mean(reduce_op) and loader is not None and loader.current_step >= 0:
            group = self._training_group(loader.current_batch_sizes)
            result = mean_by_counts_all_reduce(tensor, self.batch_core.own_count, group=group)
        else:
            result = super().reduce(tensor, group=group, reduce_op=reduce_op)  # type: ignore[misc]
        if self._step_clock is not None:  # the wait is not this rank's compute
            self._step_clock.collective(started, self._step_clock.now())
        return result
