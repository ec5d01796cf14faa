"""The contract between the decision loop and the controllers that make its decisions."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from lightning_dynamix.metrics.state import ClusterState


@dataclass(frozen=True)
class Decision:
    """What a controller decided at one decision point.

    Attributes:
        batch_sizes: the new batch size of every rank, in rank order (samples).
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
        if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
            raise ValueError(f"`batch_sizes` must be one int >= 1 per rank, got {self.batch_sizes!r}")
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
    """

    def decide(self, state: ClusterState) -> Decision: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
