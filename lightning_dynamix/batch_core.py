"""The per-rank batch core that every front end holds: sizes, bounds, caps, the training loader and the weights.

:class:`PerRankBatchCore` is what ``HeterogeneousDDPStrategy`` (and the layer-offload strategy built on it) and
``DynamixAccelerate`` share: the sizes you gave and their checks, the smallest size a rank may be given and why
(a model's BatchNorm layers raise it), the caps of the ranks' machines, the training DataLoader rebuilt around a
:class:`~lightning_dynamix.data.HeterogeneousBatchSampler`, the policy that resumes its position on another
number of ranks, and the gradient weights of each backward pass (:class:`~lightning_dynamix.distributed.
SyncWindowWeighting` and the weighted all-reduce hook's state). A front end adds only what its framework needs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.utils.data import DataLoader

from lightning_dynamix._checks import require_int, require_optional_int
from lightning_dynamix.control.allocation import check_within_caps, fit_within_caps, validate_batch_size_caps
from lightning_dynamix.data import HeterogeneousBatchSampler, HeterogeneousDataLoader, validate_batch_sizes
from lightning_dynamix.data.items import ItemCounter, check_item_counter
from lightning_dynamix.data.loader import new_sampler_for
from lightning_dynamix.data.schedule import BatchSizes, check_least_batch_size
from lightning_dynamix.distributed import (
    LossReduction,
    SyncWindowWeighting,
    WeightedAllReduceState,
    gather_ints,
    report_gradient_norms,
    set_batch_sizes_on_every_rank,
    validate_loss_reduction,
)
from lightning_dynamix.distributed.batch_norm import fit_least_batch_size
from lightning_dynamix.elastic import ResumeWeights, resume_sampler
from lightning_dynamix.metrics.timers import StepClock

log = logging.getLogger(__name__)

GradientNormSink = Callable[[Tensor, int, Tensor, int], None]
"""``sink(local_sq_norm, local_samples, global_sq_norm, global_samples)``: a synchronisation's gradient norms."""


class PerRankBatchCore:
    """One rank's per-rank batch state and its checks, for a front end (a Lightning strategy, an Accelerate helper).

    Args:
        owner: the front end's name, for error messages (``"HeterogeneousDDPStrategy"``).
        batch_sizes: one initial size per rank; ``None``: the training DataLoader's ``batch_size`` on every rank.
        min_batch_size: the smallest size a rank may be given (>= 0; 0 lets a rank sit steps out); ``None``: 1,
            raised by :meth:`fit_model` to what the model's BatchNorm layers need.
        max_batch_size: the largest size a rank may be given (>= 1); ``None`` for no limit.
        loss_reduction: ``"mean"`` if the loss averages over the rank's samples (or the items ``count_items``
            counts), ``"sum"`` if it sums them.
        count_items: ``count(batch) -> int``, the items of a batch its mean loss averages over (a language
            model's tokens not ignored: :class:`~lightning_dynamix.LabelTokens`); every rank's count is gathered
            before each backward (one small collective) and the gradients weighted by items, not samples.
            ``None``: by samples.
        shuffle: draw every epoch's global order at random (from ``seed`` and the epoch).
        seed: seed of the global order, the same on every rank.
        drop_last: skip the incomplete last step of each epoch instead of spreading its samples.
        group_by_length: batch by length: each run of this many samples of the epoch's order sorted by length
            (:class:`~lightning_dynamix.data.HeterogeneousBatchSampler`); ``None``: not.
        batch_size_caps: the largest size each rank's machine holds (``None`` entries for no cap of its own).
        world_size: the number of ranks where it is known at construction (sizes and caps are counted then);
            ``None``: checked by :meth:`check_world_size` once known.
        rank_word: what the front end calls a rank in messages (``"rank"``, ``"process"``).
        world_size_hint: where the world size comes from, for messages (``" (devices x num_nodes)"``).
        setup_error: what a set-up error raises (past the constructor): ``ValueError``, or Lightning's
            ``MisconfigurationException`` for a strategy.

    Raises:
        ValueError: naming the argument, the value and what is valid, for sizes that are not ints, lie outside
            ``[min_batch_size, max_batch_size]`` or a cap, or are all 0, bad bounds or caps, or an unknown
            ``loss_reduction``, or a ``count_items`` that is not callable.
    """

    def __init__(
        self,
        owner: str,
        batch_sizes: Sequence[int] | None = None,
        *,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        loss_reduction: LossReduction = "mean",
        count_items: ItemCounter | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        group_by_length: int | None = None,
        batch_size_caps: Sequence[int | None] | None = None,
        world_size: int | None = None,
        rank_word: str = "rank",
        world_size_hint: str = "",
        setup_error: type[Exception] = ValueError,
    ) -> None:
        self.owner = owner
        self.setup_error = setup_error
        self.rank_word = rank_word
        self.ranks = "processes" if rank_word == "process" else f"{rank_word}s"
        self.world_size_hint = world_size_hint
        require_optional_int("min_batch_size", min_batch_size, 0)
        self.min_batch_size_given = min_batch_size
        low = 1 if min_batch_size is None else min_batch_size
        self.max_batch_size = require_optional_int(
            "max_batch_size", max_batch_size, max(low, 1), "min_batch_size" if low else None
        )
        self.min_batch_size = low
        """The smallest size any rank may be given (0: a rank may sit steps out)."""
        self.least_batch_size = max(low, 1)
        """The smallest size a rank that trains may be given: ``min_batch_size``, or 1 with ``min_batch_size=0``,
        raised by :meth:`fit_model` to what the model's batch-dependent layers need (2 for BatchNorm)."""
        self.least_reason: str | None = None
        """Why :attr:`least_batch_size` is above 1 (the layers that need it); ``None`` where nothing raised it."""
        self.batch_size_caps = validate_batch_size_caps(batch_size_caps)
        self.caps: list[int | None] | None = None
        """The caps now, once the world size is known: ``batch_size_caps``, lowered in place where a rank ran out
        of memory (see :mod:`~lightning_dynamix.strategies.memory_recovery`)."""
        if world_size is not None:
            self.check_world_size(world_size, ValueError)
        self.loss_reduction: LossReduction = validate_loss_reduction(loss_reduction)
        self.count_items = check_item_counter(count_items)
        self.shuffle = bool(shuffle)
        self.seed = require_int("seed", seed, None)
        self.drop_last = bool(drop_last)
        self.group_by_length = require_optional_int("group_by_length", group_by_length, 2)
        self.initial_sizes: BatchSizes | None = None
        """The sizes you chose (at construction, or with :meth:`set_batch_sizes` before training)."""
        if batch_sizes is not None:
            self.initial_sizes = self.validate(batch_sizes, world_size)
        self.resume_weights: ResumeWeights | None = None
        """Relative speeds of the ranks when a position saved by another number of ranks is resumed (a controller
        sets it from what it knows of the machines); ``None`` splits the global batch evenly."""
        self.hook_state = WeightedAllReduceState()
        """The weighted all-reduce hook's state (its weight, the step clock, the bucket norms)."""
        self.weighting: SyncWindowWeighting | None = None
        self.loader: HeterogeneousDataLoader | None = None
        """The training DataLoader, once :meth:`training_loader` built it."""
        self.norm_sink: GradientNormSink | None = None

    # ------------------------------------------------------------------ sizes and bounds
    def validate(self, batch_sizes: object, world_size: int | None = None) -> BatchSizes:
        """``batch_sizes`` checked against the bounds, the least size and the caps (where their count matches).

        Raises:
            ValueError: naming what is wrong and what is valid.
        """
        sizes = validate_batch_sizes(
            batch_sizes, world_size=world_size, min_batch_size=self.min_batch_size, max_batch_size=self.max_batch_size
        )
        check_least_batch_size(sizes, self.least_batch_size, reason=self.least_reason)
        caps = self.current_caps
        if caps is not None and len(caps) == len(sizes):
            check_within_caps(sizes, caps, self.ranks)
        return sizes

    @property
    def current_caps(self) -> list[int | None] | None:
        """The largest size per rank now (see :attr:`caps`); before the world size is known, those given."""
        return list(self.caps) if self.caps is not None else self.batch_size_caps

    def check_world_size(self, world_size: int, error: type[Exception] | None = None) -> list[int | None]:
        """The caps of ``world_size`` ranks (``None`` entries where none was given), kept as :attr:`caps`.

        Raises:
            ``error`` (default: :attr:`setup_error`): for caps given for another number of ranks.
        """
        caps = self.batch_size_caps
        if caps is not None and len(caps) != world_size:
            raise (error or self.setup_error)(
                f"`batch_size_caps` {caps} gives {len(caps)} {self.ranks} a cap, but the job has {world_size}"
                f"{self.world_size_hint}; give one cap (or None) per {self.rank_word}"
            )
        if self.caps is None:
            self.caps = list(caps) if caps is not None else [None] * world_size
        return self.caps

    def fit_model(self, module: Module, world_size: int) -> None:
        """Raise the least size to what ``module``'s batch-dependent layers need (BatchNorm: 2 samples).

        Raises:
            :attr:`setup_error`: naming the layers, for a ``min_batch_size`` or ``batch_sizes`` you gave below the
                need.
        """
        try:
            low, least, reason = fit_least_batch_size(
                module, world_size, self.min_batch_size_given, self.initial_sizes, self.owner
            )
        except ValueError as error:
            raise self.setup_error(str(error)) from None
        self.min_batch_size, self.least_batch_size, self.least_reason = low, least, reason

    @property
    def batch_sizes(self) -> BatchSizes | None:
        """The latest per-rank sizes set (what new steps use); ``None`` until known."""
        if self.loader is not None:
            return self.loader.batch_sampler.batch_sizes
        return self.initial_sizes

    @property
    def current_batch_sizes(self) -> BatchSizes | None:
        """Every rank's real size in the batch being trained now; ``None`` before the first batch."""
        loader = self.loader
        if loader is None or loader.current_step < 0:
            return None
        return loader.current_batch_sizes

    @property
    def sits_out(self) -> bool:
        """Whether this rank has no samples in the batch being trained (its batch is an ``EmptyBatch``)."""
        return self.loader is not None and self.loader.sits_out

    @property
    def own_count(self) -> int:
        """This rank's share of the step being trained, what its mean loss averages over: its items where
        ``count_items`` counts them, else its samples (0 where it sits out)."""
        loader = self.loader
        if loader is None or loader.current_step < 0:
            raise RuntimeError("no batch was handed out by the training DataLoader yet: ask after a step's batch")
        if self.count_items is not None:
            return loader.current_items
        return loader.current_batch_sizes[loader.batch_sampler.rank]

    def set_batch_sizes(
        self, batch_sizes: Sequence[int], from_step: int | None = None, device: torch.device | None = None
    ) -> int | None:
        """New sizes from an agreed step: a collective while training (see
        :func:`~lightning_dynamix.distributed.set_batch_sizes_on_every_rank`); before training, the initial sizes.

        Returns:
            The step they apply from, or ``None`` before training.

        Raises:
            ValueError: for invalid sizes, a step already produced, or ranks that disagree.
        """
        world_size = self.loader.batch_sampler.world_size if self.loader is not None else None
        sizes = self.validate(batch_sizes, world_size)
        require_optional_int("from_step", from_step, 0)
        if self.loader is None:
            self.initial_sizes = sizes
            return None
        return set_batch_sizes_on_every_rank(self.loader.batch_sampler, sizes, from_step, device=device)

    # ------------------------------------------------------------------ the training DataLoader
    def training_loader(
        self, dataloader: object, rank: int, world_size: int, instead: str, epoch: int | None = None
    ) -> HeterogeneousDataLoader:
        """The training DataLoader rebuilt around this rank's :class:`HeterogeneousBatchSampler` (kept as
        :attr:`loader`), with the dataset, collate function, workers and pinning of ``dataloader``.

        A :class:`HeterogeneousDataLoader` of this rank is kept as it is; sizes nobody chose (the DataLoader's
        ``batch_size`` on every rank) are split within the caps; a saved position is resumed by :meth:`resume`.
        ``epoch``: the epoch about to run, where the front end knows it (DataLoader workers prefetch at once).

        Raises:
            :attr:`setup_error`: naming the owner and ending with ``instead``, for anything but a plain
                ``DataLoader`` over a map-style dataset (or a ``HeterogeneousDataLoader`` of another rank or least
                size), and for a dataset smaller than one global batch.
        """
        try:
            sampler = self._sampler(dataloader, rank, world_size, instead)
        except ValueError as error:
            raise self.setup_error(str(error)) from error
        if epoch is not None:
            sampler.set_epoch(epoch)
        self._fit_caps(sampler, world_size)
        if isinstance(dataloader, HeterogeneousDataLoader) and dataloader.batch_sampler is sampler:
            loader = dataloader
        else:
            loader = HeterogeneousDataLoader.like(dataloader, sampler)  # type: ignore[arg-type]
        # a framework may load the saved position more than once (Lightning does when it restarts mid-epoch)
        loader.resume = functools.partial(self.resume, sampler)
        loader.step_clock = self.hook_state.clock
        loader.count_items = self.count_items
        self.loader = loader
        self.weighting = SyncWindowWeighting(rank, self.loss_reduction)  # a new loader starts a new window
        return loader

    def _sampler(self, dataloader: object, rank: int, world_size: int, instead: str) -> HeterogeneousBatchSampler:
        """``dataloader``'s own sampler where it is this rank's, else a new one over its dataset."""
        if not isinstance(dataloader, DataLoader):
            raise ValueError(
                f"{self.owner} needs the training data as a torch DataLoader over a map-style dataset, got"
                f" {type(dataloader).__name__}."
            )
        existing = dataloader.batch_sampler
        if isinstance(existing, HeterogeneousBatchSampler):
            if (existing.rank, existing.world_size) != (rank, world_size):
                raise ValueError(
                    f"The training DataLoader's HeterogeneousBatchSampler is for rank {existing.rank} of"
                    f" {existing.world_size}, but this process is rank {rank} of {world_size}."
                )
            if existing.least_batch_size < self.least_batch_size:
                raise ValueError(
                    f"The training DataLoader's HeterogeneousBatchSampler has least_batch_size="
                    f"{existing.least_batch_size}, but {self.least_reason}: build it with"
                    f" least_batch_size={self.least_batch_size}."
                )
            return existing
        return new_sampler_for(
            dataloader,
            self.initial_sizes,
            rank=rank,
            world_size=world_size,
            min_batch_size=self.min_batch_size,
            max_batch_size=self.max_batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=self.drop_last,
            least_batch_size=self.least_batch_size,
            group_by_length=self.group_by_length,
            owner=self.owner,
            instead=instead,
        )

    def _fit_caps(self, sampler: HeterogeneousBatchSampler, world_size: int) -> None:
        """Sizes nobody chose (the DataLoader's ``batch_size`` on every rank) split within the ranks' caps."""
        caps = self.check_world_size(world_size)
        fitted = fit_within_caps(sampler.batch_sizes, caps, self.least_batch_size) if sampler.next_step == 0 else None
        if fitted is not None:
            log.info("%s: sizes split within the %s' caps %s: %s", self.owner, self.ranks, caps, fitted)
            sampler.set_batch_sizes(fitted, from_step=0)

    def resume(self, sampler: HeterogeneousBatchSampler, state: dict[str, Any]) -> None:
        """Load a saved position in the training data, saved by this number of ranks or another.

        Raises:
            :attr:`setup_error`: naming the owner, for a state the sampler refuses or a global batch the ranks
                cannot hold.
        """
        try:
            resume_sampler(
                sampler,
                state,
                min_batch_size=self.min_batch_size,
                max_batch_size=self.max_batch_size,
                batch_sizes=self.initial_sizes,  # chosen by you: they win from the resumed step on
                weights=self.resume_weights,
            )
        except ValueError as err:
            raise self.setup_error(f"{self.owner} cannot resume this checkpoint: {err}") from err

    def set_step_clock(self, clock: StepClock) -> None:
        """Time this rank's steps with ``clock``: the wait for each batch and the all-reduce's buckets."""
        self.hook_state.clock = clock
        if self.loader is not None:
            self.loader.step_clock = clock

    # ------------------------------------------------------------------ gradient weights
    def weight_backward(
        self, loss: Tensor, loss_scale: float, window_end: int | None, syncing: bool, reduce_scale: float = 1.0
    ) -> None:
        """Before a training backward pass: weight ``loss``'s gradient by this rank's share of the window's samples.

        A scalar on the loss's gradient reaches every parameter's gradient at no extra cost. Where the pass
        synchronises (``syncing``), the hook's weight becomes the window's correction (1.0 unless sizes changed
        inside it).

        Args:
            loss: the rank's loss of the batch being trained.
            loss_scale: the factor the loop already applied to the loss (1 / accumulation steps).
            window_end: the step after the last of the accumulation window this pass belongs to, as planned now;
                ``None``: this step ends it.
            syncing: whether this pass all-reduces the gradients.
            reduce_scale: what the engine's reduction divides the ranks' summed gradients by, made up here: 1 for
                the weighted all-reduce hook, which sums; the world size for FSDP2's averaging reduce-scatter; 0 for
                a rank that runs a placeholder at weight 0.

        Raises:
            RuntimeError: before the training DataLoader handed out a batch.
        """
        loader, weighting = self.loader, self.weighting
        if loader is None or weighting is None or loader.current_step < 0:
            raise RuntimeError(
                "backward() was called before the training DataLoader handed out a batch; the gradient"
                " weights come from the batch being trained."
            )
        step, sizes = loader.current_step, loader.current_batch_sizes
        items = self.step_items(loss.device)
        counts = sizes if items is None else items
        estimate = None
        if not weighting.window_started:
            estimate = sum(counts)
            if window_end is not None:  # the window's later steps: their samples at this step's items per sample
                planned = loader.batch_sampler.planned_samples(step + 1, window_end)
                estimate += round(planned * sum(counts) / max(sum(sizes), 1))
        factor = weighting.add_backward(step, sizes, loss_scale, estimate, items) * reduce_scale
        loss.register_hook(lambda grad: grad * factor)
        if syncing:
            self.hook_state.weight = weighting.sync_weight()

    def step_items(self, device: torch.device) -> list[int] | None:
        """Every rank's item count at the step being trained, where ``count_items`` was given (else ``None``): one
        all_gather among the ranks in its backward pass (all, or those that train where the others left the step),
        timed as a wait for the others. Call it on each of those ranks before the step's backward pass."""
        loader = self.loader
        if self.count_items is None or loader is None:
            return None
        own = loader.current_items
        group = self.hook_state.process_group
        if not (dist.is_available() and dist.is_initialized()):
            return [own]
        clock = self.hook_state.clock
        started = clock.now() if clock is not None else None
        gathered = gather_ints([own], device=device, group=group)
        if clock is not None and started is not None:
            clock.collective(started, clock.now())
        counts = dict(zip(_group_ranks(group), (values[0] for values in gathered)))
        return [counts.get(rank, 0) for rank in range(len(loader.current_batch_sizes))]

    def end_window(self) -> None:
        """After the backward pass that synchronised: report its gradient norms and start a new window."""
        assert self.weighting is not None
        if self.norm_sink is not None:
            report_gradient_norms(self.hook_state, self.weighting, self.norm_sink)
        self.weighting.reset()


def _group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` in its order (``None``: every rank)."""
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)
