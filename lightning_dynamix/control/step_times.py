"""What each rank's step costs at each batch size, measured, and whether a measured deviation is more than noise.

:class:`StepTimes` keeps every rank's recent ``(batch size, step time)`` intervals: its step model (a fixed and a
per-sample cost, anchored where the job runs), its noise, the intervals at the current split and the CUSUMs that
say when the balance moved. :func:`gate_holds` is the gate every controller's split moves pass (pid, goodput, and
ppo through its balancer): it follows a deviation that keeps its direction and holds what noise alone explains.
:func:`equal_time_split` splits a global batch so that the models finish together.

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/control/step_times.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from lightning_dynamix.control.allocation import round_to_total

# relative distance between an observation and the model's prediction beyond which the rank's
# speed is taken to have changed and its older observations are forgotten
_SPEED_CHANGE_TOLERANCE = 0.25
# a rank's step model is fitted once its observations span sizes at least this far apart (relative to the largest)
_MODEL_MIN_SPREAD = 0.1
# a slope that is not two standard errors above 0 is taken as at least 1 / this of the proportional one (a fixed cost
# of at most 2/3 of the step, as pid's secant gain assumes)
_MAX_FIXED_SHARE_GAIN = 3.0
MIN_GAIN = 0.01
"""The least predicted relative gain of the step that a move of the split made on a measured deviation must offer."""
# the intervals at one split counted at most (a slow drift is then followed), and the pairs of successive
# intervals a rank's noise is estimated from (at least _MIN_PAIRS; before, its scatter about its fit)
_RUN_LIMIT = 64
_PAIR_LIMIT = 64
_MIN_PAIRS = 4
# after a confirmed change, the move on its measured level and the one on the slope that move measured (as at
# the start) are not gated
_AFTER_CHANGE = 2
# the CUSUMs of each rank's change of excess (slack, clip and limit in standard deviations; the slack also widened
# by the baseline's own error): noise alone passes the limit about once in 8,000 intervals of two ranks, a shift of
# three standard deviations in about 4, of four in about 3 (scripts/cusum_rates.py)
_CUSUM_SLACK = 0.5
_CUSUM_CLIP = 4.0
_CUSUM_LIMIT = 7.0


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
    """Each rank's last ``window`` ``(size, time)`` observations of its step, the data of its model, and what the
    gate judges a move by: the intervals at the current split, each rank's noise, the CUSUMs of the balance.

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

    The rest (the anchored models, the noise from successive intervals, the imbalance at the split, the CUSUMs
    and the brackets): ``docs/internals.md``, section ``lightning_dynamix/control/step_times.py``.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.ranks: list[list[tuple[int, float]]] = []
        self._off: list[float] = []  # per rank: a suspect's relative distance from the model, 0 for none
        self.changed: list[bool] = []
        """Per rank: whether its last observation confirmed a change (its older observations forgotten)."""
        # the times of every rank in the intervals at the current split since it last changed (or a rank changed,
        # or the CUSUMs found the ranks' balance moved), at most _RUN_LIMIT; and each rank's per-sample cost from
        # its last fit over two sizes (kept once the window holds one size only)
        self._split: tuple[int, ...] = ()
        self._run: list[tuple[float, ...]] = []
        self._slopes: list[float | None] = []
        # per rank: the root of the summed squared distances of its sizes from their mean, and its mean time, in the
        # fit its slope came from: with its noise, the slope's standard error
        self._slope_fit: list[tuple[float, float]] = []
        # per rank: the squared relative differences of its last _PAIR_LIMIT pairs of successive intervals at one
        # size: its noise, which a level that moved once barely inflates (one pair in many)
        self._pairs: list[list[float]] = []
        self._suspect_pair: list[bool] = []
        self._since_change = _AFTER_CHANGE  # intervals since a rank last changed (counted up to this)
        # per rank: the CUSUMs of its excess upwards and downwards, and where in the run each last left 0
        self._drift: list[tuple[float, float, int, int]] = []
        self.deviation: tuple[int, int] | None = None
        """The rank whose change of excess over the others the CUSUMs found in the last interval, and its sign (+1:
        slower than the rest, -1: faster); ``None`` for none."""
        # per rank: the least size it was too slow at and the largest it was too fast at, for one global batch
        self._above: list[int | None] = []
        self._below: list[int | None] = []
        self._bracket_total = 0

    @property
    def settling(self) -> bool:
        """Whether a rank changed (:attr:`changed`) in the last interval or the one before: its new model is being
        measured, its first two moves (on its level, then on the slope the first one shows) are not gated."""
        return self._since_change < _AFTER_CHANGE

    @property
    def suspect(self) -> list[bool]:
        """Per rank: whether its last observation was off its model and not (yet) confirmed by another."""
        return [off != 0.0 for off in self._off]

    def observe(self, sizes: Sequence[int], times: Sequence[float]) -> None:
        """Add one interval's size and time per rank (a new number of ranks starts every rank afresh)."""
        if len(self.ranks) != len(sizes):  # another group without regroup(): nothing carries over
            self.ranks = [[] for _ in sizes]
            self._off = [0.0] * len(sizes)
            self._slopes = [None] * len(sizes)
            self._slope_fit = [(0.0, 0.0)] * len(sizes)
            self._pairs = [[] for _ in sizes]
            self._suspect_pair = [False] * len(sizes)
            self._split = ()
        if tuple(sizes) != self._split:
            self._split = tuple(int(b) for b in sizes)
            self._run = []
        self.changed = [False] * len(sizes)
        self.deviation = None
        self._since_change = min(self._since_change + 1, _AFTER_CHANGE)
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
                        if self._suspect_pair[r] and self._pairs[r]:  # the jump is no measure of the noise
                            self._pairs[r].pop()
                        obs.clear()
                        # the change put on the per-sample cost alone: exact where only that changed, and where the
                        # fixed cost changed too (one factor on both) too steep, so the move undershoots, never over
                        slope = self._slopes[r]
                        steeper = None if slope is None else slope + off * predicted / b
                        self._slopes[r] = steeper if steeper is not None and steeper > 0 else None
                        self.changed[r] = True
                        self._since_change = 0
                        self._forget_bracket()
                        self._run = []
                    else:
                        self._off[r] = off
            self._suspect_pair[r] = False
            if obs and obs[-1][0] == b and obs[-1][1] + t > 0:
                pairs = self._pairs[r]
                pairs.append(((t - obs[-1][1]) / (0.5 * (t + obs[-1][1]))) ** 2)
                del pairs[:-_PAIR_LIMIT]
                # a suspect's pair with the interval before: dropped if the next confirms a change (not noise)
                self._suspect_pair[r] = self._off[r] != 0.0
            obs.append((int(b), float(t)))
            del obs[: -self.window]
            observed = [size for size, _ in obs]
            if max(observed) - min(observed) >= _MODEL_MIN_SPREAD * max(observed):
                self._slopes[r] = fit_step_time(obs)[1]
                mean_size = sum(observed) / len(observed)
                self._slope_fit[r] = (  # what the slope's error is judged by: the sizes' spread, the mean time
                    math.sqrt(sum((b - mean_size) ** 2 for b in observed)),
                    sum(t for _, t in obs) / len(obs),
                )
        if not self._run:
            self._drift = [(0.0, 0.0, 0, 0)] * len(sizes)
        self._run.append(tuple(float(t) for t in times))
        if len(self._run) > _RUN_LIMIT:
            del self._run[0]
            self._drift = [(u, d, max(us - 1, 0), max(ds - 1, 0)) for u, d, us, ds in self._drift]
        self._follow_balance(sizes)

    def bracket(self, current: Sequence[int], proposal: Sequence[int]) -> None:
        """Remember a move made on a measured deviation: a rank that gives samples was too slow at its size (its
        balance lies below), one that takes them too fast (above). Forgotten when a rank changes, the balance
        moves (:attr:`deviation`), or another global batch is split."""
        if len(self._above) != len(current) or self._bracket_total != sum(current):
            self._above, self._below = [None] * len(current), [None] * len(current)
            self._bracket_total = sum(current)
        for r, (b, b_new) in enumerate(zip(current, proposal)):
            if b_new < b:
                self._above[r] = b if self._above[r] is None else min(self._above[r], b)  # type: ignore[type-var]
            elif b_new > b:
                self._below[r] = b if self._below[r] is None else max(self._below[r], b)  # type: ignore[type-var]

    def bracketed(
        self, lower: Sequence[int], upper: Sequence[int | None], total: int
    ) -> tuple[list[int], list[int | None]]:
        """``lower`` and ``upper`` narrowed to strictly inside each rank's bracket (:meth:`bracket`), where they can
        still hold ``total``; as given otherwise. Moves made on small measured deviations then close in on the
        balance instead of going back and forth across it (a slope fitted from noisy intervals overshoots)."""
        if len(self._above) != len(lower) or self._bracket_total != total:
            return list(lower), list(upper)
        low = [lo if below is None else max(lo, below + 1) for lo, below in zip(lower, self._below)]
        high: list[int | None] = [
            hi if above is None else (above - 1 if hi is None else min(hi, above - 1))
            for hi, above in zip(upper, self._above)
        ]
        fits = all(h is None or lo <= h for lo, h in zip(low, high)) and sum(low) <= total
        fits = fits and (any(h is None for h in high) or sum(h for h in high if h is not None) >= total)
        return (low, high) if fits else (list(lower), list(upper))

    def _forget_bracket(self) -> None:
        self._above, self._below, self._bracket_total = [], [], 0

    def _slope_is_firm(self, r: int, slope: float) -> bool:
        """Whether rank ``r``'s fitted per-sample cost stands at least two standard errors above 0, its error from
        the rank's noise and the spread of the sizes it was fitted over; ``False`` while its noise is unknown."""
        variance = self._rank_scatter(r)
        spread, mean_time = self._slope_fit[r] if r < len(self._slope_fit) else (0.0, 0.0)
        if variance is None or spread <= 0:  # nothing to judge it by: not trusted beyond the bound
            return False
        return slope > 2.0 * math.sqrt(variance) * mean_time / spread

    def _follow_balance(self, sizes: Sequence[int]) -> None:
        """Add the interval to each rank's CUSUMs of the change of its excess over the interval's mean (against the
        run's earlier intervals, so a split that whole samples cannot balance counts nothing); where one passes its
        limit the balance moved: :attr:`deviation` says where, and the run keeps only the intervals since that
        CUSUM last left 0 (so the models anchored at the run see the split as it now is)."""
        training = [r for r, b in enumerate(sizes) if b > 0]
        variances = self.scatter(sizes)
        earlier = len(self._run) - 1  # the run's intervals before this one
        if variances is None or len(training) < 2 or earlier < 2 or any(variances[r] is None for r in training):
            return
        n = len(training)
        # every interval's excess of each training rank over that interval's mean, once (the run is the current
        # interval's last row): a decision at 64 ranks stays a few milliseconds
        run = np.asarray(self._run, dtype=np.float64)[:, training]
        means = run.mean(axis=1, keepdims=True)
        excess = np.divide(run - means, means, out=np.zeros_like(run), where=means > 0)
        baselines = excess[:-1].mean(axis=0)
        spread = sum(variances[r] for r in training) / n**2  # type: ignore[misc]
        index = earlier  # where this interval stands in the run
        for column, r in enumerate(training):
            own = variances[r]  # type: ignore[assignment]
            deviation = math.sqrt(own * (1.0 - 1.0 / n) ** 2 + spread - own / n**2)  # type: ignore[operator]
            deviation *= math.sqrt(1.0 + 1.0 / earlier)  # against a baseline of `earlier` intervals
            if deviation <= 0:
                continue
            # clipped, so that one wild interval (a rank descheduled once) cannot pass the limit alone: two can
            z = float(excess[-1, column] - baselines[column]) / deviation
            z = max(-_CUSUM_CLIP, min(_CUSUM_CLIP, z))
            up, down, up_start, down_start = self._drift[r]
            up_start = index if up == 0.0 else up_start
            down_start = index if down == 0.0 else down_start
            # the baseline's own error would bias every later z alike (a drift the slack alone would not absorb):
            # its standard error, in the same units, widens the slack
            slack = _CUSUM_SLACK + 1.0 / math.sqrt(earlier)
            up, down = max(0.0, up + z - slack), max(0.0, down - z - slack)
            self._drift[r] = (up, down, up_start, down_start)
            if up > _CUSUM_LIMIT or down > _CUSUM_LIMIT:
                self.deviation = (r, 1 if up > _CUSUM_LIMIT else -1)
                self._forget_bracket()
                del self._run[: up_start if up > _CUSUM_LIMIT else down_start]
                self._drift = [(0.0, 0.0, 0, 0)] * len(sizes)
                return

    def scatter(self, sizes: Sequence[int]) -> list[float | None] | None:
        """Each rank's relative variance of one interval's step: its measurements' own noise.

        Once a rank has at least 4 pairs of successive intervals at one size among its last 64: half their mean
        squared relative difference, which a level that moved once barely inflates (one pair in many; the pair
        across a confirmed change is dropped). Before, its scatter about its fitted model,
        ``sum((t - m(b)) / m(b))^2 / (n - p)`` over its ``n`` observations (``p``: 1 at one size, 2 fitted affine),
        ``None`` with fewer than two degrees of freedom. 0.0 for a rank without samples in ``sizes``; ``None``
        for another number of ranks.
        """
        if len(self.ranks) != len(sizes):
            return None
        return [0.0 if b == 0 else self._rank_scatter(r) for r, b in enumerate(sizes)]

    def _rank_scatter(self, r: int) -> float | None:
        pairs = self._pairs[r] if r < len(self._pairs) else []
        if len(pairs) >= _MIN_PAIRS:  # half the mean squared difference of successive intervals
            return sum(pairs) / (2 * len(pairs))
        return _relative_variance(self.ranks[r])

    def models(self) -> list[tuple[float, float] | None]:
        """Each rank's step model ``(fixed, per_sample)`` in seconds, anchored where it runs now: ``None`` for a
        rank never observed.

        The per-sample cost is the slope of the rank's last fit over two sizes at least 10% apart (kept when its
        recent intervals all ran at one size); without one, the step is taken as proportional to the batch. The
        model then passes through the mean of the rank's intervals at its current size (since it last changed
        size or changed itself), not through the fit: where the step is not quite affine, or the rank drifted by
        less than a change, the fit's level is off at the split the job runs, by the same amount every interval;
        anchored there, the model's balance is where the measurements put it (a Newton step from the current
        split, with the fit's slope).
        """
        models: list[tuple[float, float] | None] = []
        for r, (obs, slope) in enumerate(zip(self.ranks, self._slopes)):
            run = self._run_times(r)
            if not obs:
                models.append(None)
                continue
            size = obs[-1][0]
            level = sum(run) / len(run) if run else obs[-1][1]
            # a slope fitted from a few noisy intervals at nearby sizes can come out far too flat, and a move by it
            # overshoots by as much: one not two standard errors above 0 is taken as at least a third of the
            # proportional one (a fixed cost of at most 2/3 of the step, as pid's secant gain assumes), and right
            # after a change, when least is known, as the proportional one (a move that undershoots, never over)
            if slope is None:
                per_sample = level / size
            elif not self._slope_is_firm(r, slope):
                per_sample = max(slope, level / (1.0 if self.settling else _MAX_FIXED_SHARE_GAIN) / size)
            else:
                per_sample = slope
            fixed = level - per_sample * size
            models.append((fixed, per_sample) if fixed >= 0 else (0.0, level / size))
        return models

    @property
    def has_slopes(self) -> bool:
        """Whether every rank's per-sample cost is measured (it ran at two sizes at least 10% apart)."""
        return bool(self._slopes) and all(slope is not None for slope in self._slopes)

    def gain_error(
        self, current: Sequence[int], proposal: Sequence[int], models: Sequence[tuple[float, float]]
    ) -> float | None:
        """The standard error of the predicted gain ``1 - T(proposal) / T(current)`` from the measurements' noise.

        ``T`` is the slowest rank's step by ``models`` (anchored at ``current``, :meth:`models`). Rank ``r``'s
        step at ``current`` is the mean of its ``n_r`` intervals there, so its variance is ``scatter_r t_r^2 /
        n_r`` (:meth:`scatter`). ``T(current)`` is the slowest rank ``s``'s; ``T(proposal)``, the time at which the
        ranks finish together, moves with each rank's level by its share of the ranks' speed, ``w_r = (1 / c_r) /
        sum_j (1 / c_j)`` over the ranks with samples in ``proposal``. So the gain's variance is ``(1 - w_s)^2 v_s +
        sum_{r != s} w_r^2 v_r`` over ``T(current)^2``: with two equal ranks half the spread of one rank's mean,
        which a bias of the split shows (rather than their sum). ``None`` while a rank's scatter is unknown.
        """
        variances = self.scatter(current)
        if variances is None or len(models) != len(current):
            return None
        times = [a + c * b if b > 0 else 0.0 for (a, c), b in zip(models, current)]
        slowest = max(range(len(current)), key=lambda r: times[r])
        speeds = [1.0 / c if b > 0 and c > 0 else 0.0 for (_, c), b in zip(models, proposal)]
        total_speed = sum(speeds)
        if times[slowest] <= 0 or total_speed <= 0:
            return None
        variance = 0.0
        for r, (b, scatter, t, speed) in enumerate(zip(current, variances, times, speeds)):
            if b == 0:
                continue
            if scatter is None:
                return None
            weight = speed / total_speed
            if r == slowest:
                weight = 1.0 - weight
            variance += weight * weight * scatter * t * t / max(len(self._run), 1)
        return math.sqrt(variance) / times[slowest]

    def imbalance(self, sizes: Sequence[int]) -> tuple[int, float, float] | None:
        """How much longer the slowest rank at ``sizes`` takes than the others, as measured there:
        ``(slowest, excess, standard_error)``, both relative to the slowest rank's step, or ``None`` while a rank
        with samples has no scatter measured (or fewer than two ranks have samples).

        Each rank's step there is the mean of its intervals at its current size since it last changed size or
        changed itself (its run, restarted where a CUSUM finds its level moved); the excess is the slowest mean
        over the mean of the others', and its error follows from each rank's scatter over its run's length. It
        needs no model of how the step grows with the batch: a split off balance shows here whatever slope
        was fitted, and its error shrinks as the intervals at the split accumulate while noise's does not grow.
        """
        variances = self.scatter(sizes)
        training = [r for r, b in enumerate(sizes) if b > 0]
        if variances is None or len(training) < 2 or any(variances[r] is None for r in training):
            return None
        if not self._run or len(self._split) != len(sizes):
            return None
        means = {r: sum(self._run_times(r)) / len(self._run) for r in training}
        slowest = max(training, key=lambda r: means[r])
        others = [r for r in training if r != slowest]
        rest = sum(means[r] for r in others) / len(others)
        variance = variances[slowest] * means[slowest] ** 2  # type: ignore[operator]
        variance += sum(variances[r] * means[r] ** 2 for r in others) / len(others) ** 2  # type: ignore[operator]
        variance /= len(self._run)
        return slowest, (means[slowest] - rest) / means[slowest], math.sqrt(variance) / means[slowest]

    def persists(self, sizes: Sequence[int], slowest: int) -> bool:
        """Whether the slowest rank's excess kept its direction: in each of the last two intervals at ``sizes`` it
        took longer than the other ranks' mean (so never after one interval alone)."""
        others = [r for r, b in enumerate(sizes) if b > 0 and r != slowest]
        if len(self._run) < 2 or not others:
            return False
        return all(t[slowest] > sum(t[r] for r in others) / len(others) for t in self._run[-2:])

    def _run_times(self, r: int) -> list[float]:
        """Rank ``r``'s times in the run: the intervals at the current split (none where it sits out)."""
        if r >= len(self._split) or self._split[r] == 0:
            return []
        return [t[r] for t in self._run]

    def regroup(self, mapping: Sequence[int | None]) -> None:
        """New rank ``i`` keeps old rank ``mapping[i]``'s observations (``None``: a new machine, none); the run at
        the old split ends."""
        self.ranks = [list(obs) for obs in _carried(self.ranks, mapping, [])]
        self._slopes = _carried(self._slopes, mapping, None)
        self._slope_fit = _carried(self._slope_fit, mapping, (0.0, 0.0))
        self._pairs = [list(pairs) for pairs in _carried(self._pairs, mapping, [])]
        self._suspect_pair = [False] * len(mapping)
        self._off = [0.0] * len(mapping)
        self.changed = [False] * len(mapping)
        self._split, self._run, self.deviation = (), [], None
        self._forget_bracket()

    def state_dict(self) -> dict[str, Any]:
        """Everything the next interval is judged by, as plain values: every rank's ``[size, time]`` observations,
        per-sample cost and its fit, noise pairs and pending suspect; the intervals at the current split, the
        CUSUMs, the brackets and the intervals since a change. A restored one decides as the saved one would."""
        return {
            "observations": [[[b, t] for b, t in obs] for obs in self.ranks],
            "slopes": list(self._slopes),
            "slope_fit": [list(f) for f in self._slope_fit],
            "pairs": [list(p) for p in self._pairs],
            "suspect_pair": list(self._suspect_pair),
            "off": list(self._off),
            "split": list(self._split),
            "run": [list(t) for t in self._run],
            "drift": [list(d) for d in self._drift],
            "since_change": self._since_change,
            "bracket": {"above": list(self._above), "below": list(self._below), "total": self._bracket_total},
        }

    def load_state_dict(self, saved: dict[str, Any] | Sequence[Sequence[Sequence[float]]]) -> None:
        """Restore :meth:`state_dict`'s. Saved before the gate (the observations alone, a list): the per-sample
        costs are refitted, and the rest starts afresh."""
        state: dict[str, Any] = saved if isinstance(saved, dict) else {"observations": saved}
        self.ranks = [[(int(b), float(t)) for b, t in obs] for obs in state.get("observations", [])]
        n = len(self.ranks)
        slopes = state.get("slopes")
        if slopes is None:
            slopes = [None] * n
            for r, obs in enumerate(self.ranks):
                observed = [b for b, _ in obs]
                if observed and max(observed) - min(observed) >= _MODEL_MIN_SPREAD * max(observed):
                    slopes[r] = fit_step_time(obs)[1]
        self._slopes = [None if c is None else float(c) for c in slopes]
        self._slope_fit = [(float(a), float(m)) for a, m in state.get("slope_fit", [(0.0, 0.0)] * n)]
        self._pairs = [[float(x) for x in p] for p in state.get("pairs", [[] for _ in range(n)])]
        self._suspect_pair = [bool(x) for x in state.get("suspect_pair", [False] * n)]
        self._off = [float(x) for x in state.get("off", [0.0] * n)]
        self._split = tuple(int(b) for b in state.get("split", []))
        self._run = [tuple(float(x) for x in t) for t in state.get("run", [])]
        self._drift = [(float(u), float(d), int(us), int(ds)) for u, d, us, ds in state.get("drift", [])] or [
            (0.0, 0.0, 0, 0)
        ] * n
        self._since_change = int(state.get("since_change", _AFTER_CHANGE))
        bracket = state.get("bracket", {})
        self._above = [None if b is None else int(b) for b in bracket.get("above", [])]
        self._below = [None if b is None else int(b) for b in bracket.get("below", [])]
        self._bracket_total = int(bracket.get("total", 0))
        self.deviation = None
        self.changed = [False] * n


def _carried(values: Sequence[Any], mapping: Sequence[int | None], default: Any) -> list[Any]:
    """Per new rank, old rank ``mapping[i]``'s value (``default`` for a new machine, or one never observed)."""
    return [values[p] if p is not None and p < len(values) else default for p in mapping]


def _relative_variance(observations: Sequence[tuple[int, float]]) -> float | None:
    """The relative variance of ``(size, time)`` observations about their fitted step model, ``None`` with fewer than
    two degrees of freedom."""
    alpha, beta = fit_step_time(observations) if observations else (0.0, 0.0)
    degrees = len(observations) - (2 if alpha > 0 else 1)
    if degrees < 2:
        return None
    residuals = [(t - (alpha + beta * size)) / (alpha + beta * size) for size, t in observations]
    return sum(r * r for r in residuals) / degrees


def gate_holds(times: StepTimes, current: Sequence[int], proposal: Sequence[int], noise_gate: float) -> bool | None:
    """Whether a move of the split from ``current`` to ``proposal`` (the same global batch) should wait for more
    evidence: ``False`` where the measurements show a deviation that the proposal answers (it takes samples from
    the rank found slower than the rest, or gives them to one found faster), ``True`` where they do not, ``None``
    where they cannot tell yet (a rank's noise not measured).

    A deviation is shown in one of two ways (``docs/internals.md``, the noise gate): the CUSUMs of the ranks'
    excess over each interval's mean found that the balance moved (:attr:`StepTimes.deviation`: a shift of three
    standard deviations of a rank's excess is found in about 4 intervals, noise alone about once in 8,000), or over the
    intervals at the split the slowest rank's excess is beyond ``noise_gate`` standard errors and held its
    direction in the last two (:meth:`StepTimes.imbalance`, :meth:`StepTimes.persists`): a small bias that
    keeps its sign passes as the intervals accumulate.
    """
    if any(times.suspect):  # an interval far off a rank's model waits for the next to say whether it was noise
        return True
    if times.settling:  # a rank changed: the move on its new level, and the one on the slope it shows, are not gated
        return None
    found = times.deviation
    if found is not None:
        rank, sign = found
        if (proposal[rank] - current[rank]) * sign < 0 and _answers(times, current, proposal):
            return False
    measured = times.imbalance(current)
    if measured is None:
        return None if found is None else True
    slowest, excess, error = measured
    return not (
        proposal[slowest] < current[slowest]
        and excess > max(noise_gate * error, 2.0 * MIN_GAIN)  # an excess under 2% gains under 1% balanced
        and times.persists(current, slowest)
        and _answers(times, current, proposal)
    )


def _answers(times: StepTimes, current: Sequence[int], proposal: Sequence[int]) -> bool:
    """Whether ``proposal`` shortens the slowest rank's step by more than 1% by the ranks' models anchored at
    ``current``: a sample moved between two ranks that a whole sample cannot balance only moves the excess to the
    other, and a gain under 1% is not worth a move that the models' slopes may overshoot."""
    models = times.models()
    if any(m is None for m in models) or len(models) != len(current):
        return True
    now = max(a + c * b for (a, c), b in zip(models, current) if b > 0)  # type: ignore[misc]
    then = max(a + c * b for (a, c), b in zip(models, proposal) if b > 0)  # type: ignore[misc]
    return now > 0 and 1.0 - then / now > MIN_GAIN


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
