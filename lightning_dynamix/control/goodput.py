"""Pollux's goodput, for ranks of unequal speed: choose the global batch and its split together.

Pollux (AdaptDL, OSDI'21) picks the global batch ``B`` that maximises goodput = throughput x
statistical efficiency, but gives every replica the same local batch. :class:`GoodputController`
keeps the objective and drops that restriction: for each candidate ``B`` it splits the batch so
that every rank finishes at the same time, which is what makes heterogeneous ranks worth having.

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/control/goodput.py``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from lightning_dynamix._checks import require_int, require_number, require_optional_int
from lightning_dynamix.control.allocation import (
    arrival_times,
    resolve_bounds,
    validate_bound,
    validate_bound_pair,
)
from lightning_dynamix.control.base import Decision, validate_previous
from lightning_dynamix.control.lr_scaling import lr_scale, validate_lr_scaling
from lightning_dynamix.control.step_times import (
    MIN_GAIN,
    StepTimes,
    equal_time_split,
    gate_holds,
)
from lightning_dynamix.metrics.state import ClusterState, MeanWork


def statistical_efficiency(global_batch: float, base_global_batch: float, noise_scale: float) -> float:
    """Progress per sample at ``global_batch`` relative to ``base_global_batch``: ``(B_noise + B0) / (B_noise + B)``."""
    return (noise_scale + base_global_batch) / (noise_scale + global_batch)


class GoodputController:
    """Choose the global batch that maximises goodput, split so that all ranks finish together.

    See the module docstring for the models and the search.

    Args:
        base_batch_size: the global batch ``B0`` the job's learning rate was set for, samples;
            ``None`` takes the global batch of the first state seen. Statistical efficiency and
            learning-rate scale are relative to it.
        min_global_batch: smallest global batch to consider, samples; ``None`` for ``B0``.
        max_global_batch: largest global batch to consider, samples; ``None`` for ``8 * B0``.
            Both are further limited by the per-rank bounds times the world size.
        min_batch_size: smallest size of a rank, samples: one int for all ranks, one per rank, or
            ``None`` (default) for the state's alone. Intersected with ``ClusterState.min_batch_size``
            (the strategy's); 0 lets the controller sit a rank out.
        max_batch_size: largest size of a rank, samples: one int, one per rank, or ``None`` for no
            limit. Intersected with ``ClusterState.max_batch_size``.
        window: observations per rank the step-time model is fitted on, >= 2.
        grid_points: number of global batch sizes tried between the limits, >= 2.
        dead_band: keep the current global batch unless the best candidate's predicted goodput is higher
            by more than this fraction, in ``[0, 1)``; a new split of the same global batch needs more than
            1% (or this, if less).
        lr_scaling: learning-rate rule relative to ``B0``; one of
            :data:`~lightning_dynamix.control.lr_scaling.LR_SCALING_RULES`.
        noise_gate: also keep them unless the measurements show the move beyond their noise, as pid's
            gate (:meth:`PIDController.within_noise`; a new global batch: its gain beyond this many standard
            errors), >= 0; ``None`` for the dead band alone.

    Raises:
        ValueError: naming the argument, the value and what is valid, for any bad argument.
    """

    def __init__(
        self,
        base_batch_size: int | None = None,
        min_global_batch: int | None = None,
        max_global_batch: int | None = None,
        min_batch_size: int | Sequence[int] | None = None,
        max_batch_size: int | Sequence[int] | None = None,
        window: int = 8,
        grid_points: int = 32,
        dead_band: float = 0.02,
        lr_scaling: str = "adascale",
        noise_gate: float | None = 3.5,
    ) -> None:
        self.base_batch_size = require_optional_int("base_batch_size", base_batch_size, 1)
        self.min_global_batch = require_optional_int("min_global_batch", min_global_batch, 1)
        self.max_global_batch = require_optional_int("max_global_batch", max_global_batch, 1)
        if (
            self.min_global_batch is not None
            and self.max_global_batch is not None
            and self.min_global_batch > self.max_global_batch
        ):
            raise ValueError(
                f"`min_global_batch` must be <= `max_global_batch`, got min_global_batch={self.min_global_batch}"
                f" and max_global_batch={self.max_global_batch}."
            )
        self.min_batch_size = validate_bound(min_batch_size, "min_batch_size", allow_none=True, low=0)
        self.max_batch_size = validate_bound(max_batch_size, "max_batch_size", allow_none=True)
        validate_bound_pair(self.min_batch_size, self.max_batch_size)
        self.window = require_int("window", window, 2)
        self.grid_points = require_int("grid_points", grid_points, 2)
        self.dead_band = require_number("dead_band", dead_band, 0.0, 1.0, low_open=False, high_open=True)
        self.lr_scaling = validate_lr_scaling(lr_scaling)
        if noise_gate is not None:
            noise_gate = require_number("noise_gate", noise_gate, 0.0, math.inf, low_open=False, high_open=True)
        self.noise_gate = noise_gate
        self._base_global_batch: int | None = base_batch_size
        self._step_times = StepTimes(self.window)
        self._work = MeanWork()

    @property
    def needs_gradient_noise_scale(self) -> bool:
        """Whether it chooses the global batch, which the noise scale's statistical efficiency decides: not when
        ``min_global_batch == max_global_batch`` pins it (then only the split is chosen)."""
        return self.min_global_batch is None or self.min_global_batch != self.max_global_batch

    def decide(self, state: ClusterState) -> Decision:
        """New per-rank sizes, and the learning-rate scale for their global batch (see the module docstring)."""
        state = self._work.observe(state)  # times per unit of work where ranks counted it (a language model's tokens)
        current = state.batch_sizes
        n = state.world_size
        if self._base_global_batch is None:
            self._base_global_batch = state.global_batch
        base = self._base_global_batch
        noise = state.gradient_noise_scale
        arrival = arrival_times(state)
        if arrival is None:
            return self._decision(current, noise)
        self._step_times.observe(current, arrival)
        fitted = self._step_times.models()
        # a rank never seen training (it sat out from the start) is taken for an average one
        unknown = (0.0, statistics.mean(model[1] for model in fitted if model is not None))
        models = [model if model is not None else unknown for model in fitted]
        alphas = [a for a, _ in models]
        betas = [b for _, b in models]
        comm = [w.comm_time for w in state.workers if math.isfinite(w.comm_time) and w.comm_time >= 0]
        overhead = statistics.median(comm) if comm else 0.0
        lower, upper = resolve_bounds(state, self.min_batch_size, self.max_batch_size)
        noise_known = math.isfinite(noise) and noise >= 0

        def goodput(sizes: Sequence[int]) -> float:
            # a rank that sits out (size 0) costs the step nothing
            step = max(alphas[i] + betas[i] * sizes[i] for i in range(n) if sizes[i] > 0) + overhead
            efficiency = statistical_efficiency(sum(sizes), base, noise) if noise_known else 1.0
            return sum(sizes) / step * efficiency

        within_bounds = all(lo <= b and (hi is None or b <= hi) for b, lo, hi in zip(current, lower, upper))
        # sizes outside the bounds must change whatever the prediction says
        current_goodput = goodput(current) if within_bounds else 0.0
        best, best_goodput = current, current_goodput
        for total in self._candidates(state.global_batch, base, lower, upper, noise_known):
            sizes = equal_time_split(total, alphas, betas, lower, upper)
            value = goodput(sizes)
            if value > best_goodput:
                best, best_goodput = sizes, value
        gain = best_goodput / current_goodput - 1.0 if current_goodput > 0 else math.inf
        # a new global batch must beat the dead band; a new split of the same one what the gate asks of any move
        threshold = self.dead_band if sum(best) != sum(current) else min(self.dead_band, MIN_GAIN)
        if within_bounds and (gain <= threshold or self._within_noise(current, best, models, gain)):
            best = current
        return self._decision(best, noise)

    def _within_noise(
        self, current: Sequence[int], best: Sequence[int], models: Sequence[tuple[float, float]], gain: float
    ) -> bool:
        """Whether a move with predicted goodput ``gain`` (relative) should wait, as pid's gate says
        (:meth:`PIDController.within_noise`): the gain within ``noise_gate`` standard errors of the measurements'
        noise at the current split, or, for a move of the split alone, a deviation that did not keep its
        direction."""
        if self.noise_gate is None or list(best) == list(current):
            return False
        if sum(best) == sum(current):
            return gate_holds(self._step_times, current, best, self.noise_gate) is True
        error = self._step_times.gain_error(current, best, models)
        return error is not None and gain <= self.noise_gate * error

    def _candidates(
        self, current_total: int, base: int, lower: Sequence[int], upper: Sequence[int | None], noise_known: bool
    ) -> list[int]:
        """Global batch sizes to try: the current one, and a geometric grid when the noise scale is known (or the
        limits pin one)."""
        floor = sum(lower)
        ceiling = sum(u for u in upper if u is not None) if all(u is not None for u in upper) else None
        low = self.min_global_batch if self.min_global_batch is not None else base
        high = self.max_global_batch if self.max_global_batch is not None else 8 * base
        low, high = max(low, floor), max(high, floor)
        if ceiling is not None:
            low, high = min(low, ceiling), min(high, ceiling)
        high = max(high, low)
        if not noise_known and low < high:  # a global batch pinned by its limits needs no noise scale
            return [current_total]
        grid = {low, high, min(max(current_total, low), high)}
        ratio = high / low
        for k in range(1, self.grid_points - 1):
            grid.add(round(low * ratio ** (k / (self.grid_points - 1))))
        return sorted(grid)

    def _decision(self, sizes: Sequence[int], noise: float) -> Decision:
        base = self._base_global_batch or sum(sizes)
        return Decision(batch_sizes=tuple(sizes), lr_scale=lr_scale(self.lr_scaling, sum(sizes), base, noise))

    def regroup(self, previous: Sequence[int | None]) -> None:
        """The job now runs on another group: ``previous[i]`` is new rank ``i``'s old rank, ``None`` for a new machine.

        A machine that stays keeps its observed step times (its model of the step); a new one starts
        with none, and is fitted from its first interval on the new group, which the next decision waits for.
        """
        if not self._step_times.ranks:
            return
        self._step_times.regroup(validate_previous(previous, len(self._step_times.ranks)))

    def rank_speeds(self) -> list[float] | None:
        """Every rank's speed at its last observed size, samples/s (a new machine: the others' mean), or ``None``."""
        observations = self._step_times.ranks
        if not any(observations):
            return None
        known = [obs[-1][0] / obs[-1][1] if obs and obs[-1][1] > 0 else math.nan for obs in observations]
        finite = [s for s in known if math.isfinite(s)]
        if not finite:
            return None
        mean = sum(finite) / len(finite)
        return [s if math.isfinite(s) else mean for s in known]

    def state_dict(self) -> dict[str, Any]:
        """The base global batch (samples) and every rank's recent ``[batch size, busy time]`` observations."""
        return {
            "base_global_batch": self._base_global_batch,
            "observations": self._step_times.state_dict(),
            "work": self._work.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, so the next decision is the one the saved controller would make."""
        base = state_dict.get("base_global_batch")
        self._base_global_batch = None if base is None else int(base)
        self._step_times.load_state_dict(state_dict.get("observations", []))
        self._work.load_state_dict(state_dict.get("work", {}))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(base_batch_size={self.base_batch_size}, min_global_batch={self.min_global_batch},"
            f" max_global_batch={self.max_global_batch}, window={self.window}, grid_points={self.grid_points},"
            f" dead_band={self.dead_band}, lr_scaling={self.lr_scaling!r}, noise_gate={self.noise_gate})"
        )
