"""``dynamix demo``: one rank 3x slower, static batches against DynamixCallback, side by side."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from lightning_dynamix.bench.arguments import floats
from lightning_dynamix.bench.harness import RunConfig, RunResult, is_launcher_rank_zero, run
from lightning_dynamix.bench.plots import plot_runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speeds", type=floats, default=(1.0, 3.0), help="slowdown per rank; one process each (default 1,3)"
    )
    parser.add_argument("--controller", default="pid", help="controller against static: pid or goodput (default pid)")
    parser.add_argument("--epochs", type=int, default=10, help="training epochs of each run (default 10)")
    parser.add_argument("--batch-size", type=int, default=128, help="initial batch size of every rank (default 128)")
    parser.add_argument(
        "--lr", type=float, default=0.1, help="SGD learning rate at the initial global batch (default 0.1)"
    )
    parser.add_argument("--target-accuracy", type=float, default=0.85, help="accuracy to time (default 0.85)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data, weights and order (default 0)")
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=Path("dynamix_runs/demo"),
        help="plot and results (default dynamix_runs/demo)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")


def _row(name: str, values: list[Any]) -> str:
    return f"{name:<30}" + "".join(f"{v:>14}" for v in values)


def run_demo(args: argparse.Namespace) -> None:
    results: dict[str, RunResult] = {}
    logs = args.output_dir / "logs"
    for controller in ("static", args.controller):
        if is_launcher_rank_zero():  # a previous demo's logs would be appended to
            shutil.rmtree(logs / controller, ignore_errors=True)
        config = RunConfig(
            controller=controller,
            speeds=args.speeds,
            batch_size=args.batch_size,
            epochs=args.epochs,
            lr=args.lr,
            target_accuracy=args.target_accuracy,
            seed=args.seed,
            log_dir=str(logs),
        )
        result = run(config)
        if result is not None:
            results[controller] = result
    if not is_launcher_rank_zero():
        return
    args.output_dir.mkdir(parents=True, exist_ok=True)
    plot = plot_runs(results, args.output_dir / "demo.png", title=f"speeds {list(args.speeds)}")
    (args.output_dir / "demo.json").write_text(json.dumps({k: r.as_dict() for k, r in results.items()}, indent=2))
    if args.json:
        print(json.dumps({name: _summary(r) for name, r in results.items()}, indent=2))
        return
    names = list(results)
    print(
        f"\nlightning-dynamix demo: {len(args.speeds)} processes, rank speeds {list(args.speeds)} (x slower),"
        f" {args.epochs} epochs, initial batch {args.batch_size} per rank"
    )
    print(_row("", names))
    print(_row("throughput / ideal", [f"{results[n].throughput_to_ideal:.2f}" for n in names]))
    print(_row("all-reduce / ideal step", [f"{results[n].network_share:.2f}" for n in names]))
    print(_row("samples / s", [f"{results[n].samples / results[n].train_seconds:.0f}" for n in names]))
    tta = [results[n].time_to_target for n in names]
    print(_row(f"time to {args.target_accuracy:.0%} accuracy (s)", [f"{t:.1f}" if t else "not reached" for t in tta]))
    print(_row("training time (s)", [f"{results[n].train_seconds:.1f}" for n in names]))
    print(_row("final accuracy", [f"{results[n].final_accuracy:.3f}" for n in names]))
    print(_row("final batch sizes", [",".join(map(str, _final_sizes(results[n]))) for n in names]))
    print(f"plot: {plot}\nresults: {args.output_dir / 'demo.json'}")
    print(f"logs: {logs} (dynamix report {logs} plots what each controller did)")


def _final_sizes(result: RunResult) -> list[int]:
    last = result.intervals[-1] if result.intervals else None
    if last is None:
        return [result.config["batch_size"]] * len(result.config["speeds"])
    return list(last["next_batch_sizes"] or last["batch_sizes"])


def _summary(result: RunResult) -> dict[str, Any]:
    return {
        "throughput_to_ideal": result.throughput_to_ideal,
        "network_share": result.network_share,
        "samples_per_s": result.samples / result.train_seconds,
        "time_to_target": result.time_to_target,
        "train_seconds": result.train_seconds,
        "final_accuracy": result.final_accuracy,
        "final_batch_sizes": _final_sizes(result),
    }
