"""Equal iteration times on unequal ranks: the Tyagi & Sharma / OmniLearn controller, as a PID loop.

In synchronous data parallelism every rank waits for the slowest one at each all-reduce, so the
job runs best when every rank's own work per step takes the same time. :class:`PIDController`
moves samples from slow ranks to fast ones until it does, keeping the global batch (and so the
optimisation) unchanged.

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/control/pid.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_dynamix._checks import require_bool, require_number
from lightning_dynamix.control.allocation import (
    arrival_times,
    proportional_fill,
    resolve_bounds,
    round_to_total,
    validate_bound,
    validate_bound_pair,
)
from lightning_dynamix.control.base import Decision, regroup_values, validate_previous
from lightning_dynamix.control.lr_scaling import lr_scale, validate_lr_scaling
from lightning_dynamix.control.step_times import StepTimes, equal_time_sizes, gate_holds
from lightning_dynamix.metrics.state import ClusterState, MeanWork

# the smallest share a rank's weight may reach before it is split: keeps weights positive
_MIN_SHARE = 1e-6
# the secant gain is only estimated from a step of at least this fraction of the rank's share, and
# never exceeds _MAX_SECANT_GAIN (enough for a fixed cost of up to 2/3 of the step time)
_SECANT_MIN_STEP = 0.05
_MAX_SECANT_GAIN = 3.0
# the integral (in shares of the global batch) is never allowed to exceed this in magnitude
_INTEGRAL_LIMIT = 1.0
# the step-time model: each rank's last _MODEL_WINDOW intervals (StepTimes)
_MODEL_WINDOW = 8


def _capped_bounds(
    current: Sequence[int], lower: Sequence[int], upper: Sequence[int | None], max_change: float
) -> tuple[list[int], list[int | None]]:
    """The hard bounds narrowed to ``[b (1 - max_change), b (1 + max_change)]`` around each current size."""
    low: list[int] = []
    high: list[int | None] = []
    for b, lo, hi in zip(current, lower, upper):
        cap_lo = max(lo, math.ceil(b * (1.0 - max_change) - 1e-9))
        cap_hi = math.floor(b * (1.0 + max_change) + 1e-9)
        cap_hi = cap_hi if hi is None else min(hi, cap_hi)
        if cap_lo > cap_hi:  # the current size lies outside the hard bounds: they win
            low.append(lo)
            high.append(hi)
        else:
            low.append(cap_lo)
            high.append(cap_hi)
    return low, high


def _equal_time(
    models: list[tuple[float, float]] | None, total: int, lower: Sequence[int], upper: Sequence[int | None]
) -> list[float] | None:
    """The unrounded split of ``total`` at which ``(fixed, per_sample)`` models finish together; ``None`` without."""
    if models is None or len(models) != len(lower):
        return None
    sizes = equal_time_sizes(total, [a for a, _ in models], [c for _, c in models], lower, upper)
    return sizes if sum(sizes) > 0 else None


def _as_bound(value: int | tuple[int, ...] | None) -> int | list[int] | None:
    return list(value) if isinstance(value, tuple) else value


# --------------------------------------------------------------------------------------------------
# the controller
# --------------------------------------------------------------------------------------------------


class PIDController:
    """Equalise every rank's own step time by moving samples from slow ranks to fast ones.

    See the module docstring for the control law. The global batch stays the current one (or
    ``global_batch_size``) exactly, so the optimisation is unchanged; only the split moves.

    Args:
        kp: proportional gain on the share error, > 0. 1.0 moves straight to sizes proportional
            to the measured speeds (one interval when times are proportional to the batch); less
            than 1 moves part of the way; more than 1 overshoots and comes back (it still converges
            below 2 when times are proportional to the batch).
        ki: integral gain, >= 0. Off by default: the update is already incremental, see the
            module docstring.
        kd: derivative gain on the change of the error between intervals, >= 0. Off by default.
        smoothing: weight of the past in the exponential moving average of each rank's speed,
            in ``[0, 1)``; 0 uses the last interval's speeds alone.
        restart_threshold: a rank's newly measured speed that differs from its average by more than
            this fraction of the average replaces the average instead of joining it (a sudden
            slowdown or recovery); > 0, or ``None`` to always average.
        dead_band: keep the current sizes exactly when every rank's relative change
            ``|b' - b| / b`` would be below this, in ``[0, 1)``, while the gate cannot judge a move yet (a
            rank's noise not measured) and the target is not the ranks' fitted models': absorbs what one
            interval's noise could have made. A deviation the gate measured is followed inside it.
        min_batch_size: smallest size of a rank, samples: one int for all ranks, one per rank, or
            ``None`` (default) for the state's alone. Intersected with ``ClusterState.min_batch_size``
            (the strategy's); 0 lets the controller sit a rank out.
        max_batch_size: largest size of a rank, samples: one int, one per rank, or ``None`` for no
            limit. Intersected with ``ClusterState.max_batch_size``.
        global_batch_size: the global batch to keep, samples; ``None`` keeps the current one
            (the sum of the sizes in each state). If the bounds cannot hold it, the closest total
            they allow is used.
        max_change: cap on the relative change of any rank's size in one interval (e.g. 0.5:
            at most +-50%), > 0; ``None`` for no cap. The global batch and the bounds take
            precedence where the cap would make them impossible.
        lr_scaling: learning-rate rule when the global batch differs from the one of the first
            state seen (with ``global_batch_size`` or ``max_global_batch_size``); one of
            :data:`~lightning_dynamix.control.lr_scaling.LR_SCALING_RULES`.
        max_global_batch_size: let the global batch grow up to this many samples while the all-reduce takes
            more than ``max_comm_share`` of the step (the module docstring); ``None`` (default) keeps it.
            At least ``global_batch_size`` where that is given.
        max_comm_share: the share of the step the all-reduce may take before the global batch grows, in
            ``(0, 1)``; only with ``max_global_batch_size``.
        noise_gate: move the split only on a deviation measured beyond the noise: the slowest rank's excess
            over the others at the current split beyond this many standard errors and in its last two
            intervals (or the balance found moved by the CUSUMs), with a predicted gain over 1%
            (``step_times.gate_holds``), >= 0; ``None`` to move whenever the dead band allows.
        adaptive_gain: use the ranks' measured response to the sizes: each step divided by the response
            to the previous one (the secant gain of the module docstring, at most 3x) and, once fitted,
            the target from each rank's fixed and per-sample cost, so that affine step times converge
            in a few intervals; ``False`` for the plain proportional law.

    Raises:
        ValueError: naming the argument, the value and what is valid, for any bad argument.
    """

    def __init__(
        self,
        kp: float = 1.0,
        ki: float = 0.0,
        kd: float = 0.0,
        smoothing: float = 0.5,
        restart_threshold: float | None = 0.5,
        dead_band: float = 0.1,
        min_batch_size: int | Sequence[int] | None = None,
        max_batch_size: int | Sequence[int] | None = None,
        global_batch_size: int | None = None,
        max_change: float | None = None,
        lr_scaling: str = "none",
        adaptive_gain: bool = True,
        noise_gate: float | None = 3.5,
        max_global_batch_size: int | None = None,
        max_comm_share: float = 0.2,
    ) -> None:
        self.kp = require_number("kp", kp, 0.0, math.inf, low_open=True, high_open=True)
        self.ki = require_number("ki", ki, 0.0, math.inf, low_open=False, high_open=True)
        self.kd = require_number("kd", kd, 0.0, math.inf, low_open=False, high_open=True)
        self.smoothing = require_number("smoothing", smoothing, 0.0, 1.0, low_open=False, high_open=True)
        if restart_threshold is not None:
            restart_threshold = require_number(
                "restart_threshold", restart_threshold, 0.0, math.inf, low_open=True, high_open=True
            )
        self.restart_threshold = restart_threshold
        self.dead_band = require_number("dead_band", dead_band, 0.0, 1.0, low_open=False, high_open=True)
        self.min_batch_size = validate_bound(min_batch_size, "min_batch_size", allow_none=True, low=0)
        self.max_batch_size = validate_bound(max_batch_size, "max_batch_size", allow_none=True)
        validate_bound_pair(self.min_batch_size, self.max_batch_size)
        if global_batch_size is not None and (
            isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1
        ):
            raise ValueError(
                f"`global_batch_size` must be an int >= 1 (samples over all ranks) or None to keep the current"
                f" global batch, got {global_batch_size!r}."
            )
        self.global_batch_size = global_batch_size
        if max_change is not None:
            max_change = require_number("max_change", max_change, 0.0, math.inf, low_open=True, high_open=True)
        self.max_change = max_change
        self.lr_scaling = validate_lr_scaling(lr_scaling)
        require_bool("adaptive_gain", adaptive_gain)
        self.adaptive_gain = adaptive_gain
        if noise_gate is not None:
            noise_gate = require_number("noise_gate", noise_gate, 0.0, math.inf, low_open=False, high_open=True)
        self.noise_gate = noise_gate
        if max_global_batch_size is not None and (
            isinstance(max_global_batch_size, bool)
            or not isinstance(max_global_batch_size, int)
            or max_global_batch_size < (global_batch_size or 1)
        ):
            raise ValueError(
                f"`max_global_batch_size` must be an int >= {global_batch_size or 1}"
                f"{' (global_batch_size)' if global_batch_size else ''} or None to keep the global batch,"
                f" got {max_global_batch_size!r}."
            )
        self.max_global_batch_size = max_global_batch_size
        self.max_comm_share = require_number("max_comm_share", max_comm_share, 0.0, 1.0, low_open=True, high_open=True)
        self._speeds: list[float] | None = None
        self._speed_sizes: list[int] = []
        self._last_step: dict[str, list[float]] | None = None
        self._integral: list[float] = []
        self._previous_error: list[float] | None = None
        self._base_global_batch: int | None = None
        self._step_times = StepTimes(_MODEL_WINDOW)
        self._work = MeanWork()

    def decide(self, state: ClusterState) -> Decision:
        """New per-rank sizes from one interval's measurements (see the module docstring)."""
        state = self._work.observe(state)  # times per unit of work where ranks counted it (a language model's tokens)
        current = state.batch_sizes
        n = state.world_size
        lower, upper = resolve_bounds(state, self.min_batch_size, self.max_batch_size)
        if self._base_global_batch is None:
            self._base_global_batch = state.global_batch
        total = self.global_batch_size if self.global_batch_size is not None else state.global_batch
        if self.max_global_batch_size is not None:
            total = self._network_global_batch(state)

        busy = arrival_times(state)
        if busy is None:
            return self._decision(current, state)
        self._step_times.observe(current, busy)
        measured = [b / t if b > 0 else 0.0 for b, t in zip(current, busy)]
        if self._speeds is None or len(self._speeds) != n or len(self._integral) != n:
            self._speeds = measured
            self._integral = [0.0] * n
            self._previous_error = None
        else:
            # a speed measured at another size is another operating point (times may be affine in the
            # batch), and one far from the average is a rank that changed: average only over intervals
            # at the current size and a similar speed, so smoothing never adds lag
            # a jump is followed once the next interval confirms it (a suspect alone is averaged in)
            a = self.smoothing
            # a change the step model confirmed restarts the average too (it held the suspect interval)
            kept = [
                b == b_old and not changed and (suspect or not self._jumped(old, new))
                for old, new, b, b_old, suspect, changed in zip(
                    self._speeds,
                    measured,
                    current,
                    self._speed_sizes,
                    self._step_times.suspect,
                    self._step_times.changed,
                )
            ]
            self._speeds = [
                a * old + (1.0 - a) * new if k else new for old, new, k in zip(self._speeds, measured, kept)
            ]
        self._speed_sizes = list(current)

        share = [b / state.global_batch for b in current]
        # sizes a rank was measured too slow or too fast at bracket its balance: proposals stay inside
        inner_low, inner_high = self._step_times.bracketed(lower, upper, total)
        modelled = _equal_time(self.step_models(), total, inner_low, inner_high) if self.adaptive_gain else None
        if modelled is not None:
            target = [b / sum(modelled) for b in modelled]
        else:
            speed_sum = sum(self._speeds)
            target = [s / speed_sum for s in self._speeds]
        error = [p - q for p, q in zip(target, share)]
        previous = self._previous_error if self._previous_error is not None else error
        self._previous_error = error
        # the secant compares errors of the raw measurements: the smoothed one lags a change of speed
        measured_sum = sum(measured)
        raw_error = [s / measured_sum - q for s, q in zip(measured, share)]
        gains = self._secant_gains(raw_error, current) if modelled is None else [1.0] * n
        integral = [i + e for i, e in zip(self._integral, error)]
        desired = [
            q + self.kp * g * e + self.ki * i + self.kd * (e - e_prev)
            for q, g, e, i, e_prev in zip(share, gains, error, integral, previous)
        ]
        weights = [max(d, _MIN_SHARE) for d in desired]
        low, high = inner_low, inner_high
        split = proportional_fill(weights, total, low, high)
        if self.max_change is not None:
            capped_low, capped_high = _capped_bounds(current, inner_low, inner_high, self.max_change)
            capped = proportional_fill(weights, total, capped_low, capped_high)
            if abs(sum(capped) - sum(split)) < 0.5:
                split, low, high = capped, capped_low, capped_high
        proposal = round_to_total(split, total, low, high)

        # the dead band is judged on the unrounded split, so that one sample of rounding on a small
        # batch (1 of 12 is 8%) cannot make the sizes flap
        feasible = sum(current) == sum(proposal) and all(
            lo <= b and (hi is None or b <= hi) for b, lo, hi in zip(current, lower, upper)
        )
        # the dead band holds what the noise could have made while the gate cannot judge it yet; a split the ranks'
        # fitted models give (each rank measured at two sizes) is their answer, not noise, and is not held by it
        within_dead_band = modelled is None and all(
            abs(x - b) / max(b, 1) < self.dead_band for x, b in zip(split, current)
        )
        # a deviation the gate measured (beyond the noise, in one direction) is followed even inside the dead band
        gate = self._gate(current, proposal) if feasible else None
        if gate is False:  # a measured deviation: the sizes left bracket the balance from now on
            self._step_times.bracket(current, proposal)
        if feasible and (gate is True or (within_dead_band and gate is None)):
            self._last_step = None
            self._integral = [0.0] * n
            return self._decision(current, state)
        new_total = sum(proposal)
        self._last_step = {
            "share": share,
            "change": [b_new / new_total - q for b_new, q in zip(proposal, share)],
            "error": raw_error,
            "sizes": [float(b) for b in proposal],
        }

        # conditional integration: a rank pinned at a bound against its error keeps its integral
        weight_sum = sum(weights)
        for i in range(n):
            wanted = weights[i] / weight_sum * sum(proposal)
            pinned_high = high[i] is not None and proposal[i] >= high[i] and wanted > proposal[i]  # type: ignore[operator]
            pinned_low = proposal[i] <= low[i] and wanted < proposal[i]
            if not (pinned_high or pinned_low):
                self._integral[i] = max(-_INTEGRAL_LIMIT, min(_INTEGRAL_LIMIT, integral[i]))
        return self._decision(proposal, state)

    def _network_global_batch(self, state: ClusterState) -> int:
        """The global batch at which the all-reduce takes ``max_comm_share`` of the step (module docstring)."""
        assert self.max_global_batch_size is not None
        base = self.global_batch_size if self.global_batch_size is not None else self._base_global_batch
        base = min(base or state.global_batch, self.max_global_batch_size)
        current = state.global_batch
        transfer, step = state.bare_transfer_time, state.step_time
        own = step - transfer
        if not (math.isfinite(transfer) and math.isfinite(own) and own > 0 and current > 0):
            return min(max(current, base), self.max_global_batch_size)
        share = self.max_comm_share
        wanted = current * transfer * (1.0 - share) / (share * own)
        target = min(max(wanted, base), self.max_global_batch_size)
        if base <= current <= self.max_global_batch_size and abs(target - current) < self.dead_band * current:
            return current
        return round(target)

    def step_models(self) -> list[tuple[float, float]] | None:
        """Every rank's ``(fixed, per_sample)`` step cost in seconds, anchored at the split the job runs
        (``StepTimes.models``); ``None`` until every rank has run at two sizes at least 10% apart among its recent
        intervals (see the module docstring)."""
        if not self._step_times.has_slopes:
            return None
        models = self._step_times.models()
        return None if any(m is None for m in models) else models  # type: ignore[return-value]

    def cost_models(self) -> list[tuple[float, float]] | None:
        """:meth:`step_models` where fitted, else each rank's step proportional to its batch at its smoothed
        speed, ``(0, 1 / s)``; ``None`` before the first measurement (or with a rank never seen training)."""
        models = self.step_models()
        if models is None and self._speeds is not None and all(s > 0 for s in self._speeds):
            models = [(0.0, 1.0 / s) for s in self._speeds]
        return models

    def predicted_step(self, sizes: Sequence[int]) -> float | None:
        """The slowest training rank's step at ``sizes`` by :meth:`cost_models`, seconds; ``None`` without them."""
        models = self.cost_models()
        if models is None or len(models) != len(sizes):
            return None
        return max((a + c * b for (a, c), b in zip(models, sizes) if b > 0), default=None)

    def balanced_split(self, total: int, lower: Sequence[int], upper: Sequence[int | None]) -> tuple[int, ...] | None:
        """``total`` samples split so that :meth:`cost_models` finish together, within bounds; ``None`` without them."""
        sizes = _equal_time(self.cost_models(), total, lower, upper)
        return None if sizes is None else round_to_total(sizes, total, lower, upper)

    def within_noise(self, current: Sequence[int], proposal: Sequence[int]) -> bool:
        """Whether moving from ``current`` to ``proposal`` (the same global batch) should wait: the slowest rank's
        excess over the others, measured at ``current`` over the intervals there (``StepTimes.imbalance``), is at
        most ``noise_gate`` standard errors of what the measurements' noise explains, or it did not keep its
        direction in the last two intervals (``StepTimes.persists``), or the proposal does not take samples
        from it (module docstring). A deviation that keeps its direction passes once enough intervals
        averaged; noise does not. ``False`` without a gate or while a rank's noise is not measured yet."""
        return self._gate(current, proposal) is True

    def _gate(self, current: Sequence[int], proposal: Sequence[int]) -> bool | None:
        """:meth:`within_noise`, or ``None`` where the gate cannot judge (no gate, a rank's noise not measured
        yet); ``False`` for a deviation measured beyond the noise that the proposal answers."""
        if self.noise_gate is None:
            return None
        return gate_holds(self._step_times, current, proposal, self.noise_gate)

    def _jumped(self, average: float, measured: float) -> bool:
        """Whether a new speed is so far from the average that the rank itself changed."""
        return self.restart_threshold is not None and abs(measured - average) > self.restart_threshold * average

    def _secant_gains(self, error: Sequence[float], sizes: Sequence[int]) -> list[float]:
        """Per-rank gain ``1 / m`` from the error's response ``m`` to the change decided one interval ago."""
        gains = [1.0] * len(error)
        step = self._last_step
        # only valid if the sizes measured now are the ones that change led to
        if not self.adaptive_gain or step is None or [int(b) for b in step["sizes"]] != list(sizes):
            return gains
        for i, e_now in enumerate(error):
            q_before, e_before = step["share"][i], step["error"][i]
            dq = step["change"][i]
            # evidence only from a step that is large against the noise and fell short (same sign)
            if abs(dq) < _SECANT_MIN_STEP * q_before or e_before * e_now <= 0 or e_before * dq <= 0:
                continue
            slope = (e_before - e_now) / dq
            if slope > 0:
                gains[i] = min(max(1.0 / slope, 1.0), _MAX_SECANT_GAIN)
        return gains

    def _decision(self, sizes: Sequence[int], state: ClusterState) -> Decision:
        base = self._base_global_batch or sum(sizes)
        scale = lr_scale(self.lr_scaling, sum(sizes), base, state.gradient_noise_scale)
        return Decision(batch_sizes=tuple(sizes), lr_scale=scale)

    def regroup(self, previous: Sequence[int | None]) -> None:
        """The job now runs on another group: ``previous[i]`` is new rank ``i``'s old rank, ``None`` for a new machine.

        A machine that stays keeps its smoothed speed, a new one starts from the mean of theirs; the
        integral, the last error and the secant's evidence belong to the old split and are dropped,
        and the next measured speeds replace the averages (the sizes differ), so the next decision is
        made from the first interval measured on the new group; the step model is refitted from the
        new group's intervals.
        """
        if self._speeds is None:
            return
        mapping = validate_previous(previous, len(self._speeds))
        self._speeds = regroup_values(self._speeds, mapping)
        self._speed_sizes = [0] * len(mapping)  # no real size: the next measurement replaces every average
        self._integral = [0.0] * len(mapping)
        self._previous_error = None
        self._last_step = None
        self._step_times = StepTimes(_MODEL_WINDOW)  # as the speeds: the model is refitted from the new group's

    def rank_speeds(self) -> list[float] | None:
        """Every rank's smoothed own speed, samples/s; ``None`` before the first measurement."""
        return None if self._speeds is None else list(self._speeds)

    def state_dict(self) -> dict[str, Any]:
        """Smoothed speeds (samples/s), integral and last error (shares), base global batch (samples)."""
        return {
            "speeds": None if self._speeds is None else list(self._speeds),
            "speed_sizes": list(self._speed_sizes),
            "last_step": None if self._last_step is None else {k: list(v) for k, v in self._last_step.items()},
            "integral": list(self._integral),
            "previous_error": None if self._previous_error is None else list(self._previous_error),
            "base_global_batch": self._base_global_batch,
            "observations": self._step_times.state_dict(),
            "work": self._work.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, so the next decision is the one the saved controller would make."""
        speeds = state_dict.get("speeds")
        self._speeds = None if speeds is None else [float(s) for s in speeds]
        self._speed_sizes = [int(b) for b in state_dict.get("speed_sizes", [])]
        step = state_dict.get("last_step")
        self._last_step = None if step is None else {k: [float(x) for x in v] for k, v in step.items()}
        self._integral = [float(i) for i in state_dict.get("integral", [])]
        previous = state_dict.get("previous_error")
        self._previous_error = None if previous is None else [float(e) for e in previous]
        base = state_dict.get("base_global_batch")
        self._base_global_batch = None if base is None else int(base)
        self._step_times.load_state_dict(state_dict.get("observations", []))
        self._work.load_state_dict(state_dict.get("work", {}))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(kp={self.kp}, ki={self.ki}, kd={self.kd}, smoothing={self.smoothing},"
            f" restart_threshold={self.restart_threshold}, dead_band={self.dead_band},"
            f" min_batch_size={_as_bound(self.min_batch_size)!r},"
            f" max_batch_size={_as_bound(self.max_batch_size)!r}, global_batch_size={self.global_batch_size},"
            f" max_change={self.max_change}, lr_scaling={self.lr_scaling!r}, adaptive_gain={self.adaptive_gain},"
            f" noise_gate={self.noise_gate}, max_global_batch_size={self.max_global_batch_size},"
            f" max_comm_share={self.max_comm_share})"
        )
