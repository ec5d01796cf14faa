"""Batch sampling with a different batch size on every rank and one global schedule.

:class:`HeterogeneousBatchSampler` replaces ``DistributedSampler`` + ``BatchSampler`` in
data-parallel training where ranks have different speeds. All ranks share one epoch order (a
permutation seeded with ``seed + epoch``) and one cursor into it: step ``k`` takes the next
``sum(b)`` positions and rank ``r`` gets its slice in rank order. Because every rank computes the
same schedule, all ranks yield the same number of batches (unequal counts would hang DDP), every
sample is used exactly once per epoch, and batch sizes can change at any step not yet handed
out, identically on all ranks. See :mod:`lightning_dynamix.data.schedule` for the last step of an
epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, Sampler

from lightning_dynamix._checks import require_int, require_optional_int
from lightning_dynamix.data.chunks import ChunkLayout, validate_chunk_sizes
from lightning_dynamix.data.language import grouped_by_length, sample_lengths
from lightning_dynamix.data.schedule import BatchSizes, EpochSchedule, split_exactly, validate_batch_sizes
from lightning_dynamix.data.streaming import can_index, chunk_sizes_of

_STATE_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # 1: before resuming into another world size (no cut_world_size, schedules from step 0)


def even_split(total: int, world_size: int) -> BatchSizes:
    """``total`` samples over ``world_size`` ranks as evenly as possible (the first ranks take the remainder)."""
    if world_size < 1 or total < world_size:
        raise ValueError(f"a global batch of {total} samples cannot give each of {world_size} ranks one or more")
    base, extra = divmod(total, world_size)
    return tuple(base + (1 if r < extra else 0) for r in range(world_size))


class EpochPermutation(Sampler[int]):
    """The global order of one epoch, shared by all ranks.

    A permutation of ``range(num_samples)`` drawn from a generator seeded with ``seed + epoch``
    (the identity when ``shuffle=False``), with each run of ``group_by_length`` positions sorted by ``lengths``
    where both are given (:func:`~lightning_dynamix.data.language.grouped_by_length`). It is the ``sampler`` of a
    :class:`HeterogeneousBatchSampler`, so loops that call ``batch_sampler.sampler.set_epoch``
    (Lightning does) reshuffle every epoch.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        on_epoch_change: Callable[[int], None] | None = None,
        group_by_length: int | None = None,
        lengths: Sequence[int] | None = None,
    ) -> None:
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.group_by_length = group_by_length
        self._lengths = None if lengths is None or group_by_length is None else torch.as_tensor(list(lengths))
        self.epoch = 0
        self._on_epoch_change = on_epoch_change
        self._order: torch.Tensor | None = None
        self._order_epoch = -1

    def set_epoch(self, epoch: int) -> None:
        """Select the order of ``epoch``; every rank must use the same epoch."""
        require_int("epoch", epoch, 0)
        changed = epoch != self.epoch
        self.epoch = epoch
        if changed and self._on_epoch_change is not None:
            self._on_epoch_change(epoch)

    def _current_order(self) -> torch.Tensor:
        if self._order is None or self._order_epoch != self.epoch:
            if self.shuffle:
                generator = torch.Generator()
                generator.manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(self.num_samples, generator=generator)
            else:
                self._order = torch.arange(self.num_samples)
            if self._lengths is not None and self.group_by_length is not None:
                self._order = grouped_by_length(self._order, self._lengths, self.group_by_length)
            self._order_epoch = self.epoch
        return self._order

    def indices(self, start: int, stop: int) -> list[int]:
        """Dataset indices at positions ``[start, stop)`` of this epoch's order."""
        if not self.shuffle and self._lengths is None:
            return list(range(start, stop))
        return self._current_order()[start:stop].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices(0, self.num_samples))

    def __len__(self) -> int:
        return self.num_samples


def _dataset_length(data_source: object) -> int:
    if isinstance(data_source, bool):
        raise ValueError(f"`data_source` must be a sized dataset or an int, got {data_source!r}")
    if isinstance(data_source, int):
        if data_source < 1:
            raise ValueError(f"`data_source` as a number of samples must be >= 1, got {data_source}")
        return data_source
    if isinstance(data_source, IterableDataset):
        name = type(data_source).__name__
        if can_index(data_source):
            raise ValueError(
                f"`data_source` is an iterable-style dataset ({name}) that can be indexed, as LitData's and"
                f" MosaicML's StreamingDataset can: pass lightning_dynamix.data.StreamingView({name}(...)), a map-style"
                " view that keeps its chunks."
            )
        raise ValueError(
            f"`data_source` is an iterable-style dataset ({name}); per-rank batch"
            " sizes need a map-style dataset with __len__ and __getitem__ (torch.utils.data.Dataset)."
        )
    if not isinstance(data_source, Sized):
        raise ValueError(
            f"`data_source` must be a sized dataset (with __len__) or an int, got {type(data_source).__name__}"
        )
    length = len(data_source)
    if length < 1:
        raise ValueError("`data_source` is empty; it must hold at least one global batch of samples")
    return length


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "`rank` and `world_size` were not given and torch.distributed is not initialized;"
                " pass both, or call torch.distributed.init_process_group first."
            )
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    for name, value in (("rank", rank), ("world_size", world_size)):
        require_int(name, value, None)
    if world_size < 1:
        raise ValueError(f"`world_size` must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"`rank` must lie in [0, world_size - 1] = [0, {world_size - 1}], got {rank}")
    return rank, world_size


class HeterogeneousBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches of a global schedule with one batch size per rank.

    Args:
        data_source: a map-style dataset (anything with ``__len__``) or the number of samples.
        batch_sizes: one int per rank, the samples each rank takes per step; 0 for a rank that
            sits steps out (it gets empty batches; the loader hands out :class:`EmptyBatch`), and
            at least one rank must train.
        rank: this process's rank; read from ``torch.distributed`` when omitted.
        world_size: the number of ranks; read from ``torch.distributed`` when omitted.
        shuffle: draw a new order every epoch (seeded with ``seed + epoch``); else dataset order.
        seed: base seed of the epoch order; must be the same on all ranks.
        drop_last: skip the fewer than ``sum(batch_sizes)`` samples left at the end of an epoch
            instead of spreading them over a final step (see :mod:`lightning_dynamix.data.schedule`).
        least_batch_size: the fewest samples a rank that trains gets, the epoch's final step included:
            2 for a model whose BatchNorm needs more than one sample (see
            :func:`~lightning_dynamix.distributed.batch_norm.least_batch_size`); every size > 0 must be
            at least this.
        group_by_length: batch by length: each run of this many positions of the epoch's order is sorted by the
            samples' lengths, longest first, so a step's samples have alike lengths and little padding (``None``,
            default: not). Several global batches (Hugging Face's ``LengthGroupedSampler`` takes 50), so the order
            stays random across groups; see docs/transformers.md for what it costs the order's randomness.
        lengths: every sample's length for ``group_by_length``; default: the dataset's
            (:func:`~lightning_dynamix.data.language.sample_lengths`).
        chunk_sizes: samples per chunk of a dataset stored in chunks (a streaming dataset's files, in its index
            order): each rank then reads whole chunks of its own (:class:`~lightning_dynamix.data.chunks.ChunkLayout`)
            instead of slices of one shuffled order; the sizes, the schedule and the guarantees are the same.
            Default: the dataset's own (:func:`~lightning_dynamix.data.streaming.chunk_sizes_of`), else none.
        shuffle_within_chunks: with chunks and ``shuffle``, each chunk's samples in a new order every epoch;
            ``False``: in the chunk's own order (far cheaper to read from a streaming library). Default: the
            dataset's (a :class:`~lightning_dynamix.data.StreamingView`'s setting), else ``True``.

    Steps are counted within an epoch from 0, like Lightning's ``batch_idx``. Call
    :meth:`set_epoch` between epochs (Lightning does it through ``sampler.set_epoch``); a new
    epoch starts with the latest sizes. Every rank must make the same calls with the same
    arguments, in the same order relative to the steps it has produced.

    Raises:
        ValueError: on sizes that are not ints >= 0 or all 0, a count of sizes other than the world
            size, an iterable-style or empty dataset, or a dataset smaller than one global batch.
    """

    def __init__(
        self,
        data_source: Sized | int,
        batch_sizes: Sequence[int],
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        least_batch_size: int = 1,
        group_by_length: int | None = None,
        lengths: Sequence[int] | None = None,
        chunk_sizes: Sequence[int] | None = None,
        shuffle_within_chunks: bool | None = None,
    ) -> None:
        num_samples = _dataset_length(data_source)
        if shuffle_within_chunks is None:
            shuffle_within_chunks = getattr(data_source, "shuffle_within_chunks", True)
        if chunk_sizes is None and not isinstance(data_source, int):
            chunk_sizes = chunk_sizes_of(data_source)
        if chunk_sizes is not None:
            chunk_sizes = validate_chunk_sizes(chunk_sizes, num_samples)
            if group_by_length is not None:
                raise ValueError(
                    "`group_by_length` and `chunk_sizes` cannot be combined: a rank reads whole chunks in their own"
                    " order, which batching by length would reorder across chunks"
                )
        require_optional_int("group_by_length", group_by_length, 2)
        if group_by_length is not None and lengths is None:
            if isinstance(data_source, int):
                raise ValueError(
                    "`group_by_length` needs the samples' lengths: pass `lengths` or a dataset as `data_source`"
                )
            lengths = sample_lengths(data_source)
        if lengths is not None and len(lengths) != num_samples:
            raise ValueError(f"`lengths` must hold one length per sample ({num_samples}), got {len(lengths)}")
        self.rank, self.world_size = _resolve_rank(rank, world_size)
        sizes = validate_batch_sizes(batch_sizes, world_size=self.world_size, min_batch_size=0)
        if num_samples < sum(sizes):
            raise ValueError(
                f"`data_source` has {num_samples} samples, fewer than one global batch: `batch_sizes`"
                f" {list(sizes)} sum to {sum(sizes)}. Use smaller batch sizes or a larger dataset."
            )
        require_int("seed", seed, None)
        self.num_samples = num_samples
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.group_by_length = group_by_length
        self.sampler = EpochPermutation(
            num_samples,
            shuffle=self.shuffle,
            seed=seed,
            on_epoch_change=self._on_permutation_epoch,
            group_by_length=group_by_length,
            lengths=lengths,
        )
        self.layout = (
            None
            if chunk_sizes is None
            else ChunkLayout(
                chunk_sizes, shuffle=self.shuffle, seed=seed, shuffle_within_chunks=bool(shuffle_within_chunks)
            )
        )
        """Which samples fill each rank's batches where the dataset is stored in chunks; ``None``: slices of
        ``sampler``'s order."""
        self.cut_world_size = self.world_size
        """The world size whose cut of every epoch this job keeps: the one it started with (see ``schedule``)."""
        self.least_batch_size = least_batch_size
        self._schedule = EpochSchedule(num_samples, sizes, drop_last=self.drop_last, least_batch_size=least_batch_size)
        self._schedule_epoch = 0
        self._next_epoch_sizes: BatchSizes | None = None
        self._pass_start = 0  # first step of the current pass over the schedule
        self._produced = 0  # the next step this sampler will produce
        self._consumed = 0  # batches of this pass handed to training (counted by the DataLoader)
        self._pass_started = False
        self._counts_consumption = False
        self._resplit = (0, 0)  # steps [start, stop) produced at sizes a resplit() changed since
        self.on_schedule_change: Callable[[], None] | None = None
        """Called after every change of the current epoch's schedule (and so possibly of ``len``)."""

    # ------------------------------------------------------------------ schedule
    def _sync_epoch(self) -> None:
        if self.sampler.epoch != self._schedule_epoch:
            self._schedule_epoch = self.sampler.epoch
            self._new_schedule()

    def _on_permutation_epoch(self, epoch: int) -> None:
        self._sync_epoch()

    def _new_schedule(self) -> None:
        sizes = self._next_epoch_sizes or self._schedule.latest_batch_sizes
        self._schedule = EpochSchedule(
            self.num_samples,
            sizes,
            drop_last=self.drop_last,
            cut_world_size=self.cut_world_size,
            least_batch_size=self.least_batch_size,
        )
        self._next_epoch_sizes = None
        self._pass_start = self._produced = self._consumed = 0
        self._pass_started = False
        self._resplit = (0, 0)
        if self.layout is not None:
            self.layout.set_epoch(self.sampler.epoch)
        self._schedule_changed()

    def _schedule_changed(self) -> None:
        if self.on_schedule_change is not None:
            self.on_schedule_change()

    @property
    def epoch(self) -> int:
        """The epoch whose order and schedule this sampler follows."""
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch``: a new order, and a schedule that starts with the latest sizes."""
        self.sampler.set_epoch(epoch)
        self._sync_epoch()

    @property
    def batch_sizes(self) -> BatchSizes:
        """The latest sizes set: what new steps and the next epoch use."""
        self._sync_epoch()
        return self._next_epoch_sizes or self._schedule.latest_batch_sizes

    @property
    def next_step(self) -> int:
        """The first step of this epoch not yet produced: the earliest a size change can apply."""
        self._sync_epoch()
        return self._produced

    @property
    def schedule(self) -> EpochSchedule:
        """The current epoch's schedule (read-only use; change it with :meth:`set_batch_sizes`)."""
        self._sync_epoch()
        return self._schedule

    def batch_sizes_at(self, step: int) -> BatchSizes:
        """Every rank's real batch size at ``step`` of the current epoch (the final step included)."""
        return self.schedule.batch_sizes_at(step)

    def nominal_batch_sizes_at(self, step: int) -> BatchSizes:
        """The sizes in force at ``step`` of the current epoch, before the final step's adjustment."""
        return self.schedule.nominal_batch_sizes_at(step)

    def planned_samples(self, start: int, stop: int) -> int:
        """Samples over all ranks in steps ``[start, stop)`` of the current epoch, as the schedule plans them now.

        ``stop`` is capped at the epoch's end. A gradient-accumulation window's expected size: sizes
        changed later for steps not yet produced make the real window differ.
        """
        schedule = self.schedule
        return sum(sum(schedule.batch_sizes_at(step)) for step in range(start, min(stop, len(schedule))))

    def set_batch_sizes(self, batch_sizes: Sequence[int], from_step: int | None = None) -> int:
        """Use ``batch_sizes`` from ``from_step`` of the current epoch on.

        Args:
            batch_sizes: one int >= 0 per rank, not all 0; their sum must not exceed the dataset.
            from_step: the first step to use them; default :attr:`next_step`, the first step not
                yet produced. Steps already produced (prefetched by DataLoader workers, say) keep
                their sizes. A step at or past the end of the epoch means: from the next epoch.

        Returns:
            The step from which the sizes apply; ``len(self)`` when from the next epoch.

        A later call replaces any change scheduled at or after its own ``from_step``.
        """
        self._sync_epoch()
        sizes = validate_batch_sizes(batch_sizes, world_size=self.world_size, min_batch_size=0)
        if sum(sizes) > self.num_samples:
            raise ValueError(
                f"`batch_sizes` {list(sizes)} sum to {sum(sizes)}, more than the {self.num_samples}"
                " samples of the dataset; the global batch must fit in the dataset."
            )
        step = self._produced if require_optional_int("from_step", from_step, None) is None else from_step
        if step < self._produced:
            raise ValueError(
                f"`from_step`={step} was already produced: steps before {self._produced} are fixed."
                " Pass from_step=None for the first step that can still change."
            )
        if self._schedule.change(step, sizes):
            self._next_epoch_sizes = None
            applied = step
        else:
            self._next_epoch_sizes = sizes
            applied = len(self._schedule)
        self._schedule_changed()
        return applied

    def resplit(self, step: int, batch_sizes: Sequence[int]) -> None:
        """Split the global batch anew from ``step`` on, a step already handed out included.

        For a step that could not be trained at its sizes (a rank ran out of memory): the steps keep their
        samples and global batches, each rank's share changes. Batches already produced at the old sizes
        (prefetched) no longer match; :meth:`was_resplit` names them and a :class:`HeterogeneousDataLoader`
        rebuilds them (:meth:`indices_at`).

        Args:
            step: the step of the current epoch to split anew from: the one being trained or a later one.
            batch_sizes: one size per rank, summing to the global batch of ``step``.

        Raises:
            ValueError: for sizes of another sum, or a step already trained.
        """
        self._sync_epoch()
        sizes = validate_batch_sizes(batch_sizes, world_size=self.world_size, min_batch_size=0)
        trained = self._pass_start + self._consumed - 1 if self._counts_consumption else self._produced - 1
        if isinstance(step, bool) or not isinstance(step, int) or not trained <= step < len(self._schedule):
            raise ValueError(
                f"`step` must be the step being trained ({trained}) or a later one of this epoch, got {step!r}"
            )
        global_batch = sum(self._schedule.nominal_batch_sizes_at(step))
        produced = {s: self._schedule.batch_sizes_at(s) for s in range(step, self._produced)}
        if sum(sizes) != global_batch:
            raise ValueError(
                f"`batch_sizes` {list(sizes)} sum to {sum(sizes)}; a resplit keeps step {step}'s global batch"
                f" of {global_batch}"
            )
        self._schedule.change(step, sizes)
        self._next_epoch_sizes = None
        self._resplit = (step, max(self._produced, self._resplit[1]))
        if self.layout is not None:
            self.layout.resplit(step, produced)
        self._schedule_changed()

    def was_resplit(self, step: int) -> bool:
        """Whether ``step`` was produced before :meth:`resplit` changed its sizes (its batch must be rebuilt)."""
        start, stop = self._resplit
        return start <= step < stop

    def indices_at(self, step: int) -> list[int]:
        """This rank's sample indices at ``step`` of the current epoch, under the schedule as it is now."""
        return self._indices(self.schedule, step)

    def placeholder_index(self, step: int) -> int:
        """The first sample index of ``step``'s global batch (whichever rank trains it), under the schedule as it is
        now: what a rank without samples runs at weight 0 where it must still take part in the step's collectives."""
        if self.layout is not None:
            return next(indices[0] for indices in self.layout.step(self.schedule, step) if indices)
        cursor, _ = self.schedule.step_at(step)
        return self.sampler.indices(cursor, cursor + 1)[0]

    def _indices(self, schedule: EpochSchedule, step: int) -> list[int]:
        if self.layout is not None:
            return list(self.layout.step(schedule, step)[self.rank])
        cursor, sizes = schedule.step_at(step)
        start = cursor + sum(sizes[: self.rank])
        return self.sampler.indices(start, start + sizes[self.rank])

    # ------------------------------------------------------------------ iteration
    def __len__(self) -> int:
        """The number of steps of the current epoch under the current schedule."""
        return len(self.schedule)

    def __iter__(self) -> Iterator[list[int]]:
        self._sync_epoch()
        if self._pass_started:
            self._new_schedule()  # a second pass over the same epoch starts afresh
        self._consumed = 0
        return self._generate()

    def _generate(self) -> Iterator[list[int]]:
        self._sync_epoch()  # set_epoch may have been called between iter() and the first batch
        self._pass_started = True
        schedule = self._schedule
        step = self._pass_start
        while step < len(schedule):
            if self._schedule is not schedule or self.sampler.epoch != self._schedule_epoch:
                raise RuntimeError(
                    f"the epoch changed (set_epoch({self.sampler.epoch})) while an iterator over epoch"
                    f" {self._schedule_epoch} was still producing batches; create a new iterator after set_epoch"
                    " so that no batch of the old epoch is mixed into the new one."
                )
            indices = self._indices(schedule, step)
            self._produced = step + 1
            yield indices
            step += 1

    def _consume(self) -> int:
        """Count one batch of the current pass as handed to training; return its step."""
        step = self._pass_start + self._consumed
        self._consumed += 1
        return step

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """Everything needed to resume the current epoch exactly.

        Args:
            step: the number of this epoch's steps already trained on, where a resumed run
                continues. Default: the batches handed out by a :class:`HeterogeneousDataLoader`
                over this sampler, else the batches this sampler produced (equal when it is
                iterated directly or by a DataLoader with ``num_workers=0``).
        """
        self._sync_epoch()
        if step is None:
            step = self._pass_start + self._consumed if self._counts_consumption else self._produced
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= self._produced:
            raise ValueError(f"`step` must lie in [0, {self._produced}] (steps produced), got {step}")
        return {
            "version": _STATE_VERSION,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "group_by_length": self.group_by_length,
            "epoch": self.epoch,
            "cut_world_size": self.cut_world_size,
            "first_cursor": self._schedule.first_cursor,
            "segments": [[start, list(sizes)] for start, sizes in self._schedule.segments],
            "next_epoch_batch_sizes": None if self._next_epoch_sizes is None else list(self._next_epoch_sizes),
            "step": step,
            "num_chunks": None if self.layout is None else self.layout.num_chunks,
            "shuffle_within_chunks": None if self.layout is None else self.layout.shuffle_within_chunks,
            # the chunk pieces the ranks held at `step` and the chunks not handed out yet
            "chunk_layout": None
            if self.layout is None or step == len(self._schedule)
            else self.layout.state_at(self._schedule, step),
        }

    def load_state_dict(self, state_dict: dict[str, Any], split: Callable[[int], Sequence[int]] | None = None) -> None:
        """Restore :meth:`state_dict`; the next pass continues at the saved step.

        A state saved after the last step of its epoch resumes at the start of the next epoch
        (epoch + 1, with the latest sizes), so that an iterator created before the training loop
        sets the new epoch already yields the new epoch's batches.

        A state saved by another number of ranks resumes too: the rest of the epoch keeps its steps
        and global batches (so the samples still to train are trained exactly once, in the global
        batches the saved job would have trained), each split over this sampler's ranks by
        ``split(global_batch)`` (default: :func:`even_split`); the epochs after it keep the saved
        job's global batch and its cut of the epoch (:attr:`cut_world_size`). The sizes this sampler
        was built with are not used then: set other ones with :meth:`set_batch_sizes` after loading.

        Raises:
            ValueError: when the state comes from a format version this code cannot read, or from
                another dataset size, shuffle, seed, drop_last or group_by_length (the order would differ), or when
                the saved global batch cannot be split over this sampler's ranks.
        """
        version = state_dict.get("version")
        if version not in _READABLE_VERSIONS:
            raise ValueError(
                f"cannot resume: the saved sampler state has format version {version!r}; this version of"
                f" lightning-dynamix reads versions {list(_READABLE_VERSIONS)}"
            )
        num_chunks = None if self.layout is None else self.layout.num_chunks
        if state_dict.get("num_chunks") != num_chunks:
            raise ValueError(
                f"cannot resume: the saved sampler read {state_dict.get('num_chunks')!r} chunks (None: a dataset not"
                f" in chunks), this one {num_chunks!r}; resume with the same dataset and chunk_sizes"
            )
        within = None if self.layout is None else self.layout.shuffle_within_chunks
        saved_within = state_dict.get("shuffle_within_chunks", True)
        if num_chunks is not None and saved_within != within:
            raise ValueError(
                f"cannot resume: the saved sampler had shuffle_within_chunks={saved_within!r}, this one {within!r};"
                " the order of the samples would differ. Resume with the same setting."
            )
        for key in ("num_samples", "shuffle", "seed", "drop_last", "group_by_length"):
            if state_dict.get(key) != getattr(self, key):
                raise ValueError(
                    f"cannot resume: the saved sampler has {key}={state_dict.get(key)!r} but this one has"
                    f" {key}={getattr(self, key)!r}; the order of the samples would differ, so some would be"
                    " trained twice and others never. Resume with the same dataset, shuffle, seed, drop_last and"
                    " group_by_length."
                )
        saved_world = int(state_dict["world_size"])
        cut = int(state_dict.get("cut_world_size", saved_world))
        segments = [(int(start), tuple(sizes)) for start, sizes in state_dict["segments"]]
        first_cursor = int(state_dict.get("first_cursor", 0))
        saved = EpochSchedule.from_segments(
            self.num_samples,
            [(segments[0][0], segments[0][1], first_cursor), *segments[1:]],
            drop_last=self.drop_last,
            cut_world_size=cut,
            least_batch_size=self.least_batch_size,
        )
        step = int(state_dict["step"])
        if not saved.first_step <= step <= len(saved):
            raise ValueError(f"saved step {step} lies outside the saved epoch [{saved.first_step}, {len(saved)}]")
        next_sizes = state_dict["next_epoch_batch_sizes"]
        next_epoch = None if next_sizes is None else tuple(int(b) for b in next_sizes)
        if saved_world == self.world_size:
            schedule = saved
        else:
            regroup = split if split is not None else (lambda total: even_split(total, self.world_size))
            try:
                schedule = saved.regrouped(step, regroup, world_size=self.world_size)
                if next_epoch is not None:
                    next_epoch = split_exactly(regroup, sum(next_epoch), self.world_size)
            except ValueError as error:
                raise ValueError(
                    f"cannot resume on {self.world_size} ranks what {saved_world} ranks saved: {error}"
                ) from None
        self.cut_world_size = cut
        self.sampler.set_epoch(int(state_dict["epoch"]))
        self._schedule = schedule
        self._schedule_epoch = self.sampler.epoch
        self._next_epoch_sizes = next_epoch
        self._pass_start = self._produced = step
        self._consumed = 0
        self._pass_started = False
        if self.layout is not None:
            self.layout.set_epoch(self.sampler.epoch, start=state_dict.get("chunk_layout"), at_step=step)
        self._schedule_changed()
        if step == len(schedule):
            self.set_epoch(self.epoch + 1)
