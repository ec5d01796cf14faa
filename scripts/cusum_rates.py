"""How often the gate's CUSUMs fire on noise alone, and how soon on a shifted balance (``StepTimes.deviation``).

Two ranks at one split, each interval's time drawn with a Gaussian relative noise of 5%: the alarms per 20,000
intervals (five seeds), then, from interval 100, rank 0's step longer by 2, 3 or 4 standard deviations of its
excess over the interval's mean, and the intervals until the CUSUMs find it (20 seeds; a shift of more than 25%
of the step is a change, which the suspect rule follows instead, counted as "by the change rule").

Run: ``.venv/bin/python scripts/cusum_rates.py``
"""

from __future__ import annotations

import random
import statistics

from lightning_dynamix.control.step_times import StepTimes

NOISE = 0.05
EXCESS_SD = NOISE * 0.5**0.5  # the standard deviation of one of two ranks' excess over their mean


def alarms(seed: int, intervals: int = 20_000) -> int:
    rng, times, found = random.Random(seed), StepTimes(8), 0
    for _ in range(intervals):
        times.observe([100, 100], [0.02 * (1 + rng.gauss(0, NOISE)) for _ in range(2)])
        found += times.deviation is not None
    return found


def detection(seed: int, shift: float) -> int | None:
    """Intervals after the shift until the CUSUMs find it; ``None`` where a confirmed change came first."""
    rng, times = random.Random(seed), StepTimes(8)
    for k in range(400):
        step = [0.02 * (1 + rng.gauss(0, NOISE)) for _ in range(2)]
        if k >= 100:
            step[0] *= 1 + 2 * shift * EXCESS_SD  # rank 0's excess moves by half its own change
        times.observe([100, 100], step)
        if k >= 100 and any(times.changed):
            return None
        if k >= 100 and times.deviation is not None:
            return k - 99
    return None


def main() -> None:
    counts = [alarms(seed) for seed in range(5)]
    print(f"noise alone: {counts} alarms per 20,000 intervals (five seeds)")
    for shift in (2, 3, 4):
        found = [detection(seed, shift) for seed in range(20)]
        seen = [k for k in found if k is not None]
        print(
            f"a shift of {shift} standard deviations: found in {statistics.median(seen)} intervals (median,"
            f" {min(seen)}-{max(seen)}), {found.count(None)} of 20 by the change rule"
        )


if __name__ == "__main__":
    main()
