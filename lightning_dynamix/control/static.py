"""The controller that changes nothing: the baseline every other controller is measured against."""

from __future__ import annotations

from typing import Any

from lightning_dynamix.control.base import Decision
from lightning_dynamix.metrics.state import ClusterState


class StaticController:
    """Keep every rank's batch size and the learning rate as they are.

    ``decide`` returns the state's current per-rank sizes (samples) with an ``lr_scale`` of 1.0. It
    holds no state, so it costs nothing and resumes trivially; use it to measure what the other
    controllers gain, or to run the heterogeneous strategy with fixed, hand-chosen sizes. A rank
    given 0 samples stays at 0: it reads no measurements, so a rank it keeps out is not probed.
    """

    uses_measurements = False

    def decide(self, state: ClusterState) -> Decision:
        """The current sizes, unchanged."""
        return Decision(batch_sizes=state.batch_sizes)

    def state_dict(self) -> dict[str, Any]:
        """An empty dict: there is nothing to save."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accept what :meth:`state_dict` returned; there is nothing to restore."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
