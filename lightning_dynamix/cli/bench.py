"""``dynamix bench``: measured comparisons, run as real multi-process jobs on this machine."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import lightning
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy

from lightning_dynamix import __version__
from lightning_dynamix.cli.timing import StepTimer
from lightning_dynamix.cli.workloads import DemoClassifier
from lightning_dynamix.strategies import HeterogeneousDDPStrategy


def add_overhead_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--rounds", type=int, default=10, help="back-to-back pairs of runs (default 10)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per run (default 100)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps at the start of each run (default 20)")
    parser.add_argument("--batch-size", type=int, default=128, help="batch size of every rank (default 128)")
    parser.add_argument("--features", type=int, default=512, help="input features (default 512)")
    parser.add_argument("--hidden", type=int, default=1024, help="width of the hidden layers (default 1024)")
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")


def _median_step(strategy: object, args: argparse.Namespace) -> float:
    timer = StepTimer(warmup=args.warmup)
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.warmup + args.steps,
        logger=False,
        callbacks=[timer],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # no per-step synchronised logging: Lightning's own sync adds a barrier that would hide our costs
    model = DemoClassifier(
        num_samples=8192,
        num_features=args.features,
        num_classes=10,
        hidden=args.hidden,
        batch_size=args.batch_size,
        sync_dist=False,
    )
    trainer.fit(model)
    # the job's step time: every rank waits for the slowest in the all-reduce
    return max(t.median_step_seconds for t in timer.timings)


def run_overhead(args: argparse.Namespace) -> None:
    """Plain Lightning DDP against HeterogeneousDDPStrategy with equal sizes, alternating ABBA."""
    ratios, plain_steps, ours_steps = [], [], []
    for round_index in range(args.rounds):
        order = ("ddp", "ours") if round_index % 2 == 0 else ("ours", "ddp")
        measured = {}
        for variant in order:
            strategy = (
                DDPStrategy()
                if variant == "ddp"
                else HeterogeneousDDPStrategy(batch_sizes=[args.batch_size] * args.devices)
            )
            measured[variant] = _median_step(strategy, args)
        plain_steps.append(measured["ddp"])
        ours_steps.append(measured["ours"])
        ratios.append(measured["ours"] / measured["ddp"])
    if int(os.environ.get("LOCAL_RANK", "0")) != 0 or int(os.environ.get("NODE_RANK", "0")) != 0:
        return
    result = {
        "benchmark": "overhead",
        "median_ratio": statistics.median(ratios),
        "ratios": ratios,
        "median_step_ms_ddp": 1e3 * statistics.median(plain_steps),
        "median_step_ms_heterogeneous_ddp": 1e3 * statistics.median(ours_steps),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "lightning_dynamix": __version__,
        },
    }
    print(
        f"\ndynamix bench overhead: {args.devices} processes (gloo, CPU), batch {args.batch_size} per rank,"
        f" MLP {args.features}-{args.hidden}-{args.hidden}-10, {args.rounds} rounds of {args.steps} timed steps"
    )
    print(f"{'round':>5}  {'ddp (ms/step)':>13}  {'heterogeneous_ddp (ms/step)':>27}  {'ratio':>6}")
    for i, (plain, ours, ratio) in enumerate(zip(plain_steps, ours_steps, ratios)):
        print(f"{i:>5}  {1e3 * plain:>13.2f}  {1e3 * ours:>27.2f}  {ratio:>6.3f}")
    print(
        f"median step-time ratio heterogeneous_ddp / ddp: {result['median_ratio']:.3f}"
        f" (goal <= 1.01); median steps {result['median_step_ms_ddp']:.2f} ms vs"
        f" {result['median_step_ms_heterogeneous_ddp']:.2f} ms"
    )
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2))
