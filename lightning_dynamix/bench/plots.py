"""PNG plots of heterogeneous runs: per-rank batch sizes and step times over training time."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from lightning_dynamix.bench.harness import RunResult
from lightning_dynamix.metrics.state import IDEAL_LABEL


def plot_runs(results: Mapping[str, RunResult], path: Path, title: str = "") -> Path:
    """One column per run: batch size per rank, compute time per rank, throughput against the ideal."""
    columns = len(results)
    figure, axes = plt.subplots(3, columns, figsize=(5.5 * columns, 9), sharex="col", squeeze=False)
    for column, (name, result) in enumerate(results.items()):
        intervals = result.intervals
        seconds = [i["seconds"] for i in intervals]
        world = len(result.config["speeds"])
        for rank in range(world):
            speed = result.config["speeds"][rank]
            label = f"rank {rank} ({speed:g}x slower)" if speed != 1 else f"rank {rank}"
            axes[0][column].step(seconds, [i["batch_sizes"][rank] for i in intervals], where="post", label=label)
            axes[1][column].plot(seconds, [1e3 * i["compute_time"][rank] for i in intervals], marker=".", label=label)
        achieved = [i["throughput"] for i in intervals]
        ideal = [i["ideal_throughput"] for i in intervals]
        axes[2][column].plot(seconds, achieved, marker=".", label="achieved")
        axes[2][column].plot(seconds, ideal, linestyle="--", label=IDEAL_LABEL)
        axes[0][column].set_title(f"{name}: throughput {result.throughput_to_ideal:.2f} of ideal")
        axes[0][column].set_ylabel("batch size (samples)")
        axes[1][column].set_ylabel("compute time per step (ms)")
        axes[2][column].set_ylabel("samples / s")
        axes[2][column].set_xlabel("training time (s)")
        for row in axes:
            row[column].grid(alpha=0.3)
            row[column].legend(fontsize=8)
        axes[0][column].set_ylim(bottom=0)
        axes[1][column].set_ylim(bottom=0)
        axes[2][column].set_ylim(bottom=0)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
