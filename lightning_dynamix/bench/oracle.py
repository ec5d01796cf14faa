"""The oracle of ``dynamix bench balance`` and ``tta``: the best fixed split of a global batch, searched for with
measured runs in the same invocation, against which every controller is judged."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from lightning_dynamix.bench.harness import RunConfig, is_launcher_rank_zero, run, samples_per_second


def neighbour_splits(split: tuple[int, ...], delta: int, low: int = 1) -> list[tuple[int, ...]]:
    """``split`` with ``delta`` samples moved from one rank to another, every way; a rank with fewer than
    ``delta`` above ``low`` gives what it has above ``low`` (so a search can reach the bound itself)."""
    found = []
    for give in range(len(split)):
        moved_samples = min(delta, split[give] - low)
        for take in range(len(split)):
            if give != take and moved_samples > 0:
                moved = list(split)
                moved[give] -= moved_samples
                moved[take] += moved_samples
                found.append(tuple(moved))
    return found


def find_best_fixed_split(
    measure: Any, global_batch: int, world: int, finest: int = 1, low: int = 1, confirm: int = 3
) -> tuple[tuple[int, ...], float, dict[tuple[int, ...], float]]:
    """Pattern search over fixed splits of ``global_batch``: from the even split, move ``delta`` samples
    between two ranks while that is faster (down to ``low`` samples on a rank), then halve ``delta``
    (a quarter of a rank's share first), down to ``finest``. ``measure(split)`` returns samples/s; each
    split is measured once in the search.

    The best of many noisy measurements is biased upwards: the search ends on whichever split read
    luckiest. So the ``confirm`` splits that measured best are measured once more each, and the one
    whose two measurements have the highest mean is chosen (``confirm=0``: the search's best as is).

    Returns the chosen split, the mean of its measurements and every split's first measurement.
    """
    base, extra = divmod(global_batch, world)
    best = tuple(base + (1 if r < extra else 0) for r in range(world))
    measured: dict[tuple[int, ...], float] = {best: measure(best)}
    delta = max(finest, global_batch // (4 * world))
    while True:
        improved = True
        while improved:
            improved = False
            for split in neighbour_splits(best, delta, low):
                if split not in measured:
                    measured[split] = measure(split)
                if measured[split] > measured[best]:
                    best, improved = split, True
        if delta <= finest:
            break
        delta = max(finest, delta // 2)
    if confirm < 1:
        return best, measured[best], measured
    top = sorted(measured, key=lambda split: measured[split], reverse=True)[:confirm]
    means = {split: (measured[split] + measure(split)) / 2 for split in top}
    best = max(top, key=lambda split: means[split])
    return best, means[best], measured


def finest_move(args: argparse.Namespace, world: int) -> int:
    if args.oracle_finest is not None and args.oracle_finest < 1:
        raise SystemExit(f"--oracle-finest must be >= 1, got {args.oracle_finest}")
    return args.oracle_finest or max(1, args.batch_size * world // 64)


def fixed_split_measure(config: RunConfig, after_step: int) -> Callable[[tuple[int, ...]], float]:
    """Samples/s of ``config`` run with a fixed split, after ``after_step``; every rank gets the figure."""

    def measure(split: tuple[int, ...]) -> float:
        result = run(dataclasses.replace(config, controller="static", batch_sizes=split), on_every_rank=True)
        assert result is not None  # every rank takes the search's next step
        value = samples_per_second(result, after_step)
        if is_launcher_rank_zero():
            print(f"fixed split {','.join(map(str, split))}: {value:.1f} samples/s", flush=True)
        return value

    return measure


def search_best_fixed_split(
    args: argparse.Namespace, measure: Callable[[tuple[int, ...]], float], low: int
) -> dict[str, Any]:
    """The oracle's search for the best fixed split of the initial global batch (see :func:`find_best_fixed_split`)."""
    world = len(args.speeds)
    if args.oracle_confirm < 0:
        raise SystemExit(f"--oracle-confirm must be >= 0 (0: no second measurements), got {args.oracle_confirm}")
    calls: list[tuple[tuple[int, ...], float]] = []

    def recorded(split: tuple[int, ...]) -> float:
        value = measure(split)
        calls.append((split, value))
        return value

    best, rate, measured = find_best_fixed_split(
        recorded, args.batch_size * world, world, finest_move(args, world), low, confirm=args.oracle_confirm
    )
    again = calls[len(measured) :]
    return {
        "best_split": list(best),
        "best_samples_per_second_in_search": rate,
        "measured": [{"split": list(k), "samples_per_second": v} for k, v in measured.items()],
        # the best splits of the search measured once more: their first and second samples/s
        "confirmed": [{"split": list(k), "samples_per_second": [measured[k], v]} for k, v in again],
    }
