"""Splitting a global batch over ranks within per-rank bounds: the arithmetic every controller shares.

A controller decides shares (or speeds); these functions turn them into integer batch sizes that
sum exactly to the global batch and respect every rank's bounds, and check the bound arguments.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

from lightning_dynamix.metrics.state import ClusterState, WorkerMetrics

BoundArg = int | Sequence[int] | None


def per_rank_bounds(value: BoundArg, world_size: int, name: str, default: int | None) -> list[int | None]:
    """Expand a bound given once for all ranks, or once per rank, to a list of ``world_size``."""
    if value is None:
        return [default] * world_size
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * world_size
    values = list(value)
    if len(values) != world_size:
        raise ValueError(f"`{name}` has {len(values)} entries but the job has {world_size} ranks")
    return values


def resolve_bounds(
    state: ClusterState, min_batch_size: BoundArg = None, max_batch_size: BoundArg = None
) -> tuple[list[int], list[int | None]]:
    """Per-rank ``[lower, upper]`` sizes (samples) from a controller's bounds and the state's.

    Each rank's range is the intersection of the controller's bound (one int for all ranks or one
    per rank; ``None``: no bound of its own) with ``state.min_batch_size`` / ``state.max_batch_size``
    and the rank's own cap (its memory: :attr:`~lightning_dynamix.metrics.ClusterState.batch_size_caps`);
    a lower bound of 0 lets the controller sit a rank out, an upper bound is at least 1. Where the
    intersection is empty the upper bound wins (it is usually a memory limit): lower = upper.

    Raises:
        ValueError: when a per-rank bound does not have one entry per rank.
    """
    n = state.world_size
    lows = per_rank_bounds(min_batch_size, n, "min_batch_size", 0)
    highs = per_rank_bounds(max_batch_size, n, "max_batch_size", None)
    lower: list[int] = []
    upper: list[int | None] = []
    for low, high, cap in zip(lows, highs, state.batch_size_caps):
        lo = max(int(low or 0), int(state.min_batch_size))
        caps = [int(c) for c in (high, cap) if c is not None]
        hi = max(1, min(caps)) if caps else None
        if hi is not None and lo > hi:
            lo = hi
        lower.append(lo)
        upper.append(hi)
    return lower, upper


def proportional_fill(
    weights: Sequence[float], total: float, lower: Sequence[float], upper: Sequence[float | None]
) -> list[float]:
    """Continuous ``x_i = clip(lam * w_i, lower_i, upper_i)`` with ``sum x = total`` (or the nearest bound)."""
    w = np.asarray(weights, dtype=np.float64)
    low = np.asarray(lower, dtype=np.float64)
    high = np.array([np.inf if u is None else u for u in upper], dtype=np.float64)
    if low.sum() >= total:
        return [float(v) for v in low]
    if np.isfinite(high).all() and high.sum() <= total:
        return [float(u) for u in high]

    def clipped(lam: np.ndarray) -> np.ndarray:
        return np.minimum(np.maximum(lam[..., None] * w, low), high)

    # f(lam) = sum_i clipped_i(lam) is continuous, non-decreasing and linear between the points where
    # a rank leaves a bound: evaluate it at all of them at once, interpolate in the segment that holds total
    bounded = np.isfinite(high) & (high > 0)
    points = np.unique(np.concatenate([[0.0], low / w, high[bounded] / w[bounded]]))
    filled = clipped(points).sum(axis=1)
    above = np.flatnonzero(filled >= total)
    if above.size:
        k = int(above[0])
        if k == 0:
            lam_star = 0.0
        else:
            rise = filled[k] - filled[k - 1]
            step = points[k] - points[k - 1]
            lam_star = points[k - 1] + (total - filled[k - 1]) * step / rise if rise > 0 else points[k]
    else:  # beyond the last point only ranks without an upper bound still grow
        lam_star = points[-1] + (total - filled[-1]) / w[~np.isfinite(high)].sum()
    return [float(v) for v in clipped(np.asarray(lam_star))]


def round_to_total(
    values: Sequence[float], total: int, lower: Sequence[int], upper: Sequence[int | None]
) -> tuple[int, ...]:
    """Round non-negative real sizes to ints within ``[lower_i, upper_i]`` that sum to ``total``.

    Largest-remainder rounding: every size is rounded down, then the samples still missing go one
    each to the ranks with the largest fractional parts (ties to the lower rank) that are below
    their upper bound. If the bounds make ``total`` impossible, the result is the closest sum the
    bounds allow.
    """
    sizes = [max(lo, math.floor(v + 1e-9)) for v, lo in zip(values, lower)]
    sizes = [s if hi is None else min(s, hi) for s, hi in zip(sizes, upper)]
    missing = total - sum(sizes)
    # one sample at a time to the rank whose size is furthest below its value (a heap: n log n, not n^2)
    if missing > 0:
        heap = [(sizes[i] - values[i], i) for i in range(len(sizes)) if upper[i] is None or sizes[i] < upper[i]]  # type: ignore[operator]
        heapq.heapify(heap)
        while missing > 0 and heap:
            _, i = heapq.heappop(heap)
            sizes[i] += 1
            missing -= 1
            if upper[i] is None or sizes[i] < upper[i]:  # type: ignore[operator]
                heapq.heappush(heap, (sizes[i] - values[i], i))
    if missing < 0:
        heap = [(values[i] - sizes[i], i) for i in range(len(sizes)) if sizes[i] > lower[i]]
        heapq.heapify(heap)
        while missing < 0 and heap:
            _, i = heapq.heappop(heap)
            sizes[i] -= 1
            missing += 1
            if sizes[i] > lower[i]:
                heapq.heappush(heap, (values[i] - sizes[i], i))
    return tuple(int(s) for s in sizes)


def respect_least_batch_size(
    sizes: Sequence[int], least: int, upper: int | Sequence[int | None] | None = None
) -> tuple[int, ...]:
    """``sizes`` with every size between 0 and ``least`` made 0 or ``least``, the total kept.

    A size below half of ``least`` becomes 0 (the rank sits out), one at or above it becomes ``least``;
    the samples that frees or takes are spread over the ranks that train in proportion to their sizes
    (largest remainders), none of them below ``least`` or above ``upper`` (one bound for all ranks, or one per
    rank). A model whose BatchNorm
    needs 2 samples per rank so never gets a rank of 1, whatever a controller decided.
    """
    if least <= 1 or not any(0 < b < least for b in sizes):
        return tuple(sizes)
    total = sum(sizes)
    snapped = [0 if b == 0 or 2 * b < least else max(b, least) for b in sizes]
    if not any(snapped):  # every rank below half of the least size: the largest trains alone
        largest = max(range(len(sizes)), key=lambda r: (sizes[r], -r))
        snapped[largest] = total
        return tuple(snapped)
    scale = total / sum(snapped)
    lower = [least if b > 0 else 0 for b in snapped]
    uppers = upper if isinstance(upper, Sequence) else [upper] * len(sizes)
    caps: list[int | None] = [u if b > 0 else 0 for b, u in zip(snapped, uppers)]
    return round_to_total([b * scale for b in snapped], total, lower, caps)


def respect_batch_size_caps(
    sizes: Sequence[int], caps: Sequence[int | None], lower: Sequence[int] | None = None
) -> tuple[int, ...]:
    """``sizes`` with no rank above its cap, the total kept where the caps allow it.

    The samples above a rank's cap go to the ranks below theirs in proportion to their sizes (a rank that
    sits out takes some only when the others are full), rounded by largest remainders.

    Args:
        sizes: one size per rank, samples.
        caps: the largest size per rank (its memory); ``None`` for no limit.
        lower: the smallest size per rank (default 0).

    Raises:
        ValueError: when the caps together hold fewer samples than ``sizes`` sum to.
    """
    if all(c is None or b <= c for b, c in zip(sizes, caps)):
        return tuple(sizes)
    total = sum(sizes)
    if all(c is not None for c in caps) and sum(c for c in caps if c is not None) < total:
        raise ValueError(
            f"the ranks' largest batch sizes {list(caps)} hold {sum(c for c in caps if c is not None)} samples,"
            f" fewer than the global batch of {total} ({list(sizes)}); lower the global batch or add memory"
        )
    low = list(lower) if lower is not None else [0] * len(sizes)
    low = [min(lo, c) if c is not None else lo for lo, c in zip(low, caps)]
    weights = [b if b > 0 else 1e-6 for b in sizes]  # a rank that sits out fills last
    return round_to_total(proportional_fill(weights, total, low, caps), total, low, caps)


def validate_batch_size_caps(
    caps: object, name: str = "batch_size_caps", ranks: int | None = None
) -> list[int | None] | None:
    """``caps`` as a list (one int >= 1 or ``None`` per rank, ``ranks`` of them where given), or ``None`` for none.

    Raises:
        ValueError: naming ``name``, for anything else.
    """
    if caps is None:
        return None
    if isinstance(caps, (str, bytes)) or not isinstance(caps, Sequence) or not caps:
        raise ValueError(f"`{name}` must be a list with one cap (samples: an int >= 1, or None) per rank, got {caps!r}")
    if ranks is not None and len(caps) != ranks:
        raise ValueError(f"`{name}` must hold one cap (samples, or None) per rank, {ranks} of them; got {caps!r}")
    for rank, cap in enumerate(caps):
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(
                f"`{name}[{rank}]` must be an int >= 1 (the most samples rank {rank} holds) or None, got {cap!r}"
            )
    return list(caps)


def check_within_caps(sizes: Sequence[int], caps: Sequence[int | None] | None, what: str = "ranks") -> None:
    """Raise ``ValueError`` where a size you gave exceeds its rank's cap (``caps`` ``None``: no caps)."""
    if caps is None:
        return
    over = [r for r, (b, c) in enumerate(zip(sizes, caps)) if c is not None and b > c]
    if over:
        raise ValueError(
            f"`batch_sizes` {list(sizes)} give {what} {over} more samples than their caps {list(caps)}"
            " (batch_size_caps, or lowered after they ran out of memory); give them at most their cap"
        )


def fit_within_caps(sizes: Sequence[int], caps: Sequence[int | None] | None, least: int) -> tuple[int, ...] | None:
    """``sizes`` split within ``caps`` (sizes you did not choose, such as a DataLoader's ``batch_size`` on every
    rank), none below ``least`` where it trains; ``None`` where they already fit."""
    if caps is None or all(c is None or b <= c for b, c in zip(sizes, caps)):
        return None
    return respect_batch_size_caps(sizes, caps, [least if b else 0 for b in sizes])


def split_in_proportion(
    total: int, weights: Sequence[float], lower: Sequence[int], upper: Sequence[int | None]
) -> tuple[int, ...]:
    """Split ``total`` samples over ranks in proportion to ``weights``, within per-rank bounds.

    Ranks whose proportional size falls outside ``[lower_i, upper_i]`` are held at the bound and
    the overflow is spread over the others in proportion to their weights (water filling); the
    result is rounded by largest remainders so that it sums to ``total`` exactly. If the bounds
    make ``total`` impossible (``sum(lower) > total`` or ``sum(upper) < total``) every rank gets
    its bound: the closest achievable total.

    Args:
        total: samples to split (the global batch).
        weights: one finite weight > 0 per rank (e.g. speeds in samples/s, or shares).
        lower: smallest size per rank, samples, >= 1.
        upper: largest size per rank, samples; ``None`` for no limit.
    """
    if not weights:
        raise ValueError("`weights` must hold one weight per rank, got none")
    if any(not (math.isfinite(w) and w > 0) for w in weights):
        raise ValueError(f"`weights` must be finite and > 0, got {list(weights)!r}")
    return round_to_total(proportional_fill(weights, total, lower, upper), total, lower, upper)


def own_busy_time(worker: WorkerMetrics) -> float:
    """A rank's own work per step, seconds: ``compute_time + data_time`` (a missing data time counts as 0)."""
    data = worker.data_time if math.isfinite(worker.data_time) and worker.data_time > 0 else 0.0
    return worker.compute_time + data


def arrival_time(worker: WorkerMetrics, transfer_time: float = 0.0) -> float:
    """When a rank reaches the gradient all-reduce, as the others see it, seconds into the step.

    ``step_time - sync_wait``: its data, forward and backward, the optimizer step and the framework's
    per-step work, and any time it was descheduled in between. Every rank leaves the all-reduce at
    the same moment, so the differences between ranks' arrivals are the others' waits for them: this
    is what a split must equalise. Falls back to :func:`own_busy_time` where the step was not timed.

    A rank under a CPU quota arrives no sooner on average than its quota allows: its whole step takes
    at least :attr:`~lightning_dynamix.metrics.state.WorkerMetrics.quota_step_time` (its CPU time per
    step over its cores), since once the quota is used up it is frozen while the others wait for
    it, inside the collective too, where the timing of its step's parts cannot see it. Less the
    bare transfer every rank waits for anyway (``transfer_time``), that is its arrival where it is
    the larger.
    """
    arrival = worker.step_time - worker.sync_wait
    if not (math.isfinite(arrival) and arrival > 0):
        arrival = own_busy_time(worker)
    quota_bound = worker.quota_step_time - transfer_time
    return max(arrival, quota_bound) if math.isfinite(quota_bound) else arrival


def arrival_times(state: ClusterState) -> list[float] | None:
    """Every rank's :func:`arrival_time` in ``state``, seconds into the step; a quota's bound less the
    state's :attr:`~lightning_dynamix.metrics.state.ClusterState.bare_transfer_time`.

    ``None`` where a rank that trained has no finite, positive time: nothing to decide on. A rank that sat
    the interval out (size 0) may report no time at all (on a GPU, marks on a stream it queued nothing on).
    """
    transfer = state.bare_transfer_time
    times = [arrival_time(w, transfer) for w in state.workers]
    if any(not (math.isfinite(t) and (t > 0 or w.batch_size == 0)) for w, t in zip(state.workers, times)):
        return None
    return times


def validate_bound(value: object, name: str, *, allow_none: bool, low: int = 1) -> int | tuple[int, ...] | None:
    """Check a batch-size bound given as one int >= ``low``, one per rank, or (if allowed) ``None``."""
    if value is None and allow_none:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < low:
            raise ValueError(f"`{name}` must be an int >= {low} (samples), got {value!r}.")
        return value
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and len(value) > 0:
        values = tuple(value)
        if all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in values):
            return values
    what = f"an int >= {low} or one int >= {low} per rank" + (", or None for no limit" if allow_none else "")
    raise ValueError(f"`{name}` must be {what}, got {value!r}.")


def validate_bound_pair(low: int | tuple[int, ...] | None, high: int | tuple[int, ...] | None) -> None:
    """Check that ``min_batch_size <= max_batch_size`` rank by rank where both are given."""
    if low is None or high is None:
        return
    if isinstance(low, tuple) and isinstance(high, tuple) and len(low) != len(high):
        raise ValueError(
            f"`min_batch_size` and `max_batch_size` must have the same number of ranks, got {list(low)!r}"
            f" and {list(high)!r}."
        )
    lows = low if isinstance(low, tuple) else (low,) * (len(high) if isinstance(high, tuple) else 1)
    highs = high if isinstance(high, tuple) else (high,) * len(lows)
    if any(lo > hi for lo, hi in zip(lows, highs)):
        raise ValueError(
            f"`min_batch_size` must be <= `max_batch_size` on every rank, got min_batch_size={low!r} and"
            f" max_batch_size={high!r}."
        )
