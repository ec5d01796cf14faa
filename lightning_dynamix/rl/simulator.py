"""A fast model of a heterogeneous data-parallel job that produces the ClusterStates real runs produce.

:class:`Scenario` describes one job on one cluster; :class:`ScenarioSpace` samples them;
:class:`ClusterSimulator` runs a scenario one decision interval at a time and returns the
:class:`~lightning_dynamix.metrics.ClusterState` a real job's callback would gather, so the same
controllers and policies run on both.

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/rl/simulator.py``.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from lightning_dynamix._checks import require_int, require_number
from lightning_dynamix.metrics.state import ClusterState, WorkerMetrics, loss_slope

NAN = float("nan")
_LOSS_HISTORY = 4  # intervals the loss slope is fitted over, as in the real loop


@dataclass(frozen=True)
class Scenario:
    """One data-parallel job on one cluster; per-rank tuples are in rank order.

    Attributes:
        world_size: number of ranks.
        compute_per_sample: seconds of forward and backward per sample at nominal speed, per rank.
        step_overhead: seconds per step that do not grow with the batch (kernel launches, optimizer), per rank.
        data_per_sample: seconds of data loading per sample, per rank (overlapped with compute).
        memory_limit: the largest batch that fits in the rank's memory, samples.
        gradient_bytes: bytes all-reduced per step.
        bandwidth: link bandwidth, bytes per second.
        latency: per-message latency of the links, seconds.
        overlap: fraction of the all-reduce hidden behind the backward pass, in [0, 1).
        has_gpu: whether the ranks report GPU metrics.
        initial_batch_size: every rank's batch size at the start, samples.
        min_batch_size: the smallest size a controller may give a rank.
        max_batch_size: the largest size a controller may give a rank (the user's bound, not the
            memory limit); ``None`` for none.
        dataset_size: samples per epoch.
        interval_steps: training steps per decision interval.
        noise_scale_start: gradient noise scale at the start, samples.
        noise_scale_end: gradient noise scale once the loss has fallen to ``loss_end``, samples.
        convergence_samples: ideal small-batch samples that divide the loss gap by e.
        loss_start: loss at the start.
        loss_end: the loss training converges to.
        best_accuracy: the accuracy reached at ``loss_end`` with batches within the noise scale.
        generalization_gap: accuracy lost per doubling of the global batch beyond the noise scale.
        target_accuracy: the accuracy "time to accuracy" is measured to.
        jitter: standard deviation of the log of a step's compute time.
        drift: standard deviation of ``log m_r`` reached by the drift over one drift time (``drift_time``).
        drift_time: seconds over which the drift forgets its past (mean reversion time).
        slowdown_rate: sudden slowdowns per rank per second.
        slowdown_factor: ``(low, high)``: a slowdown divides the speed by a factor drawn in this range.
        slowdown_duration: mean seconds a slowdown lasts.
        noise_measurement: standard deviation of the log of the measured noise scale.
        link_bandwidth: each rank's host link, bytes per second, or ``None``: every link as fast as ``bandwidth``.
        link_change_rate: per rank per second, how often its link slows (0: links keep their rate).
        link_change_factor: ``(low, high)``: a slowed link's rate is divided by a factor drawn in this range.
        link_change_duration: mean seconds a link stays slowed.
        length_spread: how much samples differ in size (a language model's sequence lengths): the standard
            deviation of the log of one sample's work relative to the mean sample's (0: all alike). A step's
            compute grows with its work (``compute_per_sample`` is per mean sample), and every rank reports it
            (:attr:`~lightning_dynamix.metrics.state.WorkerMetrics.work`, in mean samples).
        length_grouped: whether a step's samples are alike in length (length-aware batching: a step draws one
            length for all its samples); otherwise each sample's is drawn, and a step's mean varies less the more
            samples it has.
    """

    world_size: int
    compute_per_sample: tuple[float, ...]
    step_overhead: tuple[float, ...]
    data_per_sample: tuple[float, ...]
    memory_limit: tuple[int, ...]
    gradient_bytes: float
    bandwidth: float
    latency: float = 2e-5
    overlap: float = 0.5
    has_gpu: bool = True
    initial_batch_size: int = 64
    min_batch_size: int = 1
    max_batch_size: int | None = None
    dataset_size: int = 100_000
    interval_steps: int = 10
    noise_scale_start: float = 256.0
    noise_scale_end: float = 4096.0
    convergence_samples: float = 200_000.0
    loss_start: float = 2.3
    loss_end: float = 0.2
    best_accuracy: float = 0.92
    generalization_gap: float = 0.02
    target_accuracy: float = 0.8
    jitter: float = 0.05
    drift: float = 0.05
    drift_time: float = 60.0
    slowdown_rate: float = 0.0
    slowdown_factor: tuple[float, float] = (2.0, 4.0)
    slowdown_duration: float = 60.0
    noise_measurement: float = 0.3
    link_bandwidth: tuple[float, ...] | None = None
    link_change_rate: float = 0.0
    link_change_factor: tuple[float, float] = (4.0, 30.0)
    link_change_duration: float = 60.0
    length_spread: float = 0.0
    length_grouped: bool = False

    def __post_init__(self) -> None:
        n = require_int("world_size", self.world_size, 1)
        for name in ("compute_per_sample", "step_overhead", "data_per_sample", "memory_limit"):
            values = tuple(getattr(self, name))
            if len(values) != n:
                raise ValueError(f"`{name}` must hold one value per rank ({n}), got {len(values)}: {values!r}")
            object.__setattr__(self, name, values)
        if any(not (math.isfinite(c) and c > 0) for c in self.compute_per_sample):
            raise ValueError(f"`compute_per_sample` must be finite and > 0 (seconds), got {self.compute_per_sample!r}")
        if any(not (math.isfinite(v) and v >= 0) for v in (*self.step_overhead, *self.data_per_sample)):
            raise ValueError("`step_overhead` and `data_per_sample` must be finite and >= 0 (seconds)")
        if any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in self.memory_limit):
            raise ValueError(f"`memory_limit` must be ints >= 1 (samples), got {self.memory_limit!r}")
        require_number("gradient_bytes", self.gradient_bytes, 0.0)
        require_number("bandwidth", self.bandwidth, 0.0, low_open=True)
        require_number("latency", self.latency, 0.0)
        require_number("overlap", self.overlap, 0.0, 1.0)
        require_int("initial_batch_size", self.initial_batch_size, 1)
        require_int("min_batch_size", self.min_batch_size, 1)
        if self.max_batch_size is not None:
            require_int("max_batch_size", self.max_batch_size, self.min_batch_size)
        require_int("dataset_size", self.dataset_size, 1)
        require_int("interval_steps", self.interval_steps, 1)
        require_number("noise_scale_start", self.noise_scale_start, 0.0, low_open=True)
        require_number("noise_scale_end", self.noise_scale_end, 0.0, low_open=True)
        require_number("convergence_samples", self.convergence_samples, 0.0, low_open=True)
        require_number("loss_end", self.loss_end, 0.0)
        require_number("loss_start", self.loss_start, self.loss_end, low_open=True)
        require_number("best_accuracy", self.best_accuracy, 0.0, 1.0, low_open=True, high_open=False)
        require_number("generalization_gap", self.generalization_gap, 0.0, 1.0)
        require_number("target_accuracy", self.target_accuracy, 0.0, self.best_accuracy, low_open=True)
        for name in ("jitter", "drift", "slowdown_rate", "noise_measurement"):
            require_number(name, getattr(self, name), 0.0)
        require_number("drift_time", self.drift_time, 0.0, low_open=True)
        require_number("slowdown_duration", self.slowdown_duration, 0.0, low_open=True)
        self._require_factor_range("slowdown_factor")
        if self.link_bandwidth is not None:
            links = tuple(float(v) for v in self.link_bandwidth)
            if len(links) != n or any(not (math.isfinite(v) and v > 0) for v in links):
                raise ValueError(
                    f"`link_bandwidth` must hold one finite rate > 0 (bytes per second) per rank ({n}) or be None,"
                    f" got {self.link_bandwidth!r}"
                )
            object.__setattr__(self, "link_bandwidth", links)
        require_number("link_change_rate", self.link_change_rate, 0.0)
        require_number("link_change_duration", self.link_change_duration, 0.0, low_open=True)
        self._require_factor_range("link_change_factor")
        require_number("length_spread", self.length_spread, 0.0)
        if not isinstance(self.length_grouped, bool):
            raise ValueError(f"`length_grouped` must be a bool, got {self.length_grouped!r}")

    def _require_factor_range(self, name: str) -> None:
        """Check the ``(low, high)`` range of slowdown factors named ``name`` and store it as floats."""
        low, high = getattr(self, name)
        if not (1.0 <= low <= high):
            raise ValueError(f"`{name}` must be (low, high) with 1 <= low <= high, got {getattr(self, name)!r}")
        object.__setattr__(self, name, (float(low), float(high)))

    @property
    def allreduce_time(self) -> float:
        """Seconds of one ring all-reduce of the gradients (0 for one rank), every link at its nominal rate."""
        return self.allreduce_time_at(None)

    def allreduce_time_at(self, link_multipliers: Sequence[float] | None) -> float:
        """Seconds of one ring all-reduce with each rank's link at ``link_multipliers`` times its rate (``None``: 1).

        The ring runs at the slowest of the fabric (``bandwidth``) and the ranks' own links.
        """
        n = self.world_size
        if n == 1:
            return 0.0
        links = np.full(n, self.bandwidth) if self.link_bandwidth is None else np.asarray(self.link_bandwidth)
        if link_multipliers is not None:
            links = links * np.asarray(link_multipliers, dtype=np.float64)
        rate = min(self.bandwidth, float(links.min()))
        return 2.0 * (n - 1) / n * self.gradient_bytes / rate + 2.0 * (n - 1) * self.latency

    def own_time(self, batch_sizes: Sequence[float], speeds: Sequence[float] | None = None) -> np.ndarray:
        """Each rank's data wait plus compute per step at ``batch_sizes`` and speed multipliers, seconds (no jitter)."""
        b = np.asarray(batch_sizes, dtype=np.float64)
        m = np.ones(self.world_size) if speeds is None else np.asarray(speeds, dtype=np.float64)
        compute = (np.asarray(self.step_overhead) + np.asarray(self.compute_per_sample) * b) / m
        load = np.asarray(self.data_per_sample) * b
        return compute + np.maximum(0.0, load - compute)

    def ideal_throughput(
        self,
        batch_sizes: Sequence[float],
        speeds: Sequence[float] | None = None,
        link_multipliers: Sequence[float] | None = None,
    ) -> float:
        """``sum_r b_r / (own_r + exposed transfer)``: samples per second if no rank waited for another."""
        own = self.own_time(batch_sizes, speeds) + self.allreduce_time_at(link_multipliers) * (1.0 - self.overlap)
        return float(np.sum(np.asarray(batch_sizes, dtype=np.float64) / own))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (tuples become lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Scenario:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown Scenario fields {unknown}; valid fields: {sorted(known)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


@dataclass(frozen=True)
class ScenarioSpace:
    """The distribution scenarios are drawn from (for training a policy and for held-out evaluation).

    Ranges are ``(low, high)``; sizes and times are drawn log-uniformly.

    Attributes:
        world_sizes: world sizes to draw from (uniformly).
        max_speed_ratio: the fastest rank is at most this many times faster than the slowest.
        machine_types: ``(low, high)`` number of machine types the ranks are spread over.
        compute_per_sample: seconds per sample on the fastest machine type.
        overhead_to_compute: step overhead relative to compute at the initial batch.
        data_to_compute: data loading relative to compute at the initial batch (above 1: input bound).
        comm_to_compute: all-reduce time relative to the fastest rank's compute at the initial batch.
        bandwidth: bytes per second (two orders of magnitude by default).
        initial_batch_size: every rank's starting batch, samples.
        memory_to_initial: a machine type's memory limit relative to the initial batch.
        noise_scale_start_to_batch: starting noise scale relative to the initial global batch.
        noise_scale_growth: ``noise_scale_end / noise_scale_start``.
        intervals_to_converge: decision intervals of static training per ``convergence_samples``.
        generalization_gap: accuracy lost per doubling beyond the noise scale.
        slowdown_probability: probability that a scenario has sudden slowdowns at all.
        slowdowns_per_hour: per rank, when it has them.
        slow_link_probability: probability that some hosts sit on a slow link (another zone, a spot node).
        slow_link_to_compute: the all-reduce over such a link relative to the fastest rank's compute at the
            initial batch: above 1, the network bounds the step.
        link_change_probability: probability that the links slow down and recover during the run.
        link_changes_per_hour: per rank, when they do.
    """

    world_sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    max_speed_ratio: float = 8.0
    machine_types: tuple[int, int] = (1, 4)
    compute_per_sample: tuple[float, float] = (2e-4, 5e-3)
    overhead_to_compute: tuple[float, float] = (0.02, 0.5)
    data_to_compute: tuple[float, float] = (0.05, 1.5)
    comm_to_compute: tuple[float, float] = (0.02, 1.0)
    bandwidth: tuple[float, float] = (1e8, 1e10)
    initial_batch_size: tuple[int, int] = (16, 256)
    memory_to_initial: tuple[float, float] = (2.0, 32.0)
    noise_scale_start_to_batch: tuple[float, float] = (0.25, 4.0)
    noise_scale_growth: tuple[float, float] = (4.0, 64.0)
    intervals_to_converge: tuple[float, float] = (20.0, 80.0)
    generalization_gap: tuple[float, float] = (0.0, 0.04)
    slowdown_probability: float = 0.5
    slowdowns_per_hour: tuple[float, float] = (1.0, 12.0)
    slow_link_probability: float = 0.25
    slow_link_to_compute: tuple[float, float] = (1.5, 30.0)
    link_change_probability: float = 0.25
    link_changes_per_hour: tuple[float, float] = (2.0, 20.0)

    def sample(self, rng: np.random.Generator, world_size: int | None = None) -> Scenario:
        """One scenario drawn with ``rng``; ``world_size`` fixes the number of ranks."""
        n = int(world_size if world_size is not None else rng.choice(self.world_sizes))
        require_int("world_size", n, 1)

        def log_uniform(low: float, high: float) -> float:
            return float(math.exp(rng.uniform(math.log(low), math.log(high))))

        b0 = round(log_uniform(*self.initial_batch_size))
        fastest = log_uniform(*self.compute_per_sample)
        types = int(rng.integers(self.machine_types[0], self.machine_types[1] + 1))
        # machine types: slowdown factors in [1, max ratio], the first type is the fastest
        factors = np.concatenate([[1.0], np.exp(rng.uniform(0, math.log(self.max_speed_ratio), types - 1))])
        memory = np.array([log_uniform(*self.memory_to_initial) * b0 for _ in range(types)])
        rank_type = rng.integers(0, types, n)
        compute = fastest * factors[rank_type]
        overhead = compute * b0 * np.array([log_uniform(*self.overhead_to_compute) for _ in range(n)])
        data = fastest * np.array([log_uniform(*self.data_to_compute) for _ in range(n)])
        bandwidth = log_uniform(*self.bandwidth)
        ring = 2.0 * (n - 1) / n if n > 1 else 1.0
        gradient_bytes = log_uniform(*self.comm_to_compute) * fastest * b0 * bandwidth / ring
        global_batch = n * b0
        noise_start = log_uniform(*self.noise_scale_start_to_batch) * global_batch
        noise_end = noise_start * log_uniform(*self.noise_scale_growth)
        noise_mid = math.sqrt(noise_start * noise_end)
        steps = log_uniform(*self.intervals_to_converge) * 10
        convergence = steps * global_batch * noise_mid / (noise_mid + global_batch)
        slowdowns = rng.random() < self.slowdown_probability
        best = float(rng.uniform(0.7, 0.98))
        # in the order they were always drawn in
        latency, overlap, has_gpu = log_uniform(5e-6, 1e-4), float(rng.uniform(0.0, 0.8)), bool(rng.random() < 0.7)
        dataset_size = int(global_batch * log_uniform(50, 2000))
        loss_start, loss_end = float(rng.uniform(1.0, 5.0)), float(rng.uniform(0.05, 0.5))
        gap = float(rng.uniform(*self.generalization_gap))
        jitter, drift = float(rng.uniform(0.02, 0.15)), float(rng.uniform(0.0, 0.15))
        slowdown_rate = log_uniform(*self.slowdowns_per_hour) / 3600.0 if slowdowns else 0.0
        # drawn last, so a space without slow links draws the scenarios it drew before they existed
        links, link_changes = None, 0.0
        if n > 1 and self.slow_link_probability > 0 and rng.random() < self.slow_link_probability:
            slow = rng.choice(n, size=int(rng.integers(1, max(1, n // 2) + 1)), replace=False)
            rate = ring * gradient_bytes / (log_uniform(*self.slow_link_to_compute) * fastest * b0)
            links = tuple(rate if r in slow else bandwidth for r in range(n))
        if n > 1 and self.link_change_probability > 0 and rng.random() < self.link_change_probability:
            link_changes = log_uniform(*self.link_changes_per_hour) / 3600.0
        return Scenario(
            world_size=n,
            compute_per_sample=tuple(float(c) for c in compute),
            step_overhead=tuple(float(o) for o in overhead),
            data_per_sample=tuple(float(d) for d in data),
            memory_limit=tuple(max(b0, int(memory[t])) for t in rank_type),
            gradient_bytes=float(gradient_bytes),
            bandwidth=bandwidth,
            latency=latency,
            overlap=overlap,
            has_gpu=has_gpu,
            initial_batch_size=b0,
            dataset_size=dataset_size,
            interval_steps=10,
            noise_scale_start=noise_start,
            noise_scale_end=noise_end,
            convergence_samples=convergence,
            loss_start=loss_start,
            loss_end=loss_end,
            best_accuracy=best,
            generalization_gap=gap,
            target_accuracy=0.9 * best,
            jitter=jitter,
            drift=drift,
            slowdown_rate=slowdown_rate,
            link_bandwidth=links,
            link_change_rate=link_changes,
        )


class _Trajectory(abc.ABC):
    """Per-rank multipliers as a function of wall-clock time, drawn on a fixed time grid from a random stream of
    their own (``stream``), so they depend on the scenario, the seed and the time only, never on the decisions."""

    def __init__(self, scenario: Scenario, seed: int, grid: float, stream: int) -> None:
        self.scenario = scenario
        self.grid = grid
        self.rng = np.random.default_rng([seed, stream])
        self.slow_factor = np.ones(scenario.world_size)
        self.values: list[np.ndarray] = []

    def at(self, t: float) -> np.ndarray:
        index = int(t // self.grid)
        while len(self.values) <= index:
            self.values.append(self._next())
        return self.values[index]

    @abc.abstractmethod
    def _next(self) -> np.ndarray:
        """The multipliers of the next grid cell."""

    def _episodes(self, rate: float, duration: float, factor: tuple[float, float]) -> None:
        """Episodes that divide a rank's multiplier by a factor drawn in ``factor``: each starts at ``rate`` per
        second and lasts ``duration`` seconds on average."""
        n, dt = self.scenario.world_size, self.grid
        start = (self.slow_factor == 1.0) & (self.rng.random(n) < 1 - math.exp(-rate * dt))
        end = (self.slow_factor > 1.0) & (self.rng.random(n) < 1 - math.exp(-dt / duration))
        self.slow_factor = np.where(end, 1.0, self.slow_factor)
        self.slow_factor = np.where(start, self.rng.uniform(*factor, n), self.slow_factor)


class _SpeedTrajectory(_Trajectory):
    """Every rank's speed multiplier as a function of wall-clock time, drawn on a fixed time grid.

    Its own random stream (and a grid in seconds) makes the trajectory independent of the decisions.
    """

    def __init__(self, scenario: Scenario, seed: int, grid: float) -> None:
        super().__init__(scenario, seed, grid, stream=1)
        self.log_drift = np.zeros(scenario.world_size)

    def _next(self) -> np.ndarray:
        s, n, dt = self.scenario, self.scenario.world_size, self.grid
        if s.drift > 0:  # Ornstein-Uhlenbeck: stationary std s.drift, correlation time s.drift_time
            a = math.exp(-dt / s.drift_time)
            self.log_drift = a * self.log_drift + s.drift * math.sqrt(1 - a * a) * self.rng.standard_normal(n)
        if s.slowdown_rate > 0:
            self._episodes(s.slowdown_rate, s.slowdown_duration, s.slowdown_factor)
        return np.exp(self.log_drift) / self.slow_factor


class _LinkTrajectory(_Trajectory):
    """Every rank's link rate multiplier as a function of wall-clock time, on the speeds' time grid.

    Its own random stream: adding links to a scenario leaves its speed trajectory as it was.
    """

    def __init__(self, scenario: Scenario, seed: int, grid: float) -> None:
        super().__init__(scenario, seed, grid, stream=3)

    def _next(self) -> np.ndarray:
        s = self.scenario
        if s.link_change_rate > 0:
            self._episodes(s.link_change_rate, s.link_change_duration, s.link_change_factor)
        return 1.0 / self.slow_factor


@dataclass(frozen=True)
class IntervalOutcome:
    """What one simulated interval did, beyond the measurements in its ClusterState.

    Attributes:
        elapsed: wall-clock seconds of the interval (out-of-memory retries included).
        time: seconds since the start of training at the end of the interval.
        samples: samples trained on.
        progress: ideal small-batch samples of progress made.
        goodput: ``progress / elapsed``, samples per second.
        reference_goodput: goodput of a perfectly balanced job at the initial sizes, at this
            interval's speeds and noise scale: the scale rewards are measured on.
        accuracy: accuracy at the end of the interval.
        accuracy_ceiling: the accuracy the run can still reach.
        out_of_memory: ranks whose batch exceeded their memory.
        batch_sizes: the sizes actually run (after out-of-memory fallbacks).
        noise_scale: the true gradient noise scale in the interval, samples.
    """

    elapsed: float
    time: float
    samples: int
    progress: float
    goodput: float
    reference_goodput: float
    accuracy: float
    accuracy_ceiling: float
    out_of_memory: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    noise_scale: float


@dataclass
class _Progress:
    time: float = 0.0
    step: int = 0
    samples: int = 0
    progress: float = 0.0
    excess_weighted: float = 0.0  # sum of progress * log2 excess over the noise scale
    loss_points: list[tuple[int, float]] = field(default_factory=list)


class ClusterSimulator:
    """Runs a :class:`Scenario` one decision interval at a time.

    Args:
        scenario: the job and cluster.
        seed: seeds the speed trajectory and the measurement noise (separate streams).

    Use :meth:`reset` for the first state, then :meth:`run_interval` with each decision's sizes.
    """

    def __init__(self, scenario: Scenario, seed: int = 0) -> None:
        if not isinstance(scenario, Scenario):
            raise ValueError(f"`scenario` must be a Scenario, got {type(scenario).__name__}")
        self.scenario = scenario
        self.seed = require_int("seed", seed, 0)
        b0 = [scenario.initial_batch_size] * scenario.world_size
        nominal_step = float(np.max(scenario.own_time(b0))) + scenario.allreduce_time
        # the speed grid: about one interval at the start, fixed in seconds from then on
        self._grid = max(nominal_step * scenario.interval_steps, 1e-3)
        self.reset()

    # ------------------------------------------------------------------ public
    def reset(self) -> ClusterState:
        """Start over (same seed, same speed trajectory); the state after a first interval at the initial sizes."""
        self._speeds = _SpeedTrajectory(self.scenario, self.seed, self._grid)
        self._links = _LinkTrajectory(self.scenario, self.seed, self._grid)
        self._rng = np.random.default_rng([self.seed, 2])
        self._lengths = np.random.default_rng([self.seed, 3])  # its own stream: lengths change no other draw
        self._progress = _Progress()
        state, _outcome = self.run_interval([self.scenario.initial_batch_size] * self.scenario.world_size)
        return state

    @property
    def time(self) -> float:
        """Seconds of training so far."""
        return self._progress.time

    @property
    def loss(self) -> float:
        s = self.scenario
        return s.loss_end + (s.loss_start - s.loss_end) * math.exp(-self._progress.progress / s.convergence_samples)

    @property
    def noise_scale(self) -> float:
        """The true gradient noise scale now, samples."""
        s = self.scenario
        gone = 1.0 - (self.loss - s.loss_end) / (s.loss_start - s.loss_end)
        return s.noise_scale_start * (s.noise_scale_end / s.noise_scale_start) ** gone

    @property
    def accuracy_ceiling(self) -> float:
        s, p = self.scenario, self._progress
        excess = p.excess_weighted / p.progress if p.progress > 0 else 0.0
        return max(0.0, s.best_accuracy - s.generalization_gap * excess)

    @property
    def accuracy(self) -> float:
        s = self.scenario
        return self.accuracy_ceiling * (s.loss_start - self.loss) / (s.loss_start - s.loss_end)

    @property
    def progress_to_target(self) -> float:
        """Ideal small-batch samples of progress still needed to reach ``target_accuracy`` at the current ceiling.

        0 once the target is reached; ``inf`` while the ceiling is at or below the target.
        """
        s = self.scenario
        ceiling = self.accuracy_ceiling
        if ceiling <= s.target_accuracy:
            return math.inf
        needed = -s.convergence_samples * math.log(1.0 - s.target_accuracy / ceiling)
        return max(0.0, needed - self._progress.progress)

    def bounds(self) -> tuple[int, int | None]:
        """``(min_batch_size, max_batch_size)`` a controller may choose within."""
        return self.scenario.min_batch_size, self.scenario.max_batch_size

    def speed_multipliers(self, time: float) -> np.ndarray:
        """Every rank's speed relative to its nominal speed at ``time`` seconds (drift and slowdowns)."""
        return self._speeds.at(time).copy()

    def link_multipliers(self, time: float) -> np.ndarray:
        """Every rank's link rate relative to its nominal rate at ``time`` seconds."""
        return self._links.at(time).copy()

    def allreduce_time(self, time: float) -> float:
        """Seconds of one all-reduce at ``time`` seconds, at the links' rates then (without measurement noise)."""
        return self.scenario.allreduce_time_at(self._links.at(time))

    def run_interval(self, batch_sizes: Sequence[int]) -> tuple[ClusterState, IntervalOutcome]:
        """Train ``interval_steps`` steps at ``batch_sizes``; the state gathered at its end and what happened."""
        s, p = self.scenario, self._progress
        n, k = s.world_size, s.interval_steps
        sizes = [int(b) for b in batch_sizes]
        if len(sizes) != n or any(b < 1 for b in sizes):
            raise ValueError(f"`batch_sizes` must hold {n} ints >= 1 (one per rank), got {list(batch_sizes)!r}")
        oom = tuple(r for r in range(n) if sizes[r] > s.memory_limit[r])
        run = np.array([min(b, s.memory_limit[r]) for r, b in enumerate(sizes)], dtype=np.float64)
        speeds = self.speed_multipliers(p.time)
        links = self.link_multipliers(p.time)

        jitter = np.exp(s.jitter * self._rng.standard_normal((k, n)) - 0.5 * s.jitter**2)
        work = run * self._length_factors(run, k)  # each step's work, in mean samples
        compute = (np.asarray(s.step_overhead) + np.asarray(s.compute_per_sample) * work) / speeds * jitter
        load = np.asarray(s.data_per_sample) * run * np.exp(0.05 * self._rng.standard_normal((k, n)))
        data = np.maximum(0.0, load - compute)
        own = data + compute
        transfer = s.allreduce_time_at(links)
        exposed = transfer * (1.0 - s.overlap) * np.exp(0.05 * self._rng.standard_normal(k))
        slowest = own.max(axis=1)
        step = slowest + exposed
        sync_wait = slowest[:, None] - own + exposed[:, None]
        elapsed = float(step.sum())
        if oom:  # the failed attempt's time is lost
            elapsed += float(step[0])

        global_batch = float(run.sum())
        noise = self.noise_scale
        progress = k * global_batch * noise / (noise + global_batch)
        excess = max(0.0, math.log2(global_batch / noise))
        p.time += elapsed
        p.step += k
        p.samples += int(global_batch) * k
        p.progress += progress
        p.excess_weighted += progress * excess

        loss = self.loss * math.exp(0.02 * self._rng.standard_normal())
        p.loss_points = [*p.loss_points, (p.step, loss)][-_LOSS_HISTORY:]
        measured_noise = noise * math.exp(s.noise_measurement * self._rng.standard_normal()) if n > 1 else NAN
        comm = transfer * np.exp(0.05 * self._rng.standard_normal(n)) if n > 1 else np.full(n, NAN)
        mean_step = float(step.mean())
        data_mean, compute_mean, wait_mean = data.mean(axis=0), compute.mean(axis=0), sync_wait.mean(axis=0)
        busy = own.mean(axis=0) / mean_step
        memory = 100.0 * (0.15 + 0.85 * run / np.asarray(s.memory_limit))
        workers = tuple(
            WorkerMetrics(
                rank=r,
                batch_size=int(run[r]),
                data_time=float(data_mean[r]),
                compute_time=float(compute_mean[r]),
                sync_wait=float(wait_mean[r]),
                step_time=mean_step,
                samples_per_s=float(run[r]) / mean_step,
                cpu_util=float(100.0 * (0.2 + 0.3 * busy[r] if s.has_gpu else busy[r])),
                mem_util=40.0 if s.has_gpu else float(memory[r]),
                gpu_util=float(100.0 * busy[r]) if s.has_gpu else NAN,
                gpu_mem_util=float(memory[r]) if s.has_gpu else NAN,
                comm_time=float(comm[r]),
                comm_bytes=s.gradient_bytes if n > 1 else NAN,
                bandwidth=s.gradient_bytes / float(comm[r]) if n > 1 else NAN,
                work=float(work[:, r].mean()) if s.length_spread > 0 else NAN,
            )
            for r in range(n)
        )
        state = ClusterState(
            workers=workers,
            step=p.step,
            epoch=p.samples // s.dataset_size,
            loss=loss,
            loss_slope=loss_slope(p.loss_points),
            gradient_noise_scale=measured_noise,
            lr=NAN,
            min_batch_size=s.min_batch_size,
            max_batch_size=s.max_batch_size,
        )
        b0 = [s.initial_batch_size] * n
        g0 = float(n * s.initial_batch_size)
        reference = s.ideal_throughput(b0, speeds, links) * noise / (noise + g0)
        outcome = IntervalOutcome(
            elapsed=elapsed,
            time=p.time,
            samples=int(global_batch) * k,
            progress=progress,
            goodput=progress / elapsed,
            reference_goodput=reference,
            accuracy=self.accuracy,
            accuracy_ceiling=self.accuracy_ceiling,
            out_of_memory=oom,
            batch_sizes=tuple(int(b) for b in run),
            noise_scale=noise,
        )
        return state, outcome

    def _length_factors(self, sizes: np.ndarray, steps: int) -> np.ndarray:
        """``(steps, ranks)``: each step's mean work per sample relative to the mean sample's (all 1 without spread).

        A sample's work is lognormal with mean 1 and log-deviation ``length_spread``; the mean of ``b`` independent
        ones is drawn as a lognormal of the same mean and variance (a step of alike samples: one draw).
        """
        sigma = self.scenario.length_spread
        if sigma == 0.0:
            return np.ones((steps, len(sizes)))
        variance = math.expm1(sigma**2)  # of one sample's work
        if not self.scenario.length_grouped:
            variance = variance / np.maximum(sizes, 1.0)
        step_sigma = np.sqrt(np.log1p(variance))
        return np.exp(step_sigma * self._lengths.standard_normal((steps, len(sizes))) - 0.5 * step_sigma**2)


def with_world_size(scenario: Scenario, world_size: int) -> Scenario:
    """``scenario`` with ranks repeated (or cut) to ``world_size`` ranks, gradient bytes unchanged."""
    n = require_int("world_size", world_size, 1)
    pick = [r % scenario.world_size for r in range(n)]

    def per_rank(values: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(values[r] for r in pick)

    return replace(
        scenario,
        world_size=n,
        compute_per_sample=per_rank(scenario.compute_per_sample),
        step_overhead=per_rank(scenario.step_overhead),
        data_per_sample=per_rank(scenario.data_per_sample),
        memory_limit=per_rank(scenario.memory_limit),
        link_bandwidth=None if scenario.link_bandwidth is None else per_rank(scenario.link_bandwidth),
    )
