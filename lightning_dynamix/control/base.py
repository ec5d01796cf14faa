"""The contract between the decision loop and the controllers that make its decisions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from lightning_dynamix.metrics.state import ClusterState


@dataclass(frozen=True)
class Decision:
    """What a controller decided at one decision point.

    Attributes:
        batch_sizes: the new batch size of every rank, in rank order (samples); 0 for a rank that
            sits out (within ``min_batch_size=0``), and at least one rank trains.
        lr_scale: factor for the learning rate relative to the one the job started with
            (1.0: unchanged); set by the learning-rate scaling rule when the global batch changes.
        from_step: the step of the epoch the sizes apply from; ``None`` for the first step no
            rank has produced yet (agreed by the strategy).
    """

    batch_sizes: tuple[int, ...]
    lr_scale: float = 1.0
    from_step: int | None = None

    def __post_init__(self) -> None:
        sizes = tuple(self.batch_sizes)
        if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in sizes) or not sum(sizes):
            raise ValueError(
                f"`batch_sizes` must be one int >= 0 per rank, at least one of them >= 1, got {self.batch_sizes!r}"
            )
        object.__setattr__(self, "batch_sizes", sizes)
        if not (math.isfinite(self.lr_scale) and self.lr_scale > 0):
            raise ValueError(f"`lr_scale` must be a finite number > 0, got {self.lr_scale!r}")

    @property
    def global_batch(self) -> int:
        return sum(self.batch_sizes)


@runtime_checkable
class BatchController(Protocol):
    """Turns a :class:`ClusterState` into a :class:`Decision`.

    ``decide`` is called on rank 0 only, once per decision interval, with states whose measured
    fields are finite; its decision is broadcast to every rank. ``state_dict`` must hold
    everything needed to continue identically after a resume, as plain Python values.

    Controllers with per-rank state may also implement, for jobs resumed on another group of machines:

    * ``regroup(previous)``: the job now runs on a new group; ``previous[i]`` is the rank new rank ``i``
      ran as before (the same machine), ``None`` for a machine new to the job. What was learnt about a
      machine stays with it; a new one starts from the mean of the others; the next decision is made
      from the first interval measured on the new group.
    * ``rank_speeds()``: each rank's speed as far as known (samples/s, any common scale), or ``None``:
      how a resumed job splits its global batch before anything is measured.

    A controller that decides without reading the measurements sets ``uses_measurements = False``
    (the static one): a rank it keeps at size 0 is then never probed, since nothing it measured
    could bring the rank back, and a probe's split would simply be kept.
    """

    def decide(self, state: ClusterState) -> Decision: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def regroup_values(values: Sequence[float], previous: Sequence[int | None]) -> list[float]:
    """Per-rank ``values`` of the old group, for the ranks of a new one.

    ``previous[i]`` is the old rank that new rank ``i`` ran as (the same machine), or ``None`` for a
    machine new to the job, which gets the mean of the machines that stayed (of all old ranks when
    none stayed). Check the mapping with :func:`validate_previous` first.
    """
    kept = [values[p] for p in previous if p is not None]
    pool = kept or list(values)
    mean = sum(pool) / len(pool) if pool else float("nan")
    return [values[p] if p is not None else mean for p in previous]


def validate_previous(previous: Sequence[int | None], old_world_size: int) -> list[int | None]:
    """Check a regroup mapping: one entry per new rank, each an old rank or ``None``, no old rank twice."""
    mapping = list(previous)
    taken = [p for p in mapping if p is not None]
    if not mapping or len(set(taken)) != len(taken) or any(not 0 <= p < old_world_size for p in taken):
        raise ValueError(
            f"`previous` must give every new rank its old rank in [0, {old_world_size - 1}] (each at most once) or"
            f" None for a new machine, got {mapping!r}"
        )
    return mapping
