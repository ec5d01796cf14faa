"""Fit a simulator :class:`Scenario` to what a real run logged, and check the fit by replaying the run.

A run with ``DynamixCallback`` or ``ClusterMetricsMonitor`` logs, once per decision interval,
every rank's batch size, data, compute, sync-wait, step and all-reduce times, the all-reduce
bandwidth, the gradient noise scale and the loss (``dynamix/...``). :func:`calibrate` turns those
series into a scenario:

* per rank, ``compute = step_overhead + compute_per_sample * b``: a least-squares fit over the
  rank's intervals (a proportional fit with one distinct size), the same fit the goodput
  controller uses; the time a step spends outside data, compute and the all-reduce wait (the
  optimizer step) is added to the overhead;
* data loading: where the rank waited for data (in most intervals), the load time was the wait
  plus its compute, fitted in proportion to the batch; where prefetching hid it, what the rank
  waited is a lower bound;
* the all-reduce: ``gradient_bytes = bandwidth x comm_time``, the link bandwidth that gives the
  measured ``comm_time`` through a ring at this world size, and the hidden fraction ``overlap``
  from the exposed transfer (the least sync-wait of any rank in any interval) against ``comm_time``;
* the noise scale at the start and the end of the run; the loss curve ``L = L_end + (L_start -
  L_end) exp(-P / convergence_samples)`` fitted over the run's progress ``P``;
* the jitter from the compute fit's residuals.

What logs cannot tell (memory limits, the final accuracy, sudden slowdowns that did not happen)
is taken from the arguments, and :class:`CalibrationReport` says which values were assumed.
:func:`replay` runs the scenario at the run's own batch sizes and compares step times.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from lightning_dynamix._stats import median_or
from lightning_dynamix.control.step_times import fit_step_time
from lightning_dynamix.rl.simulator import ClusterSimulator, Scenario

Series = Sequence[tuple[int, float]]


@dataclass
class CalibrationReport:
    """How the scenario was fitted.

    Attributes:
        intervals: logged intervals used.
        interval_steps: optimizer steps per logged interval.
        compute_fit: per rank ``(step_overhead, compute_per_sample)``, seconds.
        assumed: fields not measurable from the logs, with the value used.
        replay_step_time_error: median relative error of the replayed step time (filled by :func:`replay`).
    """

    intervals: int
    interval_steps: int
    compute_fit: list[tuple[float, float]]
    assumed: dict[str, object] = field(default_factory=dict)
    replay_step_time_error: float = math.nan


def calibrate(
    series: Mapping[str, Series],
    ranks: Mapping[int, Mapping[str, Series]],
    *,
    dataset_size: int = 100_000,
    memory_limit: int | None = None,
    best_accuracy: float = 0.9,
    target_accuracy: float | None = None,
) -> tuple[Scenario, CalibrationReport]:
    """A scenario fitted to one run's ``dynamix/...`` series.

    Args:
        series: global series by name without the prefix (``bandwidth``, ``gradient_noise_scale``,
            ``loss``, ``global_batch``), each ``(step, value)`` pairs.
        ranks: per rank, its series (``batch_size``, ``data_time``, ``compute_time``, ``sync_wait``,
            ``step_time``, ``comm_time``).
        dataset_size: samples per epoch (logs do not hold it).
        memory_limit: the largest batch a rank can hold; default: 16 x the largest batch logged.
        best_accuracy: accuracy at convergence (logs of the training loop do not hold it).
        target_accuracy: default: 0.9 x ``best_accuracy``.

    Raises:
        ValueError: with fewer than two logged intervals, or ranks that are not 0..n-1.
    """
    n = len(ranks)
    if n == 0 or sorted(ranks) != list(range(n)):
        raise ValueError(f"`ranks` must hold ranks 0..n-1 with their series, got ranks {sorted(ranks)}")
    steps = sorted({s for s, _ in ranks[0].get("batch_size", [])})
    if len(steps) < 2:
        raise ValueError(f"a calibration needs at least 2 logged intervals, got {len(steps)}")
    interval_steps = int(statistics.median(b - a for a, b in itertools.pairwise(steps)))

    def table(rank: int, name: str) -> dict[int, float]:
        return dict(ranks[rank].get(name, []))

    assumed: dict[str, object] = {"dataset_size": dataset_size, "best_accuracy": best_accuracy}
    overhead, per_sample, data, jitter_logs, largest = [], [], [], [], 1
    for r in range(n):
        sizes, compute, wait = table(r, "batch_size"), table(r, "compute_time"), table(r, "data_time")
        points = [(sizes[s], compute[s]) for s in steps if s in sizes and s in compute and compute[s] > 0]
        if not points:
            raise ValueError(f"rank {r} logged no compute_time: log with log_per_rank=True")
        alpha, beta = fit_step_time(points)
        # what a step spends outside data, compute and the all-reduce wait (the optimizer, logging)
        # is paid every step whatever the batch: part of the overhead
        step_time, sync = table(r, "step_time"), table(r, "sync_wait")
        rest = median_or(
            [step_time[s] - wait.get(s, 0.0) - compute[s] - sync.get(s, 0.0) for s in step_time if s in compute],
            math.nan,
        )
        overhead.append(alpha + max(0.0, rest if math.isfinite(rest) else 0.0))
        per_sample.append(beta)
        largest = max(largest, int(max(b for b, _ in points)))
        jitter_logs += [math.log(t / (alpha + beta * b)) for b, t in points]
        waits = [wait.get(s, 0.0) for s in steps if s in sizes]
        mean_compute = statistics.mean(t for _, t in points)
        # loads the rank waited for took the wait plus its compute; a fit through the origin over them
        loads = [(sizes[s], wait.get(s, 0.0) + compute[s]) for s in steps if s in sizes and s in compute]
        waited = [(b, t) for (b, t), w in zip(loads, waits) if w > 0.01 * mean_compute]
        if len(waited) > len(loads) // 2:
            data.append(sum(b * t for b, t in waited) / sum(b * b for b, _ in waited))
        else:  # prefetching hid the loading: what little it waited is a lower bound
            data.append(median_or([wait.get(s, 0.0) / sizes[s] for s in steps if s in sizes], 0.0))

    comm = median_or([v for r in range(n) for v in table(r, "comm_time").values()], 0.0)
    # the exposed transfer: what the last rank to finish waits. In a balanced interval every rank is
    # last only part of the time and its mean wait also holds the others' jitter, so the least wait
    # of any rank in any interval is the closest to it
    waits = [min(table(r, "sync_wait").get(s, math.inf) for r in range(n)) for s in steps]
    exposed = min((w for w in waits if math.isfinite(w)), default=0.0)
    measured_bandwidth = median_or([v for _, v in series.get("bandwidth", [])], math.nan)
    if n > 1 and comm > 0 and math.isfinite(measured_bandwidth):
        gradient_bytes = measured_bandwidth * comm
        bandwidth = 2.0 * (n - 1) / n * gradient_bytes / comm
        overlap = min(0.95, max(0.0, 1.0 - exposed / comm))
    else:
        gradient_bytes, bandwidth, overlap = 0.0, 1e9, 0.5
        assumed["all-reduce"] = "none measured (one rank, or no comm_time/bandwidth logged)"

    noise = [v for _, v in series.get("gradient_noise_scale", []) if v > 0]
    if noise:
        noise_start, noise_end = (
            median_or(noise[:3], math.nan),
            max(median_or(noise[-3:], math.nan), median_or(noise[:3], math.nan)),
        )
    else:
        noise_start = noise_end = 1e6
        assumed["noise_scale"] = "not logged: taken as far above the batch (no statistical-efficiency effect)"

    global_batch = {s: sum(table(r, "batch_size").get(s, 0.0) for r in range(n)) for s in steps}
    loss = [(s, v) for s, v in series.get("loss", []) if math.isfinite(v)]
    loss_start, loss_end, convergence = _fit_loss(loss, global_batch, interval_steps, noise_start, noise_end)
    if loss_start is None:
        loss_start, loss_end, convergence = 2.3, 0.1, 50.0 * interval_steps * statistics.mean(global_batch.values())
        assumed["loss"] = "too few finite losses logged: a generic curve"

    limit = memory_limit if memory_limit is not None else 16 * largest
    if memory_limit is None:
        assumed["memory_limit"] = limit
    initial = max(1, round(statistics.mean(table(r, "batch_size")[steps[0]] for r in range(n))))
    scenario = Scenario(
        world_size=n,
        compute_per_sample=tuple(per_sample),
        step_overhead=tuple(overhead),
        data_per_sample=tuple(data),
        memory_limit=(max(limit, initial),) * n,
        gradient_bytes=gradient_bytes,
        bandwidth=bandwidth,
        overlap=overlap,
        has_gpu=any("gpu_util" in ranks[r] for r in range(n)),
        initial_batch_size=initial,
        dataset_size=dataset_size,
        interval_steps=interval_steps,
        noise_scale_start=noise_start,
        noise_scale_end=noise_end,
        convergence_samples=convergence,
        loss_start=loss_start,
        loss_end=loss_end,
        best_accuracy=best_accuracy,
        target_accuracy=target_accuracy if target_accuracy is not None else 0.9 * best_accuracy,
        jitter=float(np.std(jitter_logs) * math.sqrt(interval_steps)) if len(jitter_logs) > 1 else 0.05,
        drift=0.0,
        slowdown_rate=0.0,
    )
    assumed["drift, slowdowns"] = "none (what the run showed is in the jitter)"
    report = CalibrationReport(
        intervals=len(steps),
        interval_steps=interval_steps,
        compute_fit=list(zip(overhead, per_sample)),
        assumed=assumed,
    )
    return scenario, report


def _fit_loss(
    loss: list[tuple[int, float]],
    global_batch: Mapping[int, float],
    interval_steps: int,
    noise_start: float,
    noise_end: float,
) -> tuple[float | None, float, float]:
    """``(loss_start, loss_end, convergence_samples)``, the best exponential fit over a grid of ``loss_end``."""
    if len(loss) < 3:
        return None, 0.0, 0.0
    steps = sorted(global_batch)
    progress, total = [], 0.0
    noise = math.sqrt(noise_start * noise_end)
    batches = dict(global_batch)
    for s, _ in loss:
        b = batches.get(s) or batches[min(steps, key=lambda t: abs(t - s))]
        total += interval_steps * b * noise / (noise + b)
        progress.append(total)
    values = np.array([v for _, v in loss])
    best: tuple[float, float, float, float] | None = None
    for loss_end in np.linspace(0.0, 0.95 * values.min(), 20):
        y = np.log(values - loss_end)
        slope, intercept = np.polyfit(progress, y, 1)
        if slope >= 0:
            continue
        error = float(np.mean((np.polyval([slope, intercept], progress) - y) ** 2))
        if best is None or error < best[0]:
            best = (error, float(loss_end), float(loss_end + math.exp(intercept)), float(-1.0 / slope))
    if best is None:
        return None, 0.0, 0.0
    _, loss_end, loss_start, convergence = best
    return max(loss_start, loss_end + 1e-6), loss_end, convergence


def replay(
    scenario: Scenario, ranks: Mapping[int, Mapping[str, Series]], report: CalibrationReport, seed: int = 0
) -> list[tuple[int, float, float]]:
    """Run ``scenario`` at the run's own batch sizes; ``(step, measured, simulated)`` step times per interval.

    Also sets ``report.replay_step_time_error`` (median relative error).
    """
    simulator = ClusterSimulator(scenario, seed)
    n = scenario.world_size
    sizes = {r: dict(ranks[r]["batch_size"]) for r in range(n)}
    times = {r: dict(ranks[r].get("step_time", [])) for r in range(n)}
    rows = []
    for step in sorted(sizes[0]):
        batch = [int(sizes[r][step]) for r in range(n)]
        state, _ = simulator.run_interval(batch)
        measured = max(times[r].get(step, math.nan) for r in range(n))
        rows.append((step, measured, state.step_time))
    errors = [abs(sim - real) / real for _, real, sim in rows if math.isfinite(real) and real > 0]
    report.replay_step_time_error = median_or(errors, math.nan)
    return rows
