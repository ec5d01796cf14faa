"""How one epoch of a dataset is cut into global steps of per-rank batches.

An :class:`EpochSchedule` is pure arithmetic over sample counts: it knows nothing of indices,
ranks' data or torch. Every rank builds the same schedule from the same inputs, so all ranks
agree on the number of steps in an epoch and on every rank's batch size at every step.

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/data/schedule.py``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BatchSizes = tuple[int, ...]


def validate_batch_sizes(
    batch_sizes: object,
    *,
    world_size: int | None = None,
    argument: str = "batch_sizes",
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
) -> BatchSizes:
    """Check per-rank batch sizes and return them as a tuple of ints.

    A size of 0 (a rank that sits the step out) is valid only with ``min_batch_size=0``, and at
    least one rank must train.

    Raises:
        ValueError: naming ``argument``, the value and what is valid, when the sizes are not a
            sequence of ints >= 0, their count is not ``world_size``, a size lies outside
            ``[min_batch_size, max_batch_size]`` or every size is 0.
    """
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence):
        raise ValueError(f"`{argument}` must be a list with one int per rank (samples per step), got {batch_sizes!r}.")
    sizes = tuple(batch_sizes)
    if not sizes:
        raise ValueError(f"`{argument}` must hold one int per rank (samples per step), got an empty list.")
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 0]
    if bad:
        raise ValueError(
            f"`{argument}` must hold ints >= 0 (samples per rank per step), got {list(sizes)!r}:"
            f" {bad[0]!r} is not an int >= 0."
        )
    if world_size is not None and len(sizes) != world_size:
        raise ValueError(
            f"`{argument}` must hold one size per rank: the world size is {world_size},"
            f" got {len(sizes)} sizes {list(sizes)!r}."
        )
    out_of_bounds = [s for s in sizes if s < min_batch_size or (max_batch_size is not None and s > max_batch_size)]
    if out_of_bounds:
        upper = "inf" if max_batch_size is None else str(max_batch_size)
        hint = " (min_batch_size=0 lets a rank sit steps out)" if min_batch_size > 0 and min(sizes) == 0 else ""
        raise ValueError(
            f"`{argument}` must lie within [min_batch_size, max_batch_size] = [{min_batch_size}, {upper}],"
            f" got {list(sizes)!r}{hint}."
        )
    if sum(sizes) == 0:
        raise ValueError(f"`{argument}` gives every rank 0 samples, got {list(sizes)!r}: at least one rank must train.")
    return sizes


def split_exactly(split: Callable[[int], Sequence[int]], total: int, world_size: int | None = None) -> BatchSizes:
    """``split(total)``, checked: ints >= 0 (``world_size`` of them, when given) that sum to ``total``.

    Raises:
        ValueError: naming what ``split`` gave and what was expected.
    """
    sizes = validate_batch_sizes(split(total), world_size=world_size, argument=f"split({total})", min_batch_size=0)
    if sum(sizes) != total:
        raise ValueError(f"`split({total})` gave {list(sizes)}, which does not sum to {total}")
    return sizes


def final_step_sizes(batch_sizes: BatchSizes, remaining: int, least_batch_size: int = 1) -> BatchSizes:
    """Per-rank sizes of the last step of an epoch that takes all ``remaining`` samples.

    Ranks with size 0 sit this step out too. ``remaining`` must be at least ``least_batch_size`` per
    rank that trains (every size > 0 is at least that); past ``sum(batch_sizes)`` the extra samples go
    one each to the largest sizes, round after round.
    """
    training = [r for r, b in enumerate(batch_sizes) if b > 0]
    total = sum(batch_sizes)
    least = least_batch_size
    if remaining < least * len(training):
        raise ValueError(
            f"a final step must hold at least {least * len(training)} samples ({least} per rank that trains),"
            f" got {remaining}"
        )
    if remaining >= total:
        rounds, extra = divmod(remaining - total, len(training))
        # one extra sample each to the ranks with the largest sizes, lower rank first on ties
        order = sorted(training, key=lambda r: (-batch_sizes[r], r))
        sizes = [b + rounds if b > 0 else 0 for b in batch_sizes]
        for r in order[:extra]:
            sizes[r] += 1
        return tuple(sizes)
    # a short tail: `least` samples each, the rest in proportion to b_r - least (so no rank exceeds b_r)
    rest = remaining - least * len(training)
    weights = [max(b - least, 0) if b > 0 else 0 for b in batch_sizes]
    weight_sum = total - least * len(training)  # > 0 here, since remaining < total
    shares = [rest * w // weight_sum for w in weights]
    fractions = [rest * w % weight_sum for w in weights]
    leftover = rest - sum(shares)
    order = sorted(training, key=lambda r: (-fractions[r], r))
    for r in order[:leftover]:
        shares[r] += 1
    return tuple(least + s if b > 0 else 0 for s, b in zip(shares, batch_sizes, strict=True))


def check_least_batch_size(
    sizes: Sequence[int], least_batch_size: int, argument: str = "batch_sizes", reason: str | None = None
) -> None:
    """Refuse a size between 0 and ``least_batch_size`` (a rank that trains gets at least that many samples).

    Raises:
        ValueError: naming ``argument``, the sizes, the least size and ``reason`` (why the model needs it).
    """
    if isinstance(least_batch_size, bool) or not isinstance(least_batch_size, int) or least_batch_size < 1:
        raise ValueError(f"`least_batch_size` must be an int >= 1 (samples), got {least_batch_size!r}")
    if any(0 < b < least_batch_size for b in sizes):
        why = f": {reason}" if reason else ""
        raise ValueError(
            f"`{argument}` must give every rank that trains at least {least_batch_size} samples (or 0 to sit the"
            f" step out, with min_batch_size=0), got {list(sizes)!r}{why}."
        )


@dataclass(frozen=True)
class _Segment:
    """Steps from ``start_step`` on use ``batch_sizes``; step ``start_step`` begins at ``start_cursor``."""

    start_step: int
    batch_sizes: BatchSizes
    total: int
    start_cursor: int


class EpochSchedule:
    """The global cut of one epoch of ``num_samples`` samples into steps of per-rank batches.

    Sizes can change from any step that has not been handed out yet (:meth:`change`); steps
    before it keep their sizes and positions. All queries are O(log number of changes).

    Args:
        num_samples: samples in the epoch.
        batch_sizes: every rank's size from step 0.
        drop_last: skip the incomplete last step instead of spreading it.
        cut_world_size: the world size whose cut of the epoch this schedule keeps (see the module
            docstring); default: this schedule's own world size.
        least_batch_size: the fewest samples a rank that trains gets, the final step included (a model
            with BatchNorm needs 2); every size > 0 must be at least this.
    """

    def __init__(
        self,
        num_samples: int,
        batch_sizes: BatchSizes,
        *,
        drop_last: bool = False,
        cut_world_size: int | None = None,
        least_batch_size: int = 1,
    ) -> None:
        sizes = validate_batch_sizes(batch_sizes, min_batch_size=0)
        check_least_batch_size(sizes, least_batch_size)
        if num_samples < sum(sizes):
            raise ValueError(
                f"the dataset ({num_samples} samples) is smaller than one global batch"
                f" (sum of batch_sizes {list(sizes)} = {sum(sizes)}); use smaller batch sizes or more data."
            )
        self.num_samples = num_samples
        self.world_size = len(sizes)
        self.drop_last = drop_last
        self.cut_world_size = self.world_size if cut_world_size is None else cut_world_size
        self.least_batch_size = least_batch_size
        # the fewest samples the final step holds: every rank gets `least`, and the cut stays the original job's
        self.reserve = max(self.world_size, self.cut_world_size) * least_batch_size
        self._segments: list[_Segment] = [_Segment(0, sizes, sum(sizes), 0)]
        self._starts: list[int] = [0]
        self._length: int | None = None

    @classmethod
    def from_segments(
        cls,
        num_samples: int,
        segments: Sequence[tuple[int, Sequence[int]] | tuple[int, Sequence[int], int]],
        *,
        drop_last: bool = False,
        cut_world_size: int | None = None,
        least_batch_size: int = 1,
    ) -> EpochSchedule:
        """Rebuild a schedule from its :attr:`segments` (as saved in a state dict).

        Segments are ``(start_step, batch_sizes)`` from step 0, or ``(start_step, batch_sizes,
        start_cursor)`` for a schedule that begins part-way through the epoch (the first segment's
        cursor says where; the later ones follow from it).
        """
        if not segments:
            raise ValueError("a schedule needs at least one segment")
        first = segments[0]
        start_cursor = int(first[2]) if len(first) > 2 else 0  # type: ignore[misc]
        if (int(first[0]) == 0) != (start_cursor == 0) or start_cursor < 0:
            raise ValueError(f"a schedule's first segment must start at step 0 or give its cursor, got {first!r}")
        schedule = cls(
            num_samples,
            tuple(first[1]),
            drop_last=drop_last,
            cut_world_size=cut_world_size,
            least_batch_size=least_batch_size,
        )
        schedule._begin_at(int(first[0]), start_cursor)
        for segment in segments[1:]:
            start, sizes = int(segment[0]), tuple(segment[1])
            if start <= schedule._segments[-1].start_step or not schedule.change(start, sizes):
                raise ValueError(f"a size change at step {start} is out of order or lies past the end of the epoch")
        return schedule

    def _begin_at(self, start_step: int, start_cursor: int) -> None:
        """Make the first segment begin at ``start_step`` and position ``start_cursor`` (earlier steps are history)."""
        if start_cursor > self.num_samples:
            raise ValueError(f"a schedule cannot begin at position {start_cursor} of a {self.num_samples}-sample epoch")
        seg = self._segments[0]
        self._segments = [_Segment(start_step, seg.batch_sizes, seg.total, start_cursor)]
        self._starts = [start_step]
        self._length = None

    @property
    def first_step(self) -> int:
        """The first step this schedule knows: 0, or where a regrouped schedule begins."""
        return self._segments[0].start_step

    @property
    def segments(self) -> list[tuple[int, BatchSizes]]:
        """``(start_step, batch_sizes)`` of every size change in this epoch, the first at :attr:`first_step`."""
        return [(s.start_step, s.batch_sizes) for s in self._segments]

    @property
    def first_cursor(self) -> int:
        """The position in the epoch's order where :attr:`first_step` begins."""
        return self._segments[0].start_cursor

    def regrouped(
        self,
        from_step: int,
        split: Callable[[int], Sequence[int]],
        *,
        world_size: int | None = None,
        cut_world_size: int | None = None,
    ) -> EpochSchedule:
        """This epoch from ``from_step`` on, split over another number of ranks.

        Every step keeps its place in the epoch and its global batch (``split(total)`` gives the
        new ranks' sizes of each segment's total), so the new ranks train exactly the global
        batches these ranks would have. ``cut_world_size`` (default: this schedule's) keeps the
        epoch's end where it was (see the module docstring).

        Raises:
            ValueError: when ``from_step`` lies outside the epoch, or ``split`` gives sizes that
                are not ints >= 0, not ``world_size`` of them (when given), or do not sum to the
                segment's total.
        """
        if not self.first_step <= from_step <= len(self):
            raise ValueError(f"`from_step` must lie in [{self.first_step}, {len(self)}], got {from_step}")
        cut = self.cut_world_size if cut_world_size is None else cut_world_size
        first = bisect.bisect_right(self._starts, from_step) - 1  # the segment in force at from_step
        # at the epoch's end nothing is left: an empty remainder that ends there
        cursor = self.num_samples if from_step == len(self) else self._locate(from_step)[1]
        schedule: EpochSchedule | None = None
        for seg in self._segments[first:]:
            sizes = split_exactly(split, seg.total, world_size)
            if schedule is None:
                schedule = EpochSchedule(
                    self.num_samples,
                    sizes,
                    drop_last=self.drop_last,
                    cut_world_size=cut,
                    least_batch_size=self.least_batch_size,
                )
                schedule._begin_at(from_step, cursor)
            else:
                schedule.change(seg.start_step, sizes)
        assert schedule is not None  # a schedule always has a segment in force
        left = self.num_samples - cursor
        least = self.least_batch_size
        if not self.drop_last and 0 < left < schedule.world_size * least:
            raise ValueError(
                f"the epoch has {left} samples left at step {from_step}, fewer than the {schedule.world_size} new"
                f" ranks need: every rank must train at least {least} sample{'s' if least > 1 else ''} per step."
                f" Resume this epoch on at most {left // least} ranks, or from a checkpoint taken at another step."
            )
        return schedule

    @property
    def latest_batch_sizes(self) -> BatchSizes:
        """The sizes of the last change: what the following epoch starts with."""
        return self._segments[-1].batch_sizes

    def __len__(self) -> int:
        if self._length is None:
            self._length = self._compute_length()
        return self._length

    def _full_steps(self, cursor: int, total: int) -> int:
        """How many steps of ``total`` samples fit from ``cursor`` before the epoch's last step."""
        left = self.num_samples - cursor
        if self.drop_last:
            return left // total
        # a full step must leave at least `reserve` samples for the final step
        return max(0, (left - self.reserve) // total)

    def _compute_length(self) -> int:
        for i, seg in enumerate(self._segments):
            full = self._full_steps(seg.start_cursor, seg.total)
            if i + 1 < len(self._segments) and self._segments[i + 1].start_step <= seg.start_step + full:
                continue  # the next change begins before this segment runs out of data
            ends_here = self.drop_last or seg.start_cursor + full * seg.total >= self.num_samples
            return seg.start_step + full + (0 if ends_here else 1)
        raise AssertionError("unreachable: the last segment always ends the epoch")

    def _locate(self, step: int) -> tuple[_Segment, int]:
        if not self.first_step <= step < len(self):
            raise IndexError(f"step {step} is outside this epoch's steps [{self.first_step}, {len(self)})")
        seg = self._segments[bisect.bisect_right(self._starts, step) - 1]
        return seg, seg.start_cursor + (step - seg.start_step) * seg.total

    def batch_sizes_at(self, step: int) -> BatchSizes:
        """Every rank's real batch size at ``step``, the epoch's final step included."""
        return self.step_at(step)[1]

    def nominal_batch_sizes_at(self, step: int) -> BatchSizes:
        """The sizes in force at ``step``: what :meth:`change` set, even where the final step adjusts them."""
        return self._locate(step)[0].batch_sizes

    def step_at(self, step: int) -> tuple[int, BatchSizes]:
        """``(cursor, batch_sizes)`` of ``step``: where it begins and every rank's size."""
        seg, cursor = self._locate(step)
        remaining = self.num_samples - cursor
        if self.drop_last or remaining >= seg.total + self.reserve:
            return cursor, seg.batch_sizes
        return cursor, final_step_sizes(seg.batch_sizes, remaining, self.least_batch_size)

    def change(self, from_step: int, batch_sizes: BatchSizes) -> bool:
        """Use ``batch_sizes`` from ``from_step`` on; later changes already scheduled are dropped.

        Returns False, changing nothing, when ``from_step`` is at or past the end of this epoch.
        """
        sizes = validate_batch_sizes(batch_sizes, world_size=self.world_size, min_batch_size=0)
        check_least_batch_size(sizes, self.least_batch_size)
        if from_step < self.first_step:
            raise ValueError(f"`from_step` must be >= {self.first_step}, got {from_step}")
        if sum(sizes) > self.num_samples:
            raise ValueError(
                f"`batch_sizes` {list(sizes)} sum to {sum(sizes)}, more than the dataset's"
                f" {self.num_samples} samples; the global batch must fit in the dataset."
            )
        if from_step >= len(self):
            return False
        cursor = self._locate(from_step)[1]
        keep = bisect.bisect_left(self._starts, from_step)
        del self._segments[keep:]
        del self._starts[keep:]
        if not self._segments or self._segments[-1].batch_sizes != sizes:
            self._segments.append(_Segment(from_step, sizes, sum(sizes), cursor))
            self._starts.append(from_step)
        self._length = None
        return True
