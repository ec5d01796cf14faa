"""Interleaved rounds: how every benchmark runs its variants, so that drift on the machine hits all of them alike."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

Variant = TypeVar("Variant", bound=Hashable)
Result = TypeVar("Result")


def interleaved_rounds(
    variants: Sequence[Variant], rounds: int, measure: Callable[[Variant, int], Result | None]
) -> dict[Variant, list[Result]]:
    """Measure every variant once a round, ``rounds`` times, each round starting one further along the list.

    No variant always runs first or last (with two variants: A B, B A, A B...): a machine that warms up, or
    slows down over the invocation, moves every variant's figures alike, and their ratios stay true.

    Args:
        variants: what is measured (controllers, setups, scenarios), each once a round.
        rounds: how many rounds (>= 1).
        measure: ``measure(variant, round_index)``: one measurement; ``None`` keeps nothing (a process other than
            the launcher's, which has no result).

    Returns:
        Every variant's results, in the order of the rounds.

    Raises:
        ValueError: for ``rounds`` below 1 or no variants.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"`rounds` must be an int >= 1, got {rounds!r}")
    if not variants:
        raise ValueError("`variants` must name at least one thing to measure")
    results: dict[Variant, list[Result]] = {variant: [] for variant in variants}
    for index in range(rounds):
        shift = index % len(variants)
        for variant in [*variants[shift:], *variants[:shift]]:
            result = measure(variant, index)
            if result is not None:
                results[variant].append(result)
    return results
