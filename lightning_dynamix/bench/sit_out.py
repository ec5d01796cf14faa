"""``dynamix bench sit-out``: what a step costs while ranks sit out, and while the sitting ranks change.

Ranks with no samples (``min_batch_size=0``) leave the step where DDP allows it: the ranks that train
all-reduce in a process group of their own, which every rank makes at the step a set of training
ranks first appears (:class:`~lightning_dynamix.distributed.TrainingRanksGroups`). The bench times
rank 0's training steps (wall seconds from one batch's start to the next, the second half of the
run) in three jobs of one global batch, on the built-in classification task:

* ``out``: 2 ranks, the split ``B:0`` (rank 1 always out): one group, made once;
* ``out3``: 3 ranks, the split ``B:0:0``;
* ``rotate``: 3 ranks, all ``B`` samples on one rank, the training rank moving every ``--every``
  steps (0, 1, 2, 0, ...): a group made by every rank at each new set and then reused, and the
  rank that comes back brought up to date (a broadcast of the others' state) at each move. Against
  ``out3``, what the moves cost;
* ``alone``: 1 rank with the whole batch: the job without the ranks that sit out.

Each job runs in a process of its own (``python -m lightning_dynamix.bench.sit_out --job ...``),
the jobs interleaved round by round; the report gives each job's median step time and samples/s
over the rounds with their spread (min-max).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

JOBS = ("out", "out3", "rotate", "alone")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", default="64,2048", help="widths of the classifier to time, comma-separated")
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch (default 32)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per job (default 300)")
    parser.add_argument("--every", type=int, default=20, help="steps between moves in the rotate job (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every job, interleaved (default 3)")
    every = ",".join(JOBS)
    parser.add_argument("--jobs", default=every, help=f"which jobs, comma-separated (default {every})")
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")


def run(args: argparse.Namespace) -> None:
    """Run every job ``--rounds`` times, interleaved, and print each one's medians."""
    from lightning_dynamix.bench.records import arguments_record, machine_description
    from lightning_dynamix.bench.rounds import interleaved_rounds

    widths = [int(h) for h in str(args.hidden).split(",")]
    jobs = [j.strip() for j in str(args.jobs).split(",")]
    for job in jobs:
        if job not in JOBS:
            raise SystemExit(f"--jobs: unknown job {job!r}; choose from {', '.join(JOBS)}")

    def measure(setup: tuple[str, int], index: int) -> float:
        job, hidden = setup
        command = [sys.executable, "-m", "lightning_dynamix.bench.sit_out", "--job", job]
        command += ["--hidden", str(hidden), "--batch-size", str(args.batch_size)]
        command += ["--steps", str(args.steps), "--every", str(args.every)]
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        step = json.loads(proc.stdout.strip().splitlines()[-1])["median_step_seconds"]
        print(f"round {index + 1}: {job:>6} hidden {hidden:>5}: {step * 1e3:.3f} ms a step", flush=True)
        return step

    setups = [(job, hidden) for hidden in widths for job in jobs]
    measured = interleaved_rounds(setups, args.rounds, measure)
    times = {f"{job} hidden {hidden}": steps for (job, hidden), steps in measured.items()}
    print(f"\nrank 0's step, median of {args.rounds} rounds (min-max); samples/s at the global batch {args.batch_size}")
    summary = {}
    for name, steps in times.items():
        median = statistics.median(steps)
        summary[name] = {"step_seconds": steps, "median_step_seconds": median}
        print(
            f"{name:>22}: {median * 1e3:7.3f} ms ({min(steps) * 1e3:.3f}-{max(steps) * 1e3:.3f}),"
            f" {args.batch_size / median:9,.0f} samples/s"
        )
    if args.output is not None:
        record = {"machine": machine_description(), "config": arguments_record(args), "results": summary}
        args.output.write_text(json.dumps(record, indent=2))


def _one_job(job: str, hidden: int, batch_size: int, steps: int, every: int) -> dict[str, Any]:
    """Train one job under Lightning's launcher; on rank 0, its median step time over the second half."""
    import torch
    from lightning.pytorch import Callback, Trainer

    from lightning_dynamix.data.workloads import ClassificationDataModule, ClassificationTask
    from lightning_dynamix.strategies import HeterogeneousDDPStrategy

    world = {"out": 2, "out3": 3, "rotate": 3, "alone": 1}[job]
    torch.set_num_threads(1)  # one core per rank: 3 ranks on 2 cores for rotate

    def sizes_at(step: int) -> list[int]:
        if job == "alone":
            return [batch_size]
        if job in ("out", "out3"):
            return [batch_size] + [0] * (world - 1)
        sizes = [0] * world
        sizes[(step // every) % world] = batch_size
        return sizes

    class Times(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            step = trainer.global_step
            if job == "rotate" and step % every == 0:
                trainer.strategy.set_batch_sizes(sizes_at(step), from_step=None)

    times = Times()
    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        strategy=HeterogeneousDDPStrategy(batch_sizes=sizes_at(0), min_batch_size=0, timeout=timedelta(seconds=120)),
        max_steps=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[times],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = ClassificationDataModule(num_samples=batch_size * (steps + 1), batch_size=batch_size)
    trainer.fit(ClassificationTask(hidden=hidden), datamodule=data)
    gaps = [b - a for a, b in zip(times.starts, times.starts[1:])]
    return {"job": job, "hidden": hidden, "median_step_seconds": statistics.median(gaps[len(gaps) // 2 :])}


def main() -> None:
    parser = argparse.ArgumentParser(description="one job of dynamix bench sit-out")
    parser.add_argument("--job", choices=JOBS, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    args = parser.parse_args()
    result = _one_job(args.job, args.hidden, args.batch_size, args.steps, args.every)
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
