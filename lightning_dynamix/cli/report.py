"""``dynamix report <log dir>``: what the controller did, as plots and a short summary, from a run's logs.

``DynamixCallback`` and ``ClusterMetricsMonitor`` log their ``dynamix/...`` metrics once per
decision interval through the Trainer's loggers (and the Accelerate integration through
Accelerate's trackers). This module reads them back from the files those loggers write:

* Lightning's ``CSVLogger``: a ``metrics.csv`` with one column per metric and a ``step`` column;
* TensorBoard event files (``events.out.tfevents.*``), written by Lightning's ``TensorBoardLogger``
  and by Accelerate's ``tensorboard`` tracker.

Every directory under the given one that holds such a file is one run. For each run it writes
``dynamix_report.png`` (per-rank batch sizes, per-rank step, compute and wait times, throughput
against the ideal, gradient noise scale, learning rate, each against the optimizer step) and
prints a summary.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

PREFIX = "dynamix/"
_RANK_METRIC = re.compile(r"^dynamix/rank_(\d+)/(.+)$")
REPORT_NAME = "dynamix_report.png"


@dataclass
class RunLog:
    """The ``dynamix/...`` metrics of one run: for each metric, ``(step, value)`` pairs in step order.

    Attributes:
        source: the file they were read from.
        series: global metrics by name without the prefix (``throughput``, ``lr``, ...).
        ranks: per-rank metrics: ``ranks[r][name]`` (``batch_size``, ``step_time``, ...).
    """

    source: Path
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    ranks: dict[int, dict[str, list[tuple[int, float]]]] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def add(self, name: str, step: int, value: float) -> None:
        if not name.startswith(PREFIX) or not math.isfinite(value):
            return
        match = _RANK_METRIC.match(name)
        if match:
            rank = self.ranks.setdefault(int(match.group(1)), {})
            rank.setdefault(match.group(2), []).append((step, value))
        else:
            self.series.setdefault(name[len(PREFIX) :], []).append((step, value))

    def sort(self) -> None:
        for table in [self.series, *self.ranks.values()]:
            for name, points in table.items():
                table[name] = sorted(dict(points).items())  # one value per step, the last one logged

    def values(self, name: str) -> list[float]:
        return [v for _, v in self.series.get(name, [])]


def find_logs(root: Path) -> list[Path]:
    """Every ``metrics.csv`` and TensorBoard event file under ``root`` (or ``root`` itself if it is one)."""
    if root.is_file():
        return [root]
    found = sorted(root.rglob("metrics.csv")) + sorted(root.rglob("events.out.tfevents.*"))
    return sorted(found)


def read_csv(path: Path) -> RunLog:
    """The ``dynamix/...`` metrics of a Lightning ``CSVLogger`` file."""
    log = RunLog(source=path)
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            step_text = row.get("step", "")
            if not step_text:
                continue
            step = int(float(step_text))
            for name, text in row.items():
                if name and name.startswith(PREFIX) and text not in ("", None):
                    log.add(name, step, float(text))
    log.sort()
    return log


def read_tensorboard(path: Path) -> RunLog:
    """The ``dynamix/...`` scalars of one TensorBoard event file."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as error:  # pragma: no cover - tensorboard is a dependency
        raise RuntimeError(f"reading {path} needs the `tensorboard` package: pip install tensorboard") from error
    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
    accumulator.Reload()
    log = RunLog(source=path)
    for tag in accumulator.Tags().get("scalars", []):
        for event in accumulator.Scalars(tag):
            log.add(tag, int(event.step), float(event.value))
    log.sort()
    return log


def read_log(path: Path) -> RunLog:
    """A run's metrics from a ``metrics.csv`` or a TensorBoard event file."""
    if path.name == "metrics.csv" or path.suffix == ".csv":
        return read_csv(path)
    if path.name.startswith("events.out.tfevents"):
        return read_tensorboard(path)
    raise ValueError(f"{path} is neither a metrics.csv nor a TensorBoard event file")


def merge_by_directory(logs: list[RunLog]) -> list[RunLog]:
    """One run per directory: a resumed run writes a new event file next to the first one."""
    merged: dict[Path, RunLog] = {}
    for log in sorted(logs, key=lambda g: str(g.source)):
        run = merged.setdefault(log.source.parent, RunLog(source=log.source))
        for name, points in log.series.items():
            for step, value in points:
                run.add(PREFIX + name, step, value)
        for rank, table in log.ranks.items():
            for name, points in table.items():
                for step, value in points:
                    run.add(f"{PREFIX}rank_{rank}/{name}", step, value)
    for run in merged.values():
        run.sort()
    return list(merged.values())


def _plot_ranks(axis: Any, log: RunLog, name: str, scale: float = 1.0, style: str = "-", label: str = "") -> None:
    for rank in sorted(log.ranks):
        points = log.ranks[rank].get(name, [])
        if points:
            steps, values = zip(*points)
            axis.plot(steps, [scale * v for v in values], style, marker=".", label=f"rank {rank}{label}")


def plot_report(log: RunLog, path: Path, title: str = "") -> Path:
    """Six panels against the optimizer step; panels without data say so."""
    from lightning_dynamix.metrics.state import IDEAL_LABEL

    figure, axes = plt.subplots(3, 2, figsize=(12, 10), sharex=True)
    sizes, times, throughput, wait, noise, lr = axes.flat
    for rank in sorted(log.ranks):
        points = log.ranks[rank].get("batch_size", [])
        if points:
            steps, values = zip(*points)
            sizes.step(steps, values, where="pre", marker=".", label=f"rank {rank}")
    sizes.set_ylabel("batch size (samples)")
    sizes.set_title("per-rank batch size (each point: the interval ending there)")
    _plot_ranks(times, log, "step_time", 1e3)
    times.set_prop_cycle(None)
    _plot_ranks(times, log, "compute_time", 1e3, style="--", label=" compute")
    times.set_ylabel("ms per step")
    times.set_title("step time (solid) and own compute (dashed)")
    lines = (("throughput", "-", "achieved"), ("ideal_throughput", "--", IDEAL_LABEL))
    for name, style, label in lines:
        points = log.series.get(name, [])
        if points:
            steps, values = zip(*points)
            throughput.plot(steps, values, style, marker=".", label=label)
    throughput.set_ylabel("samples / s")
    throughput.set_title("throughput against the ideal")
    _plot_ranks(wait, log, "sync_wait", 1e3)
    wait.set_ylabel("ms per step")
    wait.set_title("waiting in the all-reduce (for others and the transfer)")
    for axis, name, label in ((noise, "gradient_noise_scale", "samples"), (lr, "lr", "learning rate")):
        points = log.series.get(name, [])
        if points:
            steps, values = zip(*points)
            axis.plot(steps, values, marker=".")
        else:
            axis.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=axis.transAxes)
        axis.set_ylabel(label)
    noise.set_title("gradient noise scale B_noise")
    lr.set_title("learning rate")
    for axis in axes.flat:
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    for axis in (sizes, times, throughput, wait):
        axis.set_ylim(bottom=0)
    for axis in axes[-1]:
        axis.set_xlabel("optimizer step")
    figure.suptitle(title or str(log.source))
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def summarise(log: RunLog) -> dict[str, Any]:
    """The figures a person looks at first: sizes at the start and end, decisions, throughput against the ideal."""
    steps = sorted({s for points in log.series.values() for s, _ in points})
    sizes_by_step: dict[int, list[int]] = defaultdict(list)
    for rank in sorted(log.ranks):
        for step, value in log.ranks[rank].get("batch_size", []):
            sizes_by_step[step].append(int(value))
    complete = [sizes_by_step[s] for s in sorted(sizes_by_step) if len(sizes_by_step[s]) == log.world_size]
    changes = sum(1 for a, b in itertools.pairwise(complete) if a != b)
    ratios = log.values("throughput_to_ideal")
    half = ratios[len(ratios) // 2 :]
    shares = [v for v in log.values("network_share") if math.isfinite(v)]
    noise = log.values("gradient_noise_scale")
    lr = log.values("lr")
    step_times = log.values("step_time")
    return {
        "source": str(log.source),
        "ranks": log.world_size,
        "intervals": len(steps),
        "first_step": steps[0] if steps else None,
        "last_step": steps[-1] if steps else None,
        "first_batch_sizes": complete[0] if complete else None,
        "last_batch_sizes": complete[-1] if complete else None,
        "size_changes": changes,
        "throughput_to_ideal_median": statistics.median(ratios) if ratios else None,
        "throughput_to_ideal_second_half": statistics.median(half) if half else None,
        "network_share_median": statistics.median(shares) if shares else None,
        "median_step_time_ms": 1e3 * statistics.median(step_times) if step_times else None,
        "last_gradient_noise_scale": noise[-1] if noise else None,
        "first_lr": lr[0] if lr else None,
        "last_lr": lr[-1] if lr else None,
    }


def _text(summary: dict[str, Any]) -> str:
    def number(value: Any, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}g}" if isinstance(value, float) else str(value)

    lines = [
        f"{summary['source']}",
        f"  {summary['ranks']} ranks, {summary['intervals']} intervals logged"
        f" (steps {summary['first_step']} to {summary['last_step']})",
        f"  batch sizes {summary['first_batch_sizes']} -> {summary['last_batch_sizes']}"
        f" ({summary['size_changes']} changes)",
        f"  throughput / ideal: median {number(summary['throughput_to_ideal_median'])},"
        f" second half {number(summary['throughput_to_ideal_second_half'])};"
        f" all-reduce / ideal step: median {number(summary['network_share_median'])};"
        f" median step {number(summary['median_step_time_ms'])} ms",
        f"  learning rate {number(summary['first_lr'])} -> {number(summary['last_lr'])};"
        f" gradient noise scale at the end {number(summary['last_gradient_noise_scale'])}",
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log_dir", type=Path, help="a run's log directory (searched for metrics.csv and event files)")
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help=f"where to write the plots (default: {REPORT_NAME} next to each log file)",
    )
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON instead of text")


def run_report(args: argparse.Namespace) -> None:
    root: Path = args.log_dir
    if not root.exists():
        raise SystemExit(f"dynamix report: {root} does not exist")
    logs = merge_by_directory([read_log(path) for path in find_logs(root)])
    logs = [log for log in logs if log.series or log.ranks]
    if not logs:
        raise SystemExit(
            f"dynamix report: no dynamix/... metrics under {root}; log a run with DynamixCallback or"
            " ClusterMetricsMonitor and a CSVLogger or TensorBoardLogger (or Accelerate's tensorboard tracker)"
        )
    summaries = []
    for index, log in enumerate(logs):
        run_dir = log.source.parent
        if args.output_dir is None:
            target = run_dir / REPORT_NAME
        else:
            name = run_dir.relative_to(root).as_posix().replace("/", "_") if run_dir != root else "run"
            target = args.output_dir / f"{name or f'run_{index}'}_{REPORT_NAME}"
        title = run_dir.relative_to(root).as_posix() if run_dir != root and root in run_dir.parents else str(run_dir)
        summary = summarise(log)
        summary["plot"] = str(plot_report(log, target, title=title))
        summaries.append(summary)
    if args.json:
        print(json.dumps(summaries, indent=2))
        return
    for summary in summaries:
        print(_text(summary))
        print(f"  plot: {summary['plot']}")
