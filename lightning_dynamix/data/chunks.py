"""Which samples each rank takes when the dataset is stored in chunks: every rank reads whole chunks of its own.

Streaming datasets (LitData's and MosaicML's ``StreamingDataset``) store samples in chunk files, the unit a rank
downloads, caches and decodes. The global schedule (:class:`~lightning_dynamix.data.schedule.EpochSchedule`)
decides every rank's batch size at every step; a :class:`ChunkLayout` decides which samples fill them, so that a
rank reads one chunk to its end before it opens another, whatever its size at each step:

- the epoch's chunks are drawn in an order seeded with ``seed + epoch`` (and each chunk's samples too), and
  handed out one at a time as ranks use up the chunk they hold, in rank order within a step, so a rank that takes
  more samples per step opens more chunks;
- once no chunk is left, a rank that needs samples takes them from the end of the chunk of the rank holding the
  most (lower rank first on ties);
- every rank computes the whole step for every rank, from the same sizes, so all ranks agree on it without
  exchanging anything, and every sample is taken exactly once per epoch.

A resumed job continues from :meth:`ChunkLayout.state_at`: the chunk pieces the saved ranks held, then the
epoch's chunks not yet handed out, on any number of ranks.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from lightning_dynamix.data.schedule import BatchSizes, EpochSchedule

_SEED_STRIDE = 1_000_003  # the seeds of one epoch's chunk orders: (seed + epoch) * stride + chunk


def validate_chunk_sizes(chunk_sizes: object, num_samples: int | None = None, argument: str = "chunk_sizes") -> tuple:
    """Check the samples per chunk (in the dataset's index order) and return them as a tuple of ints.

    Raises:
        ValueError: naming ``argument``, for anything but a non-empty sequence of ints >= 1, or sizes that do not
            sum to ``num_samples``.
    """
    if isinstance(chunk_sizes, (str, bytes)) or not isinstance(chunk_sizes, Sequence) or not chunk_sizes:
        raise ValueError(f"`{argument}` must be a non-empty list of ints (samples per chunk), got {chunk_sizes!r}")
    sizes = tuple(chunk_sizes)
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
    if bad:
        raise ValueError(f"`{argument}` must hold ints >= 1 (samples per chunk), got {bad[0]!r}")
    if num_samples is not None and sum(sizes) != num_samples:
        raise ValueError(
            f"`{argument}` sum to {sum(sizes)} samples, but the dataset has {num_samples}: give every chunk's"
            " sample count, in the dataset's index order"
        )
    return sizes


class ChunkLayout:
    """Every rank's samples at every step, each rank reading whole chunks (see the module docstring).

    Args:
        chunk_sizes: samples per chunk; chunk ``c`` holds indices ``[sum(chunk_sizes[:c]), sum(chunk_sizes[:c+1]))``.
        shuffle: draw the chunks and each chunk's samples in a new order every epoch; else the dataset's order.
        seed: base seed of the orders, the same on every rank.
        shuffle_within_chunks: with ``shuffle``, each chunk's samples in a new order too; ``False``: in the chunk's
            own order (only which chunk comes when is drawn), which a streaming library reads far faster (LitData:
            9 against 148 us a sample) at the cost of samples of one chunk always following each other.
    """

    def __init__(
        self, chunk_sizes: Sequence[int], *, shuffle: bool = True, seed: int = 0, shuffle_within_chunks: bool = True
    ) -> None:
        self.chunk_sizes = validate_chunk_sizes(chunk_sizes)
        self.num_samples = sum(self.chunk_sizes)
        self.shuffle = bool(shuffle)
        self.shuffle_within_chunks = bool(shuffle_within_chunks)
        self.seed = int(seed)
        self._starts = list(itertools.accumulate(self.chunk_sizes, initial=0))
        self._epoch = 0
        self._start: dict[str, Any] | None = None  # the queues at `_first_step` (a resume); None: the epoch's start
        self._first_step = 0
        self._cache: dict[int, tuple[list[int], ...]] = {}
        self._replay: _Replay | None = None
        self._recut: dict[int, BatchSizes] = {}  # steps split anew after they were produced: the sizes they took at

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_sizes)

    def chunk_of(self, index: int) -> int:
        """The chunk that holds sample ``index``."""
        return bisect.bisect_right(self._starts, index) - 1

    # ------------------------------------------------------------------ epochs and resumes
    def set_epoch(self, epoch: int, start: dict[str, Any] | None = None, at_step: int = 0) -> None:
        """Follow ``epoch`` from its first step, or from ``start`` (:meth:`state_at` of a saved job) at ``at_step``."""
        self._epoch = int(epoch)
        self._start = None if start is None else _checked_start(start, self.num_samples, self.num_chunks)
        self._first_step = int(at_step) if start is not None else 0
        self._cache = {}
        self._replay = None
        self._recut = {}

    def resplit(self, from_step: int, produced: dict[int, BatchSizes]) -> None:
        """Steps from ``from_step`` on are split anew: those already produced (``produced``: each one's sizes as it
        was produced) keep their samples, cut again in rank order at the new sizes; later ones take at the new
        sizes."""
        for step, sizes in produced.items():
            self._recut.setdefault(step, sizes)
        self._cache = {s: v for s, v in self._cache.items() if s < from_step}
        if self._replay is not None and self._replay.step > from_step:
            self._replay = None

    def chunk_order(self) -> list[int]:
        """The order in which this epoch hands out its chunks."""
        if not self.shuffle:
            return list(range(self.num_chunks))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self._epoch)
        return torch.randperm(self.num_chunks, generator=generator).tolist()

    def chunk_samples(self, chunk: int) -> list[int]:
        """Chunk ``chunk``'s samples in the order this epoch reads them."""
        start, stop = self._starts[chunk], self._starts[chunk + 1]
        if not (self.shuffle and self.shuffle_within_chunks):
            return list(range(start, stop))
        generator = torch.Generator()
        generator.manual_seed((self.seed + self._epoch) * _SEED_STRIDE + chunk)
        return (torch.randperm(stop - start, generator=generator) + start).tolist()

    # ------------------------------------------------------------------ steps
    def step(self, schedule: EpochSchedule, step: int) -> tuple[list[int], ...]:
        """Every rank's sample indices at ``step`` of the epoch ``schedule`` cuts (computed from its first step)."""
        cached = self._cache.get(step)
        if cached is not None:
            return cached
        replay = self._replay_to(schedule, step)
        taken = self._take(replay, schedule, step)
        self._cache[step] = taken
        return taken

    def _take(self, replay: _Replay, schedule: EpochSchedule, step: int) -> tuple[list[int], ...]:
        sizes = schedule.batch_sizes_at(step)
        took = self._recut.get(step)
        if took is None:
            return replay.take(sizes)
        samples = [i for indices in replay.take(took) for i in indices]  # the samples it was produced with
        cuts = list(itertools.accumulate(sizes, initial=0))
        return tuple(samples[a:b] for a, b in itertools.pairwise(cuts))

    def state_at(self, schedule: EpochSchedule, step: int) -> dict[str, Any]:
        """What a job resumed at ``step`` continues from: the piece of a chunk each rank holds, the pieces not handed
        out yet, then the epoch's chunks from ``next_chunk`` on.

        JSON-able: ``{"held": [[index, ...] per rank], "pieces": [[index, ...], ...], "next_chunk": int}``. Resumed on
        as many ranks, each rank keeps its piece (the rest of the epoch is the uninterrupted job's); on another
        number, the held pieces are handed out first.
        """
        replay = self._replay_to(schedule, step)
        return {
            "held": [queue[head:] for queue, head in zip(replay.queues, replay.heads)],
            "pieces": [list(piece) for piece in replay.saved_pieces],
            "next_chunk": replay.next_chunk,
        }

    def _replay_to(self, schedule: EpochSchedule, step: int) -> _Replay:
        """The queues before ``step``, replayed from the epoch's first step or the resume (or continued)."""
        first = self._first_step
        if not first <= step <= len(schedule):
            raise ValueError(
                f"`step` must lie in [{first}, {len(schedule)}] (the epoch's steps since it started or resumed),"
                f" got {step}"
            )
        replay = self._replay
        if replay is None or replay.step > step:
            replay = _Replay(self, schedule.world_size, first, self._start)
        while replay.step < step:
            at = replay.step
            self._cache.setdefault(at, self._take(replay, schedule, at))
        self._replay = replay
        return replay


def _checked_start(start: dict[str, Any], num_samples: int, num_chunks: int) -> dict[str, Any]:
    try:
        held = [[int(i) for i in piece] for piece in start["held"]]
        pieces = [[int(i) for i in piece] for piece in start["pieces"]]
        next_chunk = int(start["next_chunk"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"a chunk layout state holds 'held', 'pieces' and 'next_chunk', got {start!r}") from None
    if not 0 <= next_chunk <= num_chunks or any(not 0 <= i < num_samples for piece in held + pieces for i in piece):
        raise ValueError(
            f"the saved chunk layout does not fit this dataset ({num_samples} samples in {num_chunks} chunks)"
        )
    return {"held": held, "pieces": pieces, "next_chunk": next_chunk}


class _Replay:
    """The chunk queues of one epoch, step after step."""

    def __init__(self, layout: ChunkLayout, world_size: int, first_step: int, start: dict[str, Any] | None) -> None:
        self.layout = layout
        self.first_step = first_step
        self.step = first_step
        self.order = layout.chunk_order()
        self.next_chunk = 0 if start is None else start["next_chunk"]
        self.saved_pieces = [] if start is None else [list(p) for p in start["pieces"]]  # handed out before chunks
        self.queues: list[list[int]] = [[] for _ in range(world_size)]  # each rank's piece, read from its front
        self.heads = [0] * world_size
        held = [] if start is None else [list(p) for p in start["held"]]
        if len(held) == world_size:  # as many ranks: each keeps its piece
            self.queues = held
        else:  # another number: the pieces the saved ranks held go first
            self.saved_pieces = [p for p in held if p] + self.saved_pieces

    def _next_piece(self) -> list[int] | None:
        if self.saved_pieces:
            return self.saved_pieces.pop(0)
        if self.next_chunk < len(self.order):
            chunk = self.order[self.next_chunk]
            self.next_chunk += 1
            return self.layout.chunk_samples(chunk)
        return None

    def take(self, sizes: BatchSizes) -> tuple[list[int], ...]:
        if len(sizes) != len(self.queues):
            raise ValueError(f"the schedule has {len(sizes)} ranks at step {self.step}, the layout {len(self.queues)}")
        taken: list[list[int]] = []
        for rank, need in enumerate(sizes):
            mine: list[int] = []
            while need > 0:
                left = len(self.queues[rank]) - self.heads[rank]
                if left == 0:
                    piece = self._next_piece()
                    if piece is not None:
                        self.queues[rank], self.heads[rank] = piece, 0
                        continue
                    donor = max(range(len(self.queues)), key=lambda r: (len(self.queues[r]) - self.heads[r], -r))
                    spare = len(self.queues[donor]) - self.heads[donor]
                    if spare == 0:
                        raise ValueError(
                            f"step {self.step} asks for more samples than the epoch has left (sizes {list(sizes)})"
                        )
                    grab = min(need, spare)
                    mine.extend(self.queues[donor][len(self.queues[donor]) - grab :])
                    del self.queues[donor][len(self.queues[donor]) - grab :]
                    need -= grab
                    continue
                grab = min(need, left)
                head = self.heads[rank]
                mine.extend(self.queues[rank][head : head + grab])
                self.heads[rank] = head + grab
                need -= grab
            taken.append(mine)
        self.step += 1
        return tuple(taken)
