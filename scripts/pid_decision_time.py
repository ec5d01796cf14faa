"""How long ``PIDController.decide`` takes once a split has been held for many intervals (the gate's run in full).

``dynamix bench policy`` replays states whose split changes at almost every decision; this holds one split of
64 ranks (four speeds, a fixed and a per-sample cost, +-5% noise per interval) for 150 intervals and prints the
median decision time of the first 20 and of the last 50 (the gate then reads 64 intervals).

Run: ``.venv/bin/python scripts/pid_decision_time.py``
"""

from __future__ import annotations

import random
import statistics
import time

from lightning_dynamix.control import PIDController
from lightning_dynamix.metrics.state import ClusterState, WorkerMetrics


def main(ranks: int = 64, intervals: int = 150) -> None:
    rng = random.Random(0)
    controller = PIDController()
    sizes = [32] * ranks
    per_sample = [1e-4 * (1 + r % 4) for r in range(ranks)]
    seconds = []
    for _ in range(intervals):
        times = [(4e-3 + c * b) * rng.uniform(0.95, 1.05) for c, b in zip(per_sample, sizes)]
        workers = tuple(
            WorkerMetrics(rank=r, batch_size=b, compute_time=t, step_time=max(times))
            for r, (b, t) in enumerate(zip(sizes, times))
        )
        state = ClusterState(workers=workers)
        start = time.perf_counter()
        sizes = list(controller.decide(state).batch_sizes)
        seconds.append(time.perf_counter() - start)
    print(
        f"PIDController.decide at {ranks} ranks: first 20 intervals median {1e3 * statistics.median(seconds[:20]):.2f}"
        f" ms, last 50 median {1e3 * statistics.median(seconds[-50:]):.2f} ms"
    )


if __name__ == "__main__":
    main()
