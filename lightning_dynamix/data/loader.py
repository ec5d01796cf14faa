"""A DataLoader that knows which global step each batch it hands out belongs to.

DataLoader workers prefetch: the sampler has produced more batches than training has used.
:class:`HeterogeneousDataLoader` counts the batches it actually hands out, so it can tell
which step (and so which per-rank batch sizes) the batch being trained on has, and it saves a
resumable position: the batches trained on, not the batches prefetched. It implements
``state_dict``/``load_state_dict``, which Lightning's fit loop saves into checkpoints.

With a :class:`~lightning_dynamix.metrics.StepClock` in ``step_clock`` it also times how long
training waited for each batch. With ``read_ahead`` it reads batches ahead of training and hands each
to a function as it is read (``LayerOffloadStrategy`` asks for their embedding rows early); they
count as handed out when training takes them, not when they are read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from lightning_dynamix._compat import IterablePlaceholderSampler
from lightning_dynamix.data.items import ItemCounter, count_of, positions_of
from lightning_dynamix.data.sampler import HeterogeneousBatchSampler
from lightning_dynamix.data.schedule import BatchSizes, check_least_batch_size, validate_batch_sizes
from lightning_dynamix.data.streaming import map_style

if TYPE_CHECKING:
    from lightning_dynamix.metrics.timers import StepClock


class EmptyBatch:
    """The batch a rank gets at a step it sits out (its batch size is 0): no samples, ``len() == 0``.

    :class:`HeterogeneousDataLoader` hands it out instead of calling the collate function on an
    empty list of samples. ``HeterogeneousDDPStrategy`` does not call ``training_step`` with it,
    and under Accelerate :meth:`DynamixAccelerate.sits_out` tells the loop to skip the forward pass.
    """

    __slots__ = ()

    def __len__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EmptyBatch)

    def __hash__(self) -> int:
        return hash(EmptyBatch)

    def __repr__(self) -> str:
        return "EmptyBatch()"


class _CollateOrEmpty:
    """A collate function that gives :class:`EmptyBatch` for no samples (picklable, for worker processes)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> Any:
        if len(samples) == 0:
            return EmptyBatch()
        return self.collate_fn(samples)


class _StepCountingIterator(Iterator[Any]):
    """Wraps a DataLoader iterator and records the step of every batch it returns."""

    def __init__(self, loader: HeterogeneousDataLoader, iterator: Iterator[Any]) -> None:
        self._loader = loader
        self._iterator = iterator

    def __next__(self) -> Any:
        clock = self._loader.step_clock
        if clock is not None:
            clock.data_start()
        batch = next(self._iterator)
        loader = self._loader
        sampler = loader.batch_sampler
        step = sampler._consume()
        if sampler.was_resplit(step):  # produced before a rank ran out of memory and the step was split anew
            batch = loader.batch_at(step)
        loader._record_step(step, batch)
        if clock is not None:
            # only an epoch's final step may differ from the sizes in force (it takes what is left)
            regular = step + 1 < len(sampler) or loader._current_sizes == sampler.nominal_batch_sizes_at(step)
            work, padding = loader._current_work
            clock.data_end(loader._current_sizes[sampler.rank], regular=regular, work=work, padding=padding)
        return batch

    def __len__(self) -> int:
        return len(self._loader)


class HeterogeneousDataLoader(DataLoader):
    """A ``DataLoader`` driven by a :class:`HeterogeneousBatchSampler`.

    At a step where this rank's batch size is 0 it hands out an :class:`EmptyBatch`.

    Args:
        dataset: a map-style dataset.
        batch_sampler: the sampler that decides this rank's batches.
        **kwargs: any other ``DataLoader`` argument except those that select batches
            (``batch_size``, ``shuffle``, ``sampler``, ``drop_last``: torch rejects them).
    """

    batch_sampler: HeterogeneousBatchSampler

    def __init__(self, dataset: Dataset, batch_sampler: HeterogeneousBatchSampler, **kwargs: Any) -> None:
        if not isinstance(batch_sampler, HeterogeneousBatchSampler):
            raise ValueError(f"`batch_sampler` must be a HeterogeneousBatchSampler, got {type(batch_sampler).__name__}")
        collate_fn = kwargs.get("collate_fn") or default_collate
        if not isinstance(collate_fn, _CollateOrEmpty):
            kwargs["collate_fn"] = _CollateOrEmpty(collate_fn)
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        batch_sampler._counts_consumption = True
        self._current_step = -1
        self._current_sizes: BatchSizes = ()
        self.step_clock: StepClock | None = None
        self.read_ahead: tuple[int, Callable[[Any, int], None]] | None = None
        """``(depth, on_read)``: batches are read ``depth`` ahead of training, and ``on_read(batch, ahead)``
        is called as each is read (see :func:`iterate_ahead`); None (default): read as training takes them."""
        self.resume: Callable[[dict[str, Any]], None] | None = None
        """How :meth:`load_state_dict` loads a saved state (a strategy sets its resume policy here:
        the split of a job resumed on another number of ranks); default: the sampler's ``load_state_dict``."""
        self.count_items: ItemCounter | None = None
        """Counts the items of each batch handed out (see :attr:`current_items`); ``None``: none counted."""
        self._current_items: int | None = None
        self._current_work: tuple[int | None, int | None] = (None, None)  # (work, padding) for the step clock

    @classmethod
    def like(cls, dataloader: DataLoader, batch_sampler: HeterogeneousBatchSampler) -> HeterogeneousDataLoader:
        """A loader over ``dataloader``'s dataset with all its settings (workers, collate, pinning) but its batches."""
        kwargs: dict[str, Any] = {
            "num_workers": dataloader.num_workers,
            "collate_fn": dataloader.collate_fn,
            "pin_memory": dataloader.pin_memory,
            "timeout": dataloader.timeout,
            "worker_init_fn": dataloader.worker_init_fn,
            "multiprocessing_context": dataloader.multiprocessing_context,
            "generator": dataloader.generator,
            "persistent_workers": dataloader.persistent_workers,
            "pin_memory_device": dataloader.pin_memory_device,
        }
        if dataloader.num_workers > 0:
            kwargs["prefetch_factor"] = dataloader.prefetch_factor
        if hasattr(dataloader, "in_order"):
            kwargs["in_order"] = dataloader.in_order
        return cls(map_style(dataloader.dataset), batch_sampler=batch_sampler, **kwargs)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._current_step = -1
        batches: Iterator[Any] = super().__iter__()
        if self.read_ahead is not None:  # beneath the counting: a batch read ahead is not handed out yet
            batches = iterate_ahead(batches, *self.read_ahead)
        return _StepCountingIterator(self, batches)

    def batch_at(self, step: int) -> Any:
        """This rank's batch at ``step`` of the current epoch, read in this process (its sizes as they are now)."""
        indices = self.batch_sampler.indices_at(step)
        dataset: Any = self.dataset
        samples = dataset.__getitems__(indices) if hasattr(dataset, "__getitems__") else [dataset[i] for i in indices]
        return self.collate_fn(samples)

    def placeholder_batch(self) -> Any:
        """One sample of the step being trained, read in this process, for a rank that sits the step out but must
        still run the model (FSDP's all-gathers and reduce-scatters): it trains it at weight 0.

        Raises:
            RuntimeError: before the first batch, or where this rank has samples at the step.
        """
        if not self.sits_out:
            raise RuntimeError("a placeholder batch is for a rank that sits the step being trained out")
        index = self.batch_sampler.placeholder_index(self._current_step)
        dataset: Any = self.dataset
        samples = dataset.__getitems__([index]) if hasattr(dataset, "__getitems__") else [dataset[index]]
        return self.collate_fn(samples)

    def resplit_current(self) -> Any:
        """After :meth:`HeterogeneousBatchSampler.resplit` of the step being trained: its batch at the new sizes."""
        step = self._current_step
        if step < 0:
            raise RuntimeError("no batch has been handed out by this DataLoader's current iterator yet")
        batch = self.batch_at(step)
        self._record_step(step, batch)
        return batch

    def _record_step(self, step: int, batch: Any) -> None:
        self._current_step = step
        self._current_sizes = self.batch_sampler.batch_sizes_at(step)
        if self.count_items is not None:
            own = self._current_sizes[self.batch_sampler.rank]
            self._current_items = 0 if own == 0 else count_of(self.count_items, batch, own)
            # a step's work, what its time grows with: the positions computed where the counter knows them
            positions = None if own == 0 else positions_of(self.count_items, batch)
            if positions is not None:
                self._current_work = positions
            else:
                self._current_work = (self._current_items, None)

    @property
    def current_step(self) -> int:
        """The step (within the epoch) of the batch handed out last; -1 before the first one."""
        return self._current_step

    @property
    def sits_out(self) -> bool:
        """Whether this rank's batch size is 0 at :attr:`current_step` (it was handed an :class:`EmptyBatch`)."""
        return self._current_step >= 0 and self._current_sizes[self.batch_sampler.rank] == 0

    @property
    def current_items(self) -> int:
        """This rank's items in the batch handed out last, as :attr:`count_items` counted them (0 where it sits out).

        Raises:
            RuntimeError: without :attr:`count_items`, or before the first batch.
        """
        if self.count_items is None or self._current_items is None or self._current_step < 0:
            raise RuntimeError("no batch's items were counted: set count_items and hand out a batch first")
        return self._current_items

    @property
    def current_batch_sizes(self) -> BatchSizes:
        """Every rank's real batch size at :attr:`current_step`."""
        if self._current_step < 0:
            raise RuntimeError("no batch has been handed out by this DataLoader's current iterator yet")
        return self._current_sizes

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state, positioned after the last batch handed out."""
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iterator continues where training stopped."""
        if self.resume is not None:
            self.resume(state_dict)
        else:
            self.batch_sampler.load_state_dict(state_dict)


def iterate_ahead(batches: Iterable[Any], depth: int, on_read: Callable[[Any, int], None]) -> Iterator[Any]:
    """``batches`` in order, each read ``depth`` batches before it is handed out.

    ``on_read(batch, ahead)`` is called as a batch is read; ``ahead`` is how many batches read before it
    are still to be handed out (the batch trained ``ahead`` steps after the one handed out last).
    """
    read: deque[Any] = deque()
    for batch in batches:
        on_read(batch, len(read))
        read.append(batch)
        if len(read) > depth:
            yield read.popleft()
    while read:
        yield read.popleft()


_PLAIN_SAMPLERS = (SequentialSampler, RandomSampler, DistributedSampler)


def _is_streaming_loader(dataloader: DataLoader) -> bool:
    """LitData's ``StreamingDataLoader``: a DataLoader whose own state and chunk assignment the rebuilt one replaces."""
    cls = type(dataloader)
    return cls.__name__ == "StreamingDataLoader" and cls.__module__.startswith("litdata.")


def new_sampler_for(
    dataloader: DataLoader,
    batch_sizes: Sequence[int] | None,
    *,
    rank: int,
    world_size: int,
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    least_batch_size: int = 1,
    group_by_length: int | None = None,
    owner: str,
    instead: str,
) -> HeterogeneousBatchSampler:
    """A :class:`HeterogeneousBatchSampler` over a plain ``DataLoader``'s dataset, for rank ``rank``.

    ``batch_sizes=None`` gives every rank the DataLoader's ``batch_size``; the DataLoader's own
    ``drop_last`` is honoured; a size between 0 and ``least_batch_size`` is refused. The DataLoader
    must be a plain torch ``DataLoader`` over a map-style
    dataset with the default samplers, whose order the global schedule replaces.

    Raises:
        ValueError: naming ``owner`` (who rebuilds the DataLoader) and ending with ``instead`` (what
            to do instead), for anything else, for sizes that are not valid, or for a dataset smaller
            than one global batch.
    """
    dataset = map_style(dataloader.dataset, owner)
    if type(dataloader) is not DataLoader and not _is_streaming_loader(dataloader):
        raise ValueError(
            f"The training DataLoader is a {type(dataloader).__name__}; {owner} rebuilds plain torch"
            f" DataLoaders (and LitData's StreamingDataLoader) only. {instead}"
        )
    # over an iterable-style dataset torch's sampler is a placeholder that yields nothing but None
    plain = (*_PLAIN_SAMPLERS, IterablePlaceholderSampler) if dataset is not dataloader.dataset else _PLAIN_SAMPLERS
    if type(dataloader.batch_sampler) is not BatchSampler or type(dataloader.sampler) not in plain:
        raise ValueError(
            "The training DataLoader has a custom sampler or batch sampler"
            f" ({type(dataloader.sampler).__name__}, {type(dataloader.batch_sampler).__name__}). {owner} draws"
            f" training batches from one global shuffled order and would discard it. {instead}"
        )
    argument = "batch_sizes"
    if batch_sizes is None:
        if dataloader.batch_size is None:
            raise ValueError(f"Pass `batch_sizes` to {owner} or give the training DataLoader a batch_size.")
        batch_sizes = [dataloader.batch_size] * world_size
        argument = "DataLoader(batch_size) on every rank"
    sizes = validate_batch_sizes(
        batch_sizes,
        world_size=world_size,
        argument=argument,
        min_batch_size=min_batch_size,
        max_batch_size=max_batch_size,
    )
    check_least_batch_size(sizes, least_batch_size, argument)
    return HeterogeneousBatchSampler(
        dataset,  # type: ignore[arg-type]
        sizes,
        rank=rank,
        world_size=world_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last or dataloader.drop_last,
        least_batch_size=least_batch_size,
        group_by_length=group_by_length,
    )
