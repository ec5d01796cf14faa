"""``dynamix demo``: a real multi-process job with fixed, uneven per-rank batch sizes."""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_dynamix.cli.timing import StepTimer
from lightning_dynamix.cli.workloads import DemoClassifier
from lightning_dynamix.strategies import HeterogeneousDDPStrategy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch-sizes",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[16, 48],
        help="per-rank batch sizes, comma-separated; their count is the number of processes (default 16,48)",
    )
    parser.add_argument("--max-steps", type=int, default=60, help="optimizer steps to train (default 60)")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per rank (default 0)")
    parser.add_argument(
        "--log-dir", type=Path, default=Path("dynamix_runs"), help="where the CSV logs go (default dynamix_runs)"
    )


def run(args: argparse.Namespace) -> None:
    sizes = args.batch_sizes
    timer = StepTimer(warmup=5)
    trainer = Trainer(
        accelerator="cpu",
        devices=len(sizes),
        strategy=HeterogeneousDDPStrategy(batch_sizes=sizes),
        max_steps=args.max_steps,
        logger=CSVLogger(args.log_dir, name="demo"),
        log_every_n_steps=5,
        callbacks=[timer],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = DemoClassifier(num_workers=args.num_workers)
    trainer.fit(model)
    if not trainer.is_global_zero:
        return
    total_samples = sum(t.samples for t in timer.timings)
    seconds = max(t.seconds for t in timer.timings)
    print(f"\nlightning-dynamix demo: {len(sizes)} processes, HeterogeneousDDPStrategy, fixed uneven batch sizes")
    print(f"{'rank':>4}  {'batch size':>10}  {'steps':>5}  {'samples':>7}  {'time (s)':>8}  {'samples/s':>9}")
    for timing, size in zip(timer.timings, sizes):
        print(
            f"{timing.rank:>4}  {size:>10}  {timing.steps:>5}  {timing.samples:>7}"
            f"  {timing.seconds:>8.2f}  {timing.samples_per_second:>9.1f}"
        )
    print(
        f"global batch {sum(sizes)}, {trainer.global_step} optimizer steps ({timer.timings[0].steps} timed):"
        f" {total_samples / seconds:.1f} samples/s in total;"
        f" final training loss {float(trainer.callback_metrics['train_loss']):.3f}"
    )
    print(f"logs: {trainer.logger.log_dir}")
