"""Streaming datasets that can be indexed, read through the global schedule like map-style data.

LitData's and MosaicML's ``StreamingDataset`` are ``IterableDataset`` subclasses whose own iteration gives every
rank an equal share, but both also index their samples (``dataset[i]``) and know how many there are. A
:class:`StreamingView` exposes exactly that as a map-style dataset, so
:class:`~lightning_dynamix.data.sampler.HeterogeneousBatchSampler` cuts it into per-rank batches that change at
any step, every sample once per epoch, resumable on another world size; with the dataset's chunk sizes (read
from it by :func:`chunk_sizes_of`) each rank reads whole chunks of its own
(:class:`~lightning_dynamix.data.chunks.ChunkLayout`). Neither library is imported here: a dataset is recognised
by what it offers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils.data import Dataset, IterableDataset

from lightning_dynamix.data.chunks import validate_chunk_sizes


def can_index(dataset: object) -> bool:
    """Whether ``dataset`` has a length and its own ``__getitem__`` (torch's ``Dataset`` base only raises)."""
    getitem = getattr(type(dataset), "__getitem__", None)
    return hasattr(dataset, "__len__") and getitem is not None and getitem is not Dataset.__getitem__


def total_length(dataset: Any) -> int:
    """Every sample of ``dataset``, whichever rank asks: in a distributed job LitData's and MosaicML's ``len()`` is
    this rank's equal share, their ``__getitem__`` takes an index of the whole dataset.

    LitData: the sum of its chunks' ``region_of_interest``; MosaicML: ``num_samples``; any other: ``len()``.
    """
    regions = _regions(dataset)
    if regions is not None:
        return sum(regions)
    total = getattr(dataset, "num_samples", None)
    if getattr(dataset, "samples_per_shard", None) is not None and isinstance(total, int):
        return total
    return len(dataset)


def _regions(dataset: Any) -> tuple[int, ...] | None:
    """LitData's chunk sizes: each chunk file's ``(start, end)`` in the dataset's order, after any subsampling."""
    regions = getattr(dataset, "region_of_interest", None)
    if isinstance(regions, Sequence) and regions and all(isinstance(r, Sequence) and len(r) == 2 for r in regions):
        return tuple(int(end) - int(start) for start, end in regions)
    return None


def chunk_sizes_of(dataset: object) -> tuple[int, ...] | None:
    """Samples per chunk of a streaming dataset, in its index order; ``None`` for a dataset not stored in chunks.

    Reads a :class:`StreamingView`'s ``chunk_sizes``, LitData's ``region_of_interest`` (each chunk file's
    ``(start, end)`` in the dataset's order, after any subsampling) and MosaicML's ``samples_per_shard``.
    """
    if isinstance(dataset, StreamingView):
        return dataset.chunk_sizes
    regions = _regions(dataset)
    if regions is not None:
        return regions
    shards = getattr(dataset, "samples_per_shard", None)
    if shards is not None and hasattr(shards, "__len__") and len(shards) > 0:
        return tuple(int(n) for n in shards)
    return None


def map_style(dataset: Any, owner: str = "lightning-dynamix") -> Any:
    """``dataset`` itself where it is map-style, a :class:`StreamingView` of it where it is iterable-style but can
    be indexed (LitData's, MosaicML's ``StreamingDataset``).

    Raises:
        ValueError: naming ``owner`` and the dataset, for an iterable-style dataset that cannot be indexed.
    """
    if not isinstance(dataset, IterableDataset) or isinstance(dataset, StreamingView):
        return dataset
    if can_index(dataset):
        return StreamingView(dataset)
    raise ValueError(
        f"The training dataset is iterable-style ({type(dataset).__name__}) and cannot be indexed; {owner} needs a"
        " map-style dataset (with __len__ and __getitem__), or a streaming dataset that can be indexed (LitData's"
        " or MosaicML's StreamingDataset), to give ranks different batch sizes."
    )


class StreamingView(Dataset):
    """A map-style view of a dataset that can be indexed but is iterable-style (a streaming dataset).

    Args:
        dataset: anything with ``__len__`` and ``__getitem__``: LitData's or MosaicML's ``StreamingDataset``
            (read from a local directory or a remote one, as the library does), or your own.
        chunk_sizes: samples per chunk in the dataset's index order; default: read from the dataset
            (:func:`chunk_sizes_of`), ``None`` where it is not stored in chunks.
        shuffle_within_chunks: read each chunk's samples in a new order every epoch (default); ``False``: in the
            chunk's own order, only which chunk a rank reads when being drawn: LitData reads a sample in about 9 us
            so against 148 us shuffled (docs/benchmarks/streaming.md), but a chunk's samples always follow each
            other. A sampler over the view follows it (:class:`~lightning_dynamix.data.chunks.ChunkLayout`).

    Raises:
        ValueError: naming the dataset, for one that cannot be indexed (use a plain iterable dataset's shards
            instead), that is empty, or whose chunk sizes do not sum to its length.
    """

    def __init__(
        self, dataset: Any, chunk_sizes: Sequence[int] | None = None, *, shuffle_within_chunks: bool = True
    ) -> None:
        name = type(dataset).__name__
        if isinstance(dataset, StreamingView):
            raise ValueError("`dataset` is already a StreamingView; pass it to the sampler as it is")
        if not can_index(dataset):
            raise ValueError(
                f"`dataset` ({name}) has no length or cannot be indexed (no __getitem__): a map-style view needs"
                " both; read a plain iterable dataset by its shards instead"
            )
        length = total_length(dataset)
        if length < 1:
            raise ValueError(f"`dataset` ({name}) holds no samples")
        self.dataset = dataset
        self._length = length
        if not isinstance(shuffle_within_chunks, bool):
            raise ValueError(f"`shuffle_within_chunks` must be True or False, got {shuffle_within_chunks!r}")
        self.shuffle_within_chunks = shuffle_within_chunks
        if chunk_sizes is None:
            found = chunk_sizes_of(dataset)
            self.chunk_sizes = None if found is None else validate_chunk_sizes(found, length, f"{name}'s chunks")
        else:
            self.chunk_sizes = validate_chunk_sizes(chunk_sizes, length)

    def __len__(self) -> int:
        """All the dataset's samples (not one rank's share)."""
        return self._length

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __repr__(self) -> str:
        chunks = "not in chunks" if self.chunk_sizes is None else f"{len(self.chunk_sizes)} chunks"
        return f"StreamingView({type(self.dataset).__name__}, {len(self)} samples, {chunks})"
