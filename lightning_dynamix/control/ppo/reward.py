"""The reward of a decision as a real job measures it, and the penalty terms it shares with the simulator's.

The simulator's reward (:mod:`lightning_dynamix.rl.env`) prices an interval in time to the target
accuracy; a real job knows neither its accuracy ceiling nor its target, so :func:`measured_reward`
takes the simulator's reward as far as a job can measure it: progress made less time spent, each in
units of a perfectly balanced step at the job's first global batch ``B0``. Per step, with
``e(B) = B_noise / (B_noise + B)`` the statistical efficiency at the measured noise scale (1 while
it is unknown)::

    B e(B) / (B0 e(B0))  -  step_time / (B0 / ideal_throughput)  -  oscillation penalty

The reference is taken at the current noise scale and the ranks' current speeds (the simulator
takes it at the start), since a real job never learns its starting speeds exactly. A job never
breaks a memory limit on purpose (an out-of-memory error ends it), so the memory penalty is the
simulator's alone. :class:`RewardWeights` and :func:`oscillation` are the two rewards' shared parts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_dynamix._checks import require_number
from lightning_dynamix.metrics.state import ClusterState


@dataclass(frozen=True)
class RewardWeights:
    """Weights of the reward's penalties (the time-to-target terms have weight 1).

    Attributes:
        oscillation: per unit of log2 batch change that reverses the previous change.
        memory: per fraction of ranks over their memory limit (the simulator's reward only).
    """

    oscillation: float = 0.05
    memory: float = 1.0

    def __post_init__(self) -> None:
        for name in ("oscillation", "memory"):
            require_number(name, getattr(self, name), 0.0)


def oscillation(change: np.ndarray, previous_change: np.ndarray) -> float:
    """Mean over ranks of ``|change|`` where a rank's log2 change reverses its previous one."""
    reversed_change = np.sign(change) * np.sign(previous_change) < 0
    return float(np.abs(change)[reversed_change].sum()) / len(change)


def measured_reward(
    state: ClusterState,
    previous_sizes: Sequence[int],
    previous_change: np.ndarray,
    base_global_batch: int,
    weights: RewardWeights,
) -> tuple[float, np.ndarray]:
    """The reward of the interval that ended in ``state``, and each rank's log2 change into it.

    ``previous_sizes`` are the sizes before the decision whose interval ``state`` measured.
    """
    sizes = np.asarray(state.batch_sizes, dtype=np.float64)
    change = np.log2(sizes / np.asarray(previous_sizes, dtype=np.float64))
    ideal, step = state.ideal_throughput, state.step_time
    noise = state.gradient_noise_scale
    known = math.isfinite(noise) and noise > 0
    efficiency = noise / (noise + state.global_batch) if known else 1.0
    base_efficiency = noise / (noise + base_global_batch) if known else 1.0
    if ideal > 0 and math.isfinite(ideal) and step > 0 and math.isfinite(step):
        progress = state.global_batch * efficiency / (base_global_batch * base_efficiency)
        measured = progress - step * ideal / base_global_batch
    else:
        measured = 0.0
    return measured - weights.oscillation * oscillation(change, previous_change), change
