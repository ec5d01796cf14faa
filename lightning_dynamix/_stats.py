"""The statistics every figure of the package is quoted with: medians that skip what was not measured, and their
spread. One place, so that a bench, the calibration and a report read a run alike."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable
from typing import overload


@overload
def median_or(values: Iterable[float | None], default: float) -> float: ...
@overload
def median_or(values: Iterable[float | None], default: None = None) -> float | None: ...
def median_or(values: Iterable[float | None], default: float | None = None) -> float | None:
    """The median of the finite ``values`` (``None`` and NaN are what was not measured); ``default`` where none is."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    return statistics.median(finite) if finite else default


def spread(values: Iterable[float | None]) -> tuple[float, float, float] | None:
    """``(median, min, max)`` of the finite ``values``: a figure with the range the next run should fall in; ``None``
    where none was measured."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return None
    return statistics.median(finite), min(finite), max(finite)


def bootstrap_median_interval(
    values: list[float], confidence: float = 0.95, resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """A bootstrap confidence interval of the median of ``values`` (resampled with replacement, seeded)."""
    generator = random.Random(seed)
    medians = sorted(statistics.median(generator.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1.0 - confidence) / 2.0
    return medians[int(tail * resamples)], medians[min(resamples - 1, int((1.0 - tail) * resamples))]
