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

import numpy as np

from lightning_dynamix._checks import require_int, require_number, require_optional_int
from lightning_dynamix.control.allocation import (
    arrival_times,
    resolve_bounds,
    round_to_total,
    validate_bound,
    validate_bound_pair,
)
from lightning_dynamix.control.base import Decision, validate_previous
from lightning_dynamix.control.lr_scaling import lr_scale, validate_lr_scaling
from lightning_dynamix.metrics.state import ClusterState, MeanWork

# relative distance between an observation and the model's prediction beyond which the rank's
# speed is taken to have changed and its older observations are forgotten
_SPEED_CHANGE_TOLERANCE = 0.25


def fit_step_time(observations: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Fit ``t = alpha + beta * b`` (seconds, ``b`` in samples) to ``(b, t)`` observations.

    Least squares over the observations; with a single distinct ``b``, or when the fit gives
    ``beta <= 0`` or ``alpha < 0``, the proportional model ``t = beta * b`` (least squares through
    the origin) is returned as ``(0.0, beta)``.

    Raises:
        ValueError: without observations.
    """
    if not observations:
        raise ValueError("`observations` must hold at least one (batch size, time) pair, got none")
    sizes = [float(b) for b, _ in observations]
    times = [float(t) for _, t in observations]
    if len(set(sizes)) >= 2:
        mean_b = sum(sizes) / len(sizes)
        mean_t = sum(times) / len(times)
        var_b = sum((b - mean_b) ** 2 for b in sizes)
        beta = sum((b - mean_b) * (t - mean_t) for b, t in zip(sizes, times)) / var_b
        alpha = mean_t - beta * mean_b
        if beta > 0 and alpha >= 0:
            return alpha, beta
    return 0.0, sum(b * t for b, t in zip(sizes, times)) / sum(b * b for b in sizes)


class StepTimes:
    """Each rank's last ``window`` ``(size, time)`` observations of its step, the data of its model.

    A rank at size 0 (sitting out) adds nothing: its model stays what its last samples showed. An
    observation farther than 25% from what the rank's model predicts is a suspect: on a shared
    machine one such interval is noise (a rank descheduled for 100 ms in one step, a CPU quota's
    throttling), and forgetting the rank's past for it moved a third of the batch for one interval;
    it joins the observations like any other. A second one in a row, on the same side, means the
    rank itself changed: its older observations are forgotten, the suspect with them (a model fitted
    to two intervals at nearby sizes overshot: 256:256 went to 494:18 and back to 432:80). A suspect is judged
    only where the model is measured: at a size already observed, or from an affine fit (two sizes
    or more); a proportional guess from one other size would take every affine rank for a changed
    one. Its confirmation may come from such a guess (the sizes often change after a suspect).
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.ranks: list[list[tuple[int, float]]] = []
        self._off: list[float] = []  # per rank: a suspect's relative distance from the model, 0 for none
        self.changed: list[bool] = []
        """Per rank: whether its last observation confirmed a change (its older observations forgotten)."""

    @property
    def suspect(self) -> list[bool]:
        """Per rank: whether its last observation was off its model and not (yet) confirmed by another."""
        return [off != 0.0 for off in self._off]

    def observe(self, sizes: Sequence[int], times: Sequence[float]) -> None:
        """Add one interval's size and time per rank (a new number of ranks starts every rank afresh)."""
        if len(self.ranks) != len(sizes):  # another group without regroup(): nothing carries over
            self.ranks = [[] for _ in sizes]
            self._off = [0.0] * len(sizes)
        self.changed = [False] * len(sizes)
        for r, (obs, b, t) in enumerate(zip(self.ranks, sizes, times)):
            if b == 0:
                continue
            previous, self._off[r] = self._off[r], 0.0
            # confirming a suspect, the model is the one it was judged by, which may guess from one size
            basis = obs[:-1] if previous and len(obs) > 1 else obs
            if basis and (previous or len({size for size, _ in basis}) >= 2 or basis[-1][0] == b):
                alpha, beta = fit_step_time(basis)
                predicted = alpha + beta * b
                off = (t - predicted) / predicted if predicted > 0 else math.inf
                if abs(off) > _SPEED_CHANGE_TOLERANCE:
                    if previous * off > 0:  # the interval before was off on the same side: a change
                        obs.clear()
                        self.changed[r] = True
                    else:
                        self._off[r] = off
            obs.append((int(b), float(t)))
            del obs[: -self.window]

    def scatter(self, sizes: Sequence[int]) -> list[float | None] | None:
        """Each rank's relative variance about its model: its measurements' own noise.

        Rank ``r``'s is ``sum((t - m(b)) / m(b))^2 / (n - p)`` over its ``n`` observations, ``m`` its model
        fitted to them and ``p`` the model's parameters (1 at one size, 2 fitted affine); 0.0 for a rank
        without samples in ``sizes``, ``None`` for one with fewer than two degrees of freedom (just started,
        or its past forgotten after a change). ``None`` for another number of ranks.
        """
        if len(self.ranks) != len(sizes):
            return None
        variances: list[float | None] = []
        for obs, b in zip(self.ranks, sizes):
            if b == 0:
                variances.append(0.0)
                continue
            alpha, beta = fit_step_time(obs) if obs else (0.0, 0.0)
            degrees = len(obs) - (2 if alpha > 0 else 1)
            if degrees < 2:
                variances.append(None)
                continue
            residuals = [(t - (alpha + beta * size)) / (alpha + beta * size) for size, t in obs]
            variances.append(sum(r * r for r in residuals) / degrees)
        return variances

    def standard_error(self, sizes: Sequence[int], averaged: Sequence[float] | None = None) -> float | None:
        """How far the ranks' models can be off from the measurements' noise alone, relative:
        ``sqrt(sum_r scatter_r / n_r)`` over the ranks with samples in ``sizes``, ``n_r`` the intervals rank ``r``'s
        estimate averages (``averaged``; by default its observations, which its model is fitted to). ``None``
        while a rank with samples has no scatter measured (:meth:`scatter`)."""
        variances = self.scatter(sizes)
        if variances is None:
            return None
        counts = averaged if averaged is not None else [len(obs) for obs in self.ranks]
        total = 0.0
        for variance, n in zip(variances, counts):
            if variance is None:
                return None
            total += variance / n if variance else 0.0  # 0.0 for a rank without samples (no observations)
        return math.sqrt(total)

    def regroup(self, mapping: Sequence[int | None]) -> None:
        """New rank ``i`` keeps old rank ``mapping[i]``'s observations (``None``: a new machine, none)."""
        self.ranks = [list(self.ranks[p]) if p is not None else [] for p in mapping]
        self._off = [0.0] * len(mapping)
        self.changed = [False] * len(mapping)

    def state_dict(self) -> list[list[list[float]]]:
        """Every rank's ``[size, time]`` observations (whether the last one was a suspect is not saved)."""
        return [[[b, t] for b, t in obs] for obs in self.ranks]

    def load_state_dict(self, saved: Sequence[Sequence[Sequence[float]]]) -> None:
        self.ranks = [[(int(b), float(t)) for b, t in obs] for obs in saved]
        self._off = [0.0] * len(self.ranks)
        self.changed = [False] * len(self.ranks)


def equal_time_split(
    total: int,
    alphas: Sequence[float],
    betas: Sequence[float],
    lower: Sequence[int],
    upper: Sequence[int | None],
) -> tuple[int, ...]:
    """Split ``total`` samples so that every rank's ``alpha_i + beta_i * b_i`` is the same, within bounds.

    Ranks that would fall below ``lower_i`` or rise above ``upper_i`` are held at the bound and the
    rest share the remainder at a common time; the result is rounded by largest remainders to sum
    to ``total`` exactly (or to the closest total the bounds allow).
    """
    return round_to_total(equal_time_sizes(total, alphas, betas, lower, upper), total, lower, upper)


def equal_time_sizes(
    total: float,
    alphas: Sequence[float],
    betas: Sequence[float],
    lower: Sequence[int],
    upper: Sequence[int | None],
) -> list[float]:
    """:func:`equal_time_split` before rounding: the sizes, as real numbers, at which the ranks finish together."""
    if total <= sum(lower):
        return [float(v) for v in lower]
    if all(u is not None for u in upper) and total >= sum(u for u in upper if u is not None):
        return [float(u) for u in upper if u is not None]

    a = np.asarray(alphas, dtype=np.float64)
    beta = np.asarray(betas, dtype=np.float64)
    lo = np.asarray(lower, dtype=np.float64)
    hi = np.array([np.inf if u is None else float(u) for u in upper])

    def sizes_at(common: np.ndarray) -> np.ndarray:
        return np.clip((common[..., None] - a) / beta, lo, hi)

    # sum_i b_i(T) is piecewise linear and non-decreasing in the common time T, with a corner where a
    # rank leaves a bound: find the segment holding `total` among the corners, then interpolate
    corners = np.unique(
        np.concatenate([a + beta * lo, (a + beta * hi)[np.isfinite(hi)], [a.max() + 2.0 * beta.max() * total]])
    )
    filled = sizes_at(corners).sum(axis=-1)
    j = int(np.searchsorted(filled, total))
    if j == 0:
        common = corners[0]
    else:
        t0, t1, f0, f1 = corners[j - 1], corners[j], filled[j - 1], filled[j]
        common = t1 if f1 == f0 else t0 + (total - f0) * (t1 - t0) / (f1 - f0)
    return [float(v) for v in sizes_at(np.asarray(common))]


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
        dead_band: keep the current sizes unless the best candidate's predicted goodput is higher
            by more than this fraction, in ``[0, 1)``.
        lr_scaling: learning-rate rule relative to ``B0``; one of
            :data:`~lightning_dynamix.control.lr_scaling.LR_SCALING_RULES`.
        noise_gate: also keep them unless the gain exceeds this many standard errors of the measurements'
            noise (the module docstring), >= 0; ``None`` for the dead band alone.

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
        noise_gate: float | None = 2.0,
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
        fitted = [fit_step_time(obs) if obs else None for obs in self._step_times.ranks]
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
        error = self._step_times.standard_error(current)
        gate = self.noise_gate * error if self.noise_gate is not None and error is not None else 0.0
        if best_goodput <= (1.0 + max(self.dead_band, gate)) * current_goodput:
            best = current
        return self._decision(best, noise)

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
