"""Per-rank batch sizes and exact uneven gradients under Hugging Face Accelerate (``accelerate launch``, ``torchrun``).

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/integrations/accelerate.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from lightning_dynamix import _compat
from lightning_dynamix._checks import require_bool, require_int
from lightning_dynamix._forwarding import Forwarded
from lightning_dynamix.batch_core import PerRankBatchCore
from lightning_dynamix.control import BatchController, Decision
from lightning_dynamix.control.lr_scaling import validate_lr_scaling
from lightning_dynamix.data import HeterogeneousBatchSampler, HeterogeneousDataLoader
from lightning_dynamix.data.items import ItemCounter
from lightning_dynamix.data.schedule import BatchSizes
from lightning_dynamix.decisions import (
    DecisionMaker,
    IntervalMeter,
    IntervalRecord,
    build_controller,
    check_world_size,
    interval_metrics,
    wants_noise_scale,
)
from lightning_dynamix.distributed import (
    BucketNorms,
    WeightedAllReduceState,
    let_backend_threads_finish,
    mean_by_counts_all_reduce,
    set_batch_sizes_on_every_rank,
    training_ranks_groups,
    weighted_allreduce_hook,
    zero_gradient_loss,
)
from lightning_dynamix.distributed.batch_norm import (
    GlobalBatchNorm,
    broadcast_batch_norm_statistics,
    convert_batch_norm,
    has_global_batch_norm,
    set_statistics_group,
)
from lightning_dynamix.distributed.sharded import (
    check_fully_sharded,
    fsdp_modules,
    is_sharded,
    load_shards,
    save_shards,
    scale_gradients,
    set_gradient_sync,
    time_collectives,
)
from lightning_dynamix.elastic import Preempted, PreemptionNotice, gather_machine_ids
from lightning_dynamix.metrics import StepClock
from lightning_dynamix.metrics.clocks import TimeSource, time_source_for


class PreparedTrainLoader(DataLoaderStateMixin):
    """The training DataLoader :meth:`DynamixAccelerate.prepare` returns: per-rank batches on the accelerator's device.

    Iterating it runs one epoch of the rank's batches; each new iteration starts the next epoch
    (the global order is reshuffled from the seed and the epoch), unless :meth:`set_epoch` chose
    one. ``len()`` is the number of steps of the current epoch, the same on every rank.

    While it is iterated it is Accelerate's active DataLoader, like the loaders ``accelerator.prepare``
    returns: ``end_of_dataloader`` turns true with the epoch's last batch, so
    ``accelerator.accumulate()`` synchronises there and starts the next epoch with a new window.
    """

    def __init__(self, loader: HeterogeneousDataLoader, device: torch.device) -> None:
        self.loader = loader
        self.device = device
        self.gradient_state = GradientState()
        self._epoch = 0
        self._epoch_set = False
        self.on_batch: Callable[[], None] | None = None
        """Called on every rank as each batch is handed out, before the forward pass (the sizes are known)."""
        self.placeholders = False
        """At a step this rank sits out, hand out one sample of the step (trained at weight 0) instead of an
        ``EmptyBatch``: a sharded model's collectives need every rank in its forward and backward."""

    @property
    def batch_sampler(self) -> HeterogeneousBatchSampler:
        return self.loader.batch_sampler

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def epoch(self) -> int:
        """The epoch the next iteration trains (after a finished epoch: the one after it)."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Train epoch ``epoch`` on the next iteration (its order and its batch-size schedule)."""
        self._epoch = require_int("epoch", epoch, 0)
        self._epoch_set = True

    def __len__(self) -> int:
        self.batch_sampler.set_epoch(self._epoch)
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        from accelerate.utils import send_to_device

        self.batch_sampler.set_epoch(self._epoch)
        self._epoch_set = False
        self.begin()
        self.remainder = 0  # nothing is padded: every sample is trained once per epoch
        try:
            for batch in self.loader:
                # the schedule says whether this is the last step (sizes can change only for steps not produced)
                self.end_of_dataloader = self.loader.current_step + 1 >= len(self.batch_sampler)
                if self.on_batch is not None:
                    self.on_batch()
                if self.placeholders and self.loader.sits_out:
                    batch = self.loader.placeholder_batch()
                yield send_to_device(batch, self.device, non_blocking=self.loader.pin_memory)
        finally:
            self.end()
        if not self._epoch_set:
            self._epoch += 1

    def state_dict(self) -> dict[str, Any]:
        """The sampler's position: the batches trained on so far, the sizes and the epoch."""
        return {"epoch": self._epoch, "sampler": self.loader.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue where :meth:`state_dict` was taken."""
        self._epoch = int(state_dict["epoch"])
        self.loader.load_state_dict(state_dict["sampler"])


class DynamixAccelerate:
    """Uneven per-rank batch sizes with exact gradients for a script that trains with an ``Accelerator``.

    Args:
        accelerator: a distributed ``accelerate.Accelerator`` (``accelerate launch`` or ``torchrun``
            with two or more processes).
        batch_sizes: samples per step of every rank, one per process; ``None`` gives every rank the
            training DataLoader's ``batch_size``.
        min_batch_size: smallest size a rank may be given (>= 0); 0 lets a rank sit steps out
            (:attr:`sits_out`, :meth:`zero_loss`). Default: 1, or 2 for a model with BatchNorm (without
            ``sync_batchnorm``); a smaller one such a model cannot train is refused at :meth:`prepare`.
        max_batch_size: largest size a rank may be given (>= 1); ``None`` for no limit.
        loss_reduction: ``"mean"`` if the training loss averages over the rank's samples (the
            usual case), ``"sum"`` if it sums them.
        count_items: for a loss that is a mean over *items* (a language model's tokens): ``count(batch) -> int``,
            the items of a batch (:class:`~lightning_dynamix.LabelTokens` counts labels not ignored); the
            gradients are then weighted by every process's share of the global batch's items, gathered before each
            :meth:`backward`. ``None`` (default): by samples.
        shuffle: draw every epoch's global order at random (from ``seed`` and the epoch).
        seed: seed of the global order; the same on every rank.
        drop_last: drop the samples of an incomplete last global batch instead of spreading them.
        group_by_length: batch by length (a language model's sequences): each run of this many samples of the
            epoch's order is sorted by length, longest first, so a step's samples have alike lengths and little
            padding; several global batches (e.g. 50x). Lengths are the dataset's ``lengths`` or each sample's
            ``input_ids``. ``None`` (default): not. See docs/transformers.md.
        controller: ``None`` (sizes change only through :meth:`set_batch_sizes`), a controller name
            (``"static"``, ``"pid"``, ``"goodput"``, ``"ppo"``: the policy that ships with
            the package) or an object with ``decide(state) -> Decision``,
            ``state_dict()`` and ``load_state_dict()``.
        interval: optimizer steps between two decisions (>= 1).
        warmup_steps: optimizer steps before the first measured interval.
        lr_scaling: how the learning rate follows the global batch: ``"none"``, ``"linear"``,
            ``"sqrt"``, ``"adascale"``.
        controller_kwargs: arguments for a controller given by name.
        gradient_noise_scale: estimate the gradient noise scale; default: when the controller or the
            learning-rate rule reads it.
        noise_scale_ema: decay of the noise scale's moving average over intervals, in [0, 1).
        log_per_rank: log each rank's batch size, times and throughput to the trackers.
        finetune: with ``controller="ppo"``, keep training the policy on this job's own decisions
            (PPO updates on the main process); the updated policy is saved by ``save_state``.
        save_on_preemption: a directory: when any process gets a SIGTERM (a spot notice), every
            process agrees within two optimizer steps (:meth:`step`), ``accelerator.save_state``
            writes that step there, and every process raises
            :class:`~lightning_dynamix.elastic.Preempted` (exit code 143) for the launcher to
            restart the job, which resumes with ``accelerator.load_state(directory)`` on the same
            or another number of processes; call :meth:`finish` after the loop to save the end
            there too. ``None`` (default): SIGTERM is left alone.
        preemption_check_interval: optimizer steps between two checks for a notice (each starts a
            non-blocking all-reduce of one number and reads the previous one's).
        batch_size_caps: the largest size each process's machine holds, one entry per process (``None`` for no cap
            of its own); every decision keeps within them (the initial sizes too, where you did not choose them).
        memory_margin: on a GPU, the share of its memory kept free when the largest batch it holds is derived
            from the peak bytes per sample measured (see :mod:`lightning_dynamix.metrics.memory`); ``None``: not
            measured. A step that runs out of memory is not trained again here (the loop is yours): see
            ``HeterogeneousDDPStrategy(recover_out_of_memory=...)``.
        time_source: what times each step (data, compute, all-reduce) for the controller: ``None`` for the
            device's, CUDA events on a GPU and the host's clock elsewhere
            (:func:`~lightning_dynamix.metrics.clocks.time_source_for`); a
            :class:`~lightning_dynamix.metrics.clocks.HostClock` of a timer of your own for another clock.
        sync_batchnorm: make every BatchNorm layer of the model a
            :class:`~lightning_dynamix.distributed.batch_norm.GlobalBatchNorm` at :meth:`prepare`: statistics of
            the whole global batch, whatever the split, so the job trains what one process trains on it.

    Raises:
        ValueError: naming the argument, the value and what is valid, for bad arguments, an
            Accelerator that is not distributed, or one that all-reduces every accumulated batch
            (``sync_each_batch=True``).
    """

    def __init__(
        self,
        accelerator: Any,
        batch_sizes: Sequence[int] | None = None,
        *,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        loss_reduction: str = "mean",
        count_items: ItemCounter | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        group_by_length: int | None = None,
        controller: str | BatchController | None = None,
        interval: int = 10,
        warmup_steps: int = 5,
        lr_scaling: str = "none",
        controller_kwargs: dict[str, Any] | None = None,
        gradient_noise_scale: bool | None = None,
        noise_scale_ema: float = 0.9,
        log_per_rank: bool = True,
        finetune: bool = False,
        save_on_preemption: str | os.PathLike | None = None,
        preemption_check_interval: int = 1,
        sync_batchnorm: bool = False,
        batch_size_caps: Sequence[int | None] | None = None,
        memory_margin: float | None = 0.1,
        time_source: TimeSource | None = None,
    ) -> None:
        if time_source is not None and not isinstance(time_source, TimeSource):
            raise ValueError(
                f"`time_source` must be a TimeSource (HostClock, CudaEventClock, FakeEventClock) or None, got"
                f" {time_source!r}"
            )
        _check_accelerator(accelerator)
        self.time_source = time_source
        self.accelerator = accelerator
        let_backend_threads_finish()
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
            world_size=accelerator.num_processes,
            rank_word="process",
        )
        """The per-rank batch core: sizes, bounds, caps, the training DataLoader and the gradient weights."""
        self.sync_batchnorm = require_bool("sync_batchnorm", sync_batchnorm)
        self._global_batch_norm = False
        self.model: DistributedDataParallel | torch.nn.Module | None = None
        self.sharded = False
        """Whether the model is sharded with FSDP2 (``fully_shard``) rather than wrapped in DDP."""
        self._shards_to_load: str | None = None
        self._fsdp_modules: list[Any] = []  # a sharded model's FSDP modules, found once at prepare
        self.train_loader: PreparedTrainLoader | None = None
        self.optimizers: list[Any] = []
        self.global_step = 0
        self.lr_scaling = validate_lr_scaling(lr_scaling)
        self.log_per_rank = bool(log_per_rank)
        self.meter: IntervalMeter | None = None
        self.maker: DecisionMaker | None = None
        self._machine_ids: list[str] | None = None
        self.save_on_preemption = None if save_on_preemption is None else os.fspath(save_on_preemption)
        self.preemption_check_interval = require_int("preemption_check_interval", preemption_check_interval, 1)
        self.preemption = PreemptionNotice() if self.save_on_preemption is not None else None
        self.seconds_to_save: float | None = None
        """After a preemption: seconds from this process's notice (or the agreement) to the state saved."""
        if controller is not None:
            built, name = build_controller(
                controller, controller_kwargs, min_batch_size, max_batch_size, lr_scaling, finetune
            )
            check_world_size(built, accelerator.num_processes)
            if gradient_noise_scale is None:
                gradient_noise_scale = wants_noise_scale(built, self.lr_scaling)
            self.meter = IntervalMeter(
                interval, warmup_steps, bool(gradient_noise_scale), noise_scale_ema, memory_margin
            )
            self.maker = DecisionMaker(built, name, self.lr_scaling, "DynamixAccelerate")
            self.resume_weights = self.maker.resume_weights
        elif controller_kwargs or finetune:
            raise ValueError(
                f"`controller_kwargs` {controller_kwargs!r} or finetune={finetune!r} given without a `controller`"
            )

    min_batch_size = Forwarded("batch_core", "The smallest size any process may be given (0: it may sit steps out).")
    least_batch_size = Forwarded(
        "batch_core",
        "The smallest size a process that trains may be given: ``min_batch_size``, raised at :meth:`prepare` to"
        " what the model's batch-dependent layers need (2 for BatchNorm; with ``min_batch_size=0`` it may sit out).",
    )
    max_batch_size = Forwarded("batch_core", "The largest size any process may be given; ``None`` for no limit.")
    batch_size_caps = Forwarded(
        "batch_core", "The caps given, one per process (``None`` entries for none), or ``None``."
    )
    loss_reduction = Forwarded(
        "batch_core", "How the training loss combines the process's samples: ``'mean'`` or ``'sum'``."
    )
    shuffle = Forwarded("batch_core", "Whether every epoch's global order is drawn at random.")
    seed = Forwarded("batch_core", "The seed of the global order.")
    drop_last = Forwarded("batch_core", "Whether the samples of an incomplete last global batch are dropped.")
    resume_weights = Forwarded(
        "batch_core",
        "Relative speeds of the processes when a state saved by another number of processes is loaded; ``None``"
        " splits the global batch evenly (with a controller, its knowledge of the machines is used).",
        settable=True,
    )

    @property
    def hook_state(self) -> WeightedAllReduceState:
        """The weighted all-reduce hook's state on the prepared model."""
        return self.batch_core.hook_state

    @property
    def batch_sizes(self) -> BatchSizes | None:
        """The latest per-rank sizes (what new steps use); ``None`` before prepare() when none were given."""
        return self.batch_core.batch_sizes

    @property
    def history(self) -> list[IntervalRecord]:
        """Every gathered state and decision (empty without a controller)."""
        return self.meter.history if self.meter is not None else []

    # ------------------------------------------------------------------ prepare
    def prepare(self, *objects: Any) -> Any:
        """``accelerator.prepare(*objects)``, except that the first DataLoader becomes the per-rank training loader.

        Other DataLoaders (validation) are prepared by Accelerate as usual. The model is wrapped by
        Accelerate (DDP) and gets the weighted all-reduce hook; a model sharded with FSDP2 (``fully_shard``
        applied to it, over every process) is kept as it is, and its processes that sit a step out run one
        sample of the step at weight 0. Returns the objects in the same order, a single object unwrapped, like
        ``accelerator.prepare``.

        Raises:
            ValueError: for a model already wrapped in DDP (prepare it here instead), a second
                model, a sharded model with parameters no ``fully_shard`` holds or with BatchNorm layers
                ``sync_batchnorm`` would have to swap, an iterable-style or custom-sampler training DataLoader, or a
                dataset smaller than one global batch.
        """
        train_index = next((i for i, o in enumerate(objects) if isinstance(o, DataLoader)), None)
        for obj in objects:
            if isinstance(obj, DistributedDataParallel):
                raise ValueError(
                    "A model already wrapped in DistributedDataParallel was passed to DynamixAccelerate.prepare;"
                    " its all-reduce cannot be weighted any more. Pass the plain model: dynamix.prepare(model, ...)"
                    " instead of accelerator.prepare(model) first."
                )
        objects = tuple(self._fit_batch_dependent_layers(o) for o in objects)
        kept = {i: o for i, o in enumerate(objects) if is_sharded(o)}  # Accelerate would wrap it in DDP on a CPU
        loader = self._train_loader(objects[train_index]) if train_index is not None else None
        if kept:  # its optimizers too: their state is sharded, and saved as the model's is (save_shards)
            kept.update({i: _accelerated(o) for i, o in enumerate(objects) if hasattr(o, "param_groups")})
        rest = [o for i, o in enumerate(objects) if i != train_index and i not in kept]
        prepared: list[Any] = []
        if rest:  # accelerator.prepare returns one object unwrapped
            out = self.accelerator.prepare(*rest)
            prepared = list(out) if len(rest) > 1 else [out]
        for index in sorted(kept):
            prepared.insert(index - (train_index is not None and train_index < index), kept[index])
        for obj in prepared:
            if isinstance(obj, DistributedDataParallel) or is_sharded(obj):
                if self.model is not None:
                    raise ValueError("DynamixAccelerate.prepare got a second model; it weights one model's gradients")
                self._take_model(obj)
            elif hasattr(obj, "param_groups"):
                self.optimizers.append(obj)
        if self.preemption is not None:
            self.preemption.install()
        if train_index is not None:
            assert loader is not None
            loader.placeholders = self.sharded
            prepared.insert(train_index, loader)
            if self.maker is not None:  # which machine every process is (a collective, like prepare itself)
                self._machine_ids = gather_machine_ids(self.accelerator.local_process_index)
                self.maker.join(self._machine_ids)
            self._start_measuring()
            self.accelerator.register_for_checkpointing(self)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _take_model(self, model: torch.nn.Module) -> None:
        """The model whose gradients are weighted: DDP gets the weighted all-reduce hook; a sharded one is checked."""
        if isinstance(model, DistributedDataParallel):
            model.register_comm_hook(state=self.hook_state, hook=weighted_allreduce_hook)
        else:
            check_fully_sharded(model, "DynamixAccelerate.prepare")
            self.sharded = True
            self._fsdp_modules = fsdp_modules(model)
            # Accelerate saves what it prepared; a sharded model and its optimizers go through torch distributed
            # checkpoint, each process its shards, and load on any number of processes
            self.accelerator.register_save_state_pre_hook(self._save_shards)
            self.accelerator.register_load_state_pre_hook(self._note_shards)
        self.model = model

    def _fit_batch_dependent_layers(self, obj: Any) -> Any:
        """A model: its BatchNorm made global with ``sync_batchnorm``, and the least size raised to what it needs."""
        if not isinstance(obj, torch.nn.Module) or isinstance(obj, DistributedDataParallel):
            return obj
        if is_sharded(obj):
            plain = [
                m for m in obj.modules() if isinstance(m, _compat.BatchNormBase) and not isinstance(m, GlobalBatchNorm)
            ]
            if self.sync_batchnorm and plain:
                raise ValueError(
                    "DynamixAccelerate(sync_batchnorm=True) got a model sharded with fully_shard whose BatchNorm"
                    " layers it would have to swap, which FSDP holds: convert them before fully_shard"
                    " (lightning_dynamix.distributed.batch_norm.convert_batch_norm)."
                )
            self._global_batch_norm = has_global_batch_norm(obj)  # converted before fully_shard, by you
        elif self.sync_batchnorm:
            obj = convert_batch_norm(obj)
            self._global_batch_norm = has_global_batch_norm(obj)
        self.batch_core.fit_model(obj, self.accelerator.num_processes)
        return obj

    def _on_batch(self) -> None:
        """Before a step's forward pass: GlobalBatchNorm gathers over the processes that train it, timed as waiting
        (a sharded model's: over every process, a placeholder counted nowhere)."""
        assert self.train_loader is not None
        clock = self.meter.clock if self.meter is not None else None
        if self.sharded:
            set_statistics_group(None, clock, placeholder=self.train_loader.loader.sits_out)
            return
        group = training_ranks_groups().prepare(self.train_loader.loader.current_batch_sizes)
        set_statistics_group(group, clock)

    def _train_loader(self, dataloader: DataLoader) -> PreparedTrainLoader:
        loader = self.batch_core.training_loader(
            dataloader,
            self.accelerator.process_index,
            self.accelerator.num_processes,
            instead="Use DataLoader(dataset, batch_size=..., shuffle=...).",
        )
        self.train_loader = PreparedTrainLoader(loader, self.accelerator.device)
        if self._global_batch_norm:
            self.train_loader.on_batch = self._on_batch
        return self.train_loader

    def _start_measuring(self) -> None:
        if self.meter is None or self.train_loader is None:
            return
        clock = StepClock(time_source=self.time_source or time_source_for(self.accelerator.device))
        self.batch_core.set_step_clock(clock)
        if self.sharded:  # FSDP's all-gathers and reduce-scatters: waiting for the others, not compute
            assert self.model is not None
            time_collectives(self.model, clock)
        if self.meter.noise_scale is not None:
            self.hook_state.norms = BucketNorms()
        self.meter.start(clock, self.accelerator.device, self.global_step)

    # ------------------------------------------------------------------ training
    @property
    def sits_out(self) -> bool:
        """Whether this rank's batch size is 0 in the batch being trained (its batch is an ``EmptyBatch``)."""
        return self.batch_core.sits_out

    def global_mean(self, value: Tensor | None) -> Tensor:
        """The mean of a per-step ``value`` over the global batch: every process's weighted by its share of the step
        (its items with ``count_items``, else its samples). For the loss, what one process on the whole global batch
        would report: the token mean under ``count_items``.

        A collective (one all-reduce): call it on every process at the same step, a process that sits the step out
        with ``None`` (then ``value`` must be a scalar, as a loss is). Returns a float tensor of ``value``'s shape,
        the same on every process. Raises ``RuntimeError`` before the DataLoader handed out a batch.
        """
        count = self.batch_core.own_count  # raises before the first batch
        if value is None or self.sits_out:
            return mean_by_counts_all_reduce(torch.zeros((), device=self.accelerator.device), 0)
        return mean_by_counts_all_reduce(value, count)

    def zero_loss(self) -> Tensor:
        """The loss of a rank that sits the step out: 0, through the DDP wrapper, for :meth:`backward`.

        Its backward gives every trainable parameter a zero gradient, so the rank joins the
        all-reduce (with weight 0) without a forward or backward pass of the model. Not for a sharded model: its
        loader hands a process that sits out a placeholder to run the model on, as any batch.
        """
        if self.sharded:
            raise RuntimeError(
                "DynamixAccelerate.zero_loss is for a DDP model: under FSDP2 every process must run the model's"
                " forward and backward (its all-gathers and reduce-scatters), so a process that sits a step out is"
                " handed one sample of the step, trained at weight 0: compute its loss as on any batch."
            )
        if not isinstance(self.model, DistributedDataParallel):
            raise RuntimeError("DynamixAccelerate.zero_loss needs the model from prepare()")
        return zero_gradient_loss(self.model)

    def backward(self, loss: Tensor, **kwargs: Any) -> None:
        """``accelerator.backward(loss)`` with this rank's gradient weighted by its share of the global batch.

        Under ``accelerator.accumulate(model)`` the batch is the accumulation window: every step
        back-propagated since the last synchronisation, on every rank. The synchronised gradient
        is the mean over all of the window's samples (the sum for ``loss_reduction="sum"``), also
        when sizes change inside the window or the epoch's end cuts it short.
        """
        if self.train_loader is None or self.model is None:
            raise RuntimeError("DynamixAccelerate.backward needs the model and the training DataLoader from prepare()")
        if self.sharded:
            syncing = self.accelerator.sync_gradients  # accumulate() says whether this batch ends the window
            set_gradient_sync(self._fsdp_modules, syncing)  # else FSDP keeps the unsharded gradients
            # FSDP2's reduce-scatter averages over the processes where DDP's hook sums; a placeholder weighs 0
            reduce_scale = 0.0 if self.sits_out else float(self.accelerator.num_processes)
        else:
            syncing = self.model.require_backward_grad_sync  # False inside accumulate()/no_sync() between syncs
            reduce_scale = 1.0
        # accelerator.backward divides the loss by the accumulation steps; the weights undo that
        self.batch_core.weight_backward(
            loss, 1.0 / self.accelerator.gradient_accumulation_steps, self._window_end(), syncing, reduce_scale
        )
        self.accelerator.backward(loss, **kwargs)
        sizes = self.train_loader.loader.current_batch_sizes
        if self._global_batch_norm and min(sizes) == 0 and not self.sharded:  # it missed the statistics' update
            broadcast_batch_norm_statistics(self.model, src=next(r for r, b in enumerate(sizes) if b > 0))
        if self.meter is not None:
            assert self.meter.clock is not None
            self.meter.clock.backward_end()
        if syncing:
            if self.sharded:  # the window's correction on the shards, where sizes changed inside it (else 1)
                scale_gradients(self.model, self.hook_state.weight)
            self.batch_core.end_window()

    def _window_end(self) -> int | None:
        """The step after the last of the accumulation window being trained (``None``: this step ends it)."""
        accelerator = self.accelerator
        if accelerator.gradient_accumulation_steps == 1 or accelerator.sync_gradients:
            return None
        # accumulate() counts the window's steps in accelerator.step and synchronises when it reaches a
        # multiple of the accumulation steps, or at the epoch's last step
        remaining = accelerator.gradient_accumulation_steps - accelerator.step % accelerator.gradient_accumulation_steps
        assert self.train_loader is not None
        return self.train_loader.loader.current_step + 1 + remaining

    def step(self, loss: Tensor | None = None) -> Decision | None:
        """One optimizer step is done: call it on every rank after ``optimizer.step()``.

        Closes the step's measurement (with ``loss`` for the loss signals) and, every ``interval``
        steps with a controller, gathers the cluster state, decides on rank 0 and applies the
        decision on every rank (new sizes from an agreed step, the learning-rate scale on every
        prepared optimizer) and logs to Accelerate's trackers. Returns the decision taken at this
        step, else ``None``. Under ``accelerator.accumulate(model)`` call it after every batch:
        only batches that end a window (``accelerator.sync_gradients``) count as optimizer steps.
        """
        if self.accelerator.sync_gradients:
            self.global_step += 1
            self._check_preemption()
        if self.meter is None or self.maker is None:
            return None
        if self.train_loader is None:
            raise RuntimeError("DynamixAccelerate.step needs the training DataLoader from prepare()")
        if not self.meter.end_batch(loss, self.global_step):
            return None
        sampler = self.train_loader.batch_sampler
        loader = self.train_loader.loader
        current = list(sampler.batch_sizes)
        groups = self.optimizers[0].param_groups if self.optimizers else []
        state = self.meter.gather(
            rank=self.accelerator.process_index,
            step=self.global_step,
            epoch=sampler.epoch,
            lr=float(groups[0]["lr"]) if groups else float("nan"),
            sizes=loader.current_batch_sizes if loader.current_step >= 0 else current,
            bounds=(self.min_batch_size, self.max_batch_size),
            least_batch_size=self.least_batch_size,
            device=self.accelerator.device,
            batch_size_cap=self.batch_core.check_world_size(self.accelerator.num_processes)[
                self.accelerator.process_index
            ],
        )
        if self.maker.base_global_batch is None:
            self.maker.base_global_batch = sum(current)
        decision = self.maker.decide(state, current, self.accelerator.is_main_process, self.accelerator.device)
        if list(decision.batch_sizes) != current:
            set_batch_sizes_on_every_rank(sampler, decision.batch_sizes, decision.from_step, self.accelerator.device)
        self.maker.apply_lr_scale(decision, self.optimizers)
        record = IntervalRecord(self.global_step, self.meter.elapsed(), state, decision)
        self.meter.history.append(record)
        self.accelerator.log(interval_metrics(record, self.log_per_rank), step=self.global_step)
        self.meter.start_interval()
        return decision

    def _check_preemption(self) -> None:
        """Every few optimizer steps, agree whether any process got a notice; if so save this step and exit."""
        notice = self.preemption
        if notice is None:
            return
        started = notice.check(self.global_step, self.preemption_check_interval, self.accelerator.device)
        if started is None:
            return
        assert self.save_on_preemption is not None
        self.accelerator.save_state(self.save_on_preemption)  # every process: each writes its part
        self.accelerator.wait_for_everyone()
        self.seconds_to_save = time.monotonic() - started
        notice.uninstall()
        raise Preempted(self.global_step, self.save_on_preemption)

    def finish(self) -> None:
        """Training is over: call it on every process after the training loop.

        With ``save_on_preemption`` it waits for the check in flight, writes the final state to that
        directory and gives SIGTERM its previous handler back. A launcher that restarts the group
        after the end (torch elastic does when a node joins while the processes wind down) then
        loads the end, where the loop has nothing left to train, instead of training again from an
        earlier preemption's state. Without ``save_on_preemption`` it does nothing.
        """
        notice = self.preemption
        if notice is None:
            return
        assert self.save_on_preemption is not None
        notice.finish()
        self.accelerator.save_state(self.save_on_preemption)
        self.accelerator.wait_for_everyone()
        notice.uninstall()

    def set_batch_sizes(self, batch_sizes: Sequence[int]) -> int:
        """Use ``batch_sizes`` from the first step no rank has produced yet; call it on every rank with the same sizes.

        DataLoader workers prefetch, so ranks may have produced different numbers of batches; the
        ranks agree (one all_gather) on the first step none has produced and switch there. Ranks
        that pass different sizes all raise ValueError instead of training on different schedules.

        Returns:
            The step of the current epoch from which the new sizes apply.
        """
        if self.train_loader is None:
            raise RuntimeError("set_batch_sizes needs the training DataLoader from prepare()")
        step = self.batch_core.set_batch_sizes(batch_sizes, device=self.accelerator.device)
        assert step is not None
        return step

    # ------------------------------------------------------------------ checkpointing
    def _save_shards(self, models: list[Any], weights: list[Any], output_dir: str) -> None:
        """``accelerator.save_state``'s hook, on every process: the sharded model's and optimizers' shards."""
        assert self.model is not None
        save_shards(output_dir, self.model, [o.optimizer for o in self.optimizers])

    def _note_shards(self, models: list[Any], input_dir: str) -> None:
        """``accelerator.load_state``'s hook: the shards are loaded with this object's state (after Accelerate's)."""
        self._shards_to_load = input_dir

    def state_dict(self) -> dict[str, Any]:
        """Sizes and position in the data, optimizer steps, measurements and controller state."""
        return {
            "global_step": self.global_step,
            "loader": self.train_loader.state_dict() if self.train_loader is not None else None,
            "meter": self.meter.state_dict() if self.meter is not None else None,
            "maker": self.maker.state_dict() if self.maker is not None else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (``accelerator.load_state`` calls it; with a sharded model it loads the
        model's and optimizers' shards saved beside it first)."""
        if self._shards_to_load is not None:
            assert self.model is not None
            load_shards(self._shards_to_load, self.model, [o.optimizer for o in self.optimizers])
            self._shards_to_load = None
        self.global_step = int(state_dict["global_step"])
        # the controller first: on another group of machines, its knowledge of them splits the global batch
        if state_dict.get("maker") is not None and self.maker is not None:
            self.maker.load_state_dict(state_dict["maker"])
            if self._machine_ids is not None:
                self.maker.join(self._machine_ids)
        if state_dict.get("loader") is not None and self.train_loader is not None:
            self.train_loader.load_state_dict(state_dict["loader"])
        if state_dict.get("meter") is not None and self.meter is not None:
            self.meter.load_state_dict(state_dict["meter"])


def _accelerated(optimizer: Any) -> Any:
    """``optimizer`` as ``accelerator.prepare`` wraps it (its steps skipped inside an accumulation window), but
    unknown to the Accelerator, whose ``save_state`` would write one process's shards of its state for all."""
    from accelerate.optimizer import AcceleratedOptimizer

    if isinstance(optimizer, AcceleratedOptimizer):
        return optimizer
    return AcceleratedOptimizer(optimizer, device_placement=False)


def _check_accelerator(accelerator: Any) -> None:
    """Refuse an Accelerator DynamixAccelerate cannot weight: not one, of one process, or syncing every batch."""
    from accelerate import Accelerator

    if not isinstance(accelerator, Accelerator):
        raise ValueError(f"`accelerator` must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    if accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
        raise ValueError(
            "`accelerator` all-reduces every accumulated batch (GradientAccumulationPlugin(sync_each_batch=True));"
            " DynamixAccelerate weights the gradient of a whole accumulation window at its one all-reduce. Use"
            " sync_each_batch=False (the default)."
        )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes < 2 and launched > 1:
        raise ValueError(
            f"`accelerator` runs 1 process although the launcher started {launched}: without a GPU, Accelerate"
            " only joins the processes when asked to use the CPU. Create it with"
            " Accelerator(cpu=not torch.cuda.is_available()), or set ACCELERATE_USE_CPU=1 for"
            " `accelerate launch --multi_gpu`."
        )
    if accelerator.num_processes < 2:
        raise ValueError(
            f"`accelerator` runs {accelerator.num_processes} process; DynamixAccelerate gives ranks different"
            " batch sizes, which needs a distributed job: start the script with"
            " `accelerate launch --multi_gpu --num_processes N script.py` or"
            " `torchrun --nproc_per_node N script.py` (N >= 2), or train without DynamixAccelerate on one process."
        )
