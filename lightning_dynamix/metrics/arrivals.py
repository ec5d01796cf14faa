"""Who made whom wait inside a step: every collective's arrivals on all ranks, on one time line.

A collective inside the step (an FSDP all-gather or reduce-scatter, ``GlobalBatchNorm``'s statistics, a
``sync_dist`` log) holds every rank until the last one arrives. A rank's clock tells only how long it spent inside
(:meth:`~lightning_dynamix.metrics.StepClock.collective`), and under real contention that misleads: a rank that is
descheduled inside a collective (its co-tenant runs while it waits for data) spends that time there too, and both
ranks' own work looks alike. Arrivals tell them apart: the wait for the others is the time from a rank's arrival
to the last rank's; the rest of its time inside (the collective's own transfer, its descheduling) is its own.

:func:`clock_offsets` puts the ranks' clocks on one line from a few all-gathers stamped before and after on every
rank (a rank stamps after the others stamped before: each round bounds their offset); :func:`own_time_inside`
turns each rank's arrivals and releases into the part of its time inside collectives that was not waiting.
How it is used: ``docs/internals.md``, section ``lightning_dynamix/metrics/timers.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

Span = tuple[float, float]
"""``(arrival, release)`` of one collective on one rank's clock, in seconds."""


def clock_offsets(rounds: Sequence[Sequence[Span]]) -> list[float]:
    """Each rank's clock minus rank 0's, in seconds.

    Args:
        rounds: ``rounds[r][i]``: rank ``r``'s clock just before and just after round ``i``, a collective every rank
            took part in (no rank leaves it before every rank entered it).

    Each round bounds rank ``r``'s offset from rank 0's: ``r`` entered before 0 left, and 0 entered before ``r``
    left. The tightest bounds over the rounds are kept and their middle returned: off by at most half the shortest
    round (about 0.1 ms between gloo processes of one machine, measured; a round trip between machines).

    Raises:
        ValueError: for ranks with different numbers of rounds, or none.
    """
    if not rounds or len({len(r) for r in rounds}) != 1 or not rounds[0]:
        raise ValueError(f"`rounds` must give every rank the same rounds, at least one, got {[len(r) for r in rounds]}")
    reference = rounds[0]
    offsets = []
    for own in rounds:
        low = max(before - after_0 for (before, _), (_, after_0) in zip(own, reference))
        high = min(after - before_0 for (_, after), (before_0, _) in zip(own, reference))
        offsets.append((low + high) / 2)
    return offsets


def own_time_inside(
    steps: Sequence[Sequence[Sequence[Span]]], offsets: Sequence[float]
) -> tuple[list[float], int] | None:
    """Every rank's mean seconds a step inside collectives that were not waiting for another rank.

    Args:
        steps: ``steps[r][s]``: rank ``r``'s collectives at step ``s`` of the interval, in order, each
            ``(arrival, release)`` on its own clock; the same steps on every rank.
        offsets: each rank's clock minus a common one (:func:`clock_offsets`).

    For each collective, a rank waited from its arrival until the last rank's (at most its whole time inside); the
    rest it spent on the collective itself. Steps whose collectives do not pair up on every rank (a rank that sat
    the step out ran none) are left out. Returns the means and the number of steps they are over; ``None`` where no
    step had collectives on every rank, or the ranks gave different numbers of steps.
    """
    world = len(steps)
    if world == 0 or len(offsets) != world or len({len(s) for s in steps}) != 1:
        return None
    own, paired = [0.0] * world, 0
    for step in zip(*steps):
        if len({len(spans) for spans in step}) != 1 or not step[0]:
            continue
        paired += 1
        for collective in zip(*step):
            arrivals = [arrival - offset for (arrival, _), offset in zip(collective, offsets)]
            last = max(arrivals)
            for rank, ((arrival, release), aligned) in enumerate(zip(collective, arrivals)):
                inside = max(0.0, release - arrival)
                own[rank] += inside - min(inside, max(0.0, last - aligned))
    if paired == 0:
        return None
    return [seconds / paired for seconds in own], paired
