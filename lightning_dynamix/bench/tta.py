"""``dynamix bench tta``: time to a target accuracy and final accuracy per controller, over seeds, against the best
fixed split (``--oracle``) and fixed global batches (``--oracle-global-batches``) trained the same way."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from lightning_dynamix._stats import median_or
from lightning_dynamix.bench import harness
from lightning_dynamix.bench.arguments import global_batches
from lightning_dynamix.bench.cluster_runs import (
    add_cluster_arguments,
    check_machine,
    contention_for,
    hidden_width,
    links_header,
    run_config,
)
from lightning_dynamix.bench.harness import RunResult, is_launcher_rank_zero
from lightning_dynamix.bench.oracle import fixed_split_measure, search_best_fixed_split
from lightning_dynamix.bench.plots import plot_runs
from lightning_dynamix.bench.records import machine_description
from lightning_dynamix.bench.rounds import interleaved_rounds
from lightning_dynamix.control.allocation import split_in_proportion
from lightning_dynamix.control.lr_scaling import lr_scale, validate_lr_scaling


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``dynamix bench tta``."""
    add_cluster_arguments(parser, batch_size=128, controllers="static,pid,goodput,ppo")
    parser.add_argument("--seeds", type=int, default=3, help="runs per controller, seeds 0..N-1 (default 3)")
    parser.add_argument("--epochs", type=int, default=10, help="training epochs per run (default 10)")
    parser.add_argument("--target-accuracy", type=float, default=0.85, help="accuracy to time (default 0.85)")
    parser.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="time to this validation loss instead of --target-accuracy (causal-lm: the token-mean loss)",
    )
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate at the initial global batch (default 0.1)")
    parser.add_argument("--depth", type=int, default=2, help="MLP hidden layers or transformer layers (default 2)")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="default sgd (momentum 0.9)")
    parser.add_argument(
        "--lr-scaling",
        default="adascale",
        help="rule when the global batch changes: none, linear, sqrt, adascale (default adascale; static and pid"
        " keep the global batch, so it only acts on goodput and ppo, and on pid with --pid-max-global-batch)",
    )
    parser.add_argument(
        "--pid-max-global-batch",
        type=int,
        default=None,
        help="pid may grow the global batch up to this many samples while the all-reduce takes more than a fifth"
        " of the step (PIDController(max_global_batch_size=...)); default: pid keeps the global batch",
    )
    parser.add_argument(
        "--oracle-steps",
        type=int,
        default=60,
        help="optimizer steps of each of the oracle's search runs (default 60); the best split is then trained like"
        " the controllers, as the row 'best-fixed'",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="write every run's dynamix/... metrics (CSV) to LOG_DIR/ROW-seedK/, what `dynamix report` and `dynamix"
        " calibrate` read",
    )
    parser.add_argument(
        "--oracle-global-batches",
        type=global_batches,
        default=(),
        help="comma-separated global batches (samples), each trained fixed like the controllers (rows fixed@B: the"
        " oracle's best split, or the even one without --oracle, scaled to B; the learning rate scaled by"
        " --lr-scaling, adascale taken as sqrt); 'best-fixed' is then the one that reached the target first",
    )


def fixed_global_batch(
    split: tuple[int, ...], global_batch: int, lr: float, lr_scaling: str
) -> tuple[tuple[int, ...], float]:
    """A fixed run at ``global_batch``: ``split`` scaled to it (every rank >= 1 sample) and its learning rate.

    The learning rate follows ``lr_scaling`` from the split's global batch, with ``"adascale"`` taken as
    ``"sqrt"`` (its value while the noise scale is unknown: a fixed run does not measure it).
    """
    base = sum(split)
    sizes = split_in_proportion(global_batch, split, [1] * len(split), [None] * len(split))
    rule = "sqrt" if lr_scaling == "adascale" else lr_scaling
    return sizes, lr * lr_scale(rule, global_batch, base)


def run(args: argparse.Namespace) -> None:
    """Run ``dynamix bench tta`` as ``args`` say, and print or write its results."""
    if args.oracle and args.schedule:
        raise SystemExit("--oracle searches one fixed split for fixed speeds; it cannot be combined with --schedule")
    if args.oracle_steps < 10:
        raise SystemExit(f"--oracle-steps must be >= 10 (a run's second half is measured), got {args.oracle_steps}")
    initial = args.batch_size * len(args.speeds)
    if args.pid_max_global_batch is not None and args.pid_max_global_batch < initial:
        raise SystemExit(
            f"--pid-max-global-batch must be at least the initial global batch ({initial}: --batch-size"
            f" {args.batch_size} x {len(args.speeds)} ranks), got {args.pid_max_global_batch}"
        )
    try:
        validate_lr_scaling(args.lr_scaling)
    except ValueError as error:
        raise SystemExit(f"--lr-scaling: {error}") from None
    check_machine(args)
    with contention_for(args):
        output = _runs(args)
    if output is not None:
        _report(args, output)


def _runs(args: argparse.Namespace) -> dict[str, Any] | None:
    controllers = args.controllers.split(",")
    base = run_config(
        args,
        epochs=args.epochs,
        lr=args.lr,
        lr_scaling=args.lr_scaling,
        depth=args.depth,
        optimizer=args.optimizer,
        target_accuracy=args.target_accuracy,
        target_loss=args.target_loss,
        pid_max_global_batch=args.pid_max_global_batch,
    )
    best: tuple[int, ...] | None = None
    oracle = None
    if args.oracle:  # short runs of fixed splits, then the best one trained like the controllers
        search = dataclasses.replace(base, epochs=1000, max_steps=args.oracle_steps, val_checks_per_epoch=1)
        oracle = search_best_fixed_split(args, fixed_split_measure(search, args.oracle_steps // 2), low=1)
        best = tuple(oracle["best_split"])
    # fixed runs: row name -> (split, learning rate)
    fixed: dict[str, tuple[tuple[int, ...], float]] = {}
    if best is not None and not args.oracle_global_batches:
        fixed["best-fixed"] = (best, args.lr)
    split = best or (args.batch_size,) * len(args.speeds)
    for total in args.oracle_global_batches:
        fixed[f"fixed@{total}"] = fixed_global_batch(split, total, args.lr, args.lr_scaling)

    def train(row: str, seed: int) -> RunResult | None:  # a round is a seed
        if row in fixed:
            sizes, lr = fixed[row]
            config = dataclasses.replace(
                base, controller="static", batch_sizes=sizes, lr=lr, max_batch_size=max(base.max_batch_size, *sizes)
            )
        else:
            config = dataclasses.replace(base, controller=row)
        log_dir = None if args.log_dir is None else str(args.log_dir / f"{row}-seed{seed}")
        return harness.run(dataclasses.replace(config, seed=seed, log_dir=log_dir))

    results = interleaved_rounds([*fixed, *controllers], args.seeds, train)
    if not is_launcher_rank_zero():
        return None
    table = {}
    for controller, runs in results.items():
        reached = [r.time_to_target for r in runs if r.time_to_target is not None]
        table[controller] = {
            "median_samples_per_second": median_or([r.samples / r.train_seconds for r in runs if r.train_seconds > 0]),
            "runs": len(runs),
            "reached_target": len(reached),
            "median_time_to_target": median_or(reached) if len(reached) == len(runs) else None,
            "times_to_target": [r.time_to_target for r in runs],
            "median_final_accuracy": median_or([r.final_accuracy for r in runs]),
            "median_train_seconds": median_or([r.train_seconds for r in runs]),
            "median_throughput_to_ideal": median_or([r.throughput_to_ideal for r in runs]),
            "median_work_to_ideal": median_or([r.work_to_ideal for r in runs]),
            "median_network_share": median_or([r.network_share for r in runs]),
        }
    best_fixed = None
    if args.oracle_global_batches:  # the fixed global batch that reached the target first, in every run
        reached = {c: table[c]["median_time_to_target"] for c in fixed if table[c]["median_time_to_target"] is not None}
        best_fixed = min(reached, key=lambda c: reached[c]) if reached else None
        if best_fixed is not None:
            table["best-fixed"] = dict(table[best_fixed], row=best_fixed)
            best_time = reached[best_fixed]
            for row in table.values():
                tta = row["median_time_to_target"]
                row["time_to_target_of_best_fixed"] = None if tta is None else tta / best_time
    if "best-fixed" in table:
        best_rate = table["best-fixed"]["median_samples_per_second"]
        for row in table.values():
            rate = row["median_samples_per_second"]
            row["fraction_of_best_fixed_split"] = None if rate is None or not best_rate else rate / best_rate
    output = {
        "benchmark": "tta",
        "speeds": list(args.speeds),
        "contention": args.contention,
        "oracle": oracle,
        "fixed_runs": {name: {"batch_sizes": list(sizes), "lr": lr} for name, (sizes, lr) in fixed.items()},
        "best_fixed": best_fixed,
        "schedule": [list(c) for c in args.schedule],
        "load_changes": [dataclasses.asdict(c) for c in args.load_changes],
        "target_accuracy": args.target_accuracy,
        "target_loss": args.target_loss,
        "controllers": table,
        "runs": {c: [r.as_dict() for r in rs] for c, rs in results.items()},
        "machine": machine_description(),
    }
    if args.plot is not None:
        plot_runs({c: rs[0] for c, rs in results.items() if rs}, args.plot, title="seed 0")
    return output


def _report(args: argparse.Namespace, output: dict[str, Any]) -> None:
    if args.output is not None:
        args.output.write_text(json.dumps(output, indent=2))
    if args.json:
        print(json.dumps({k: v for k, v in output.items() if k != "runs"}, indent=2))
        return
    changes = "".join(f", rank {r} x{f:g} from step {s}" for s, r, f in args.schedule)
    norm = ", global BatchNorm" if args.sync_batchnorm else ""
    width = hidden_width(args)
    model = f"{args.architecture} (hidden {width}, depth {args.depth}, {args.optimizer} lr {args.lr:g}{norm})"
    print(
        f"\ndynamix bench tta: {model}, speeds {list(args.speeds)} ({args.contention}){changes},{links_header(args)}"
        f" {args.epochs} epochs,"
        f" target {_target(args)}, {args.seeds} seeds (medians)"
    )
    if output["best_fixed"] is not None:
        best = output["fixed_runs"][output["best_fixed"]]
        split = ",".join(map(str, best["batch_sizes"]))
        print(
            f"best-fixed: {output['best_fixed']} (split {split}, lr {best['lr']:.4g}),"
            " the fixed global batch that reached the target first"
        )
    elif output["oracle"] is not None:
        print(f"best-fixed: the split {','.join(map(str, output['oracle']['best_split']))}, the oracle's best")
    timed = output["best_fixed"] is not None
    print(
        f"{'controller':>12}  {'time to target (s)':>18}  {'reached':>7}  {'final accuracy':>14}"
        f"  {'training time (s)':>17}  {'samples/s':>9}  {'of best fixed':>13}"
        + (f"  {'time / best fixed':>17}" if timed else "")
        + f"  {'throughput / ideal':>18}"
        + (f"  {'tokens/s / ideal':>16}" if args.architecture == "causal-lm" else "")
        + f"  {'all-reduce / ideal step':>23}"
    )
    for controller, row in output["controllers"].items():
        fraction = row.get("fraction_of_best_fixed_split")
        of_time = row.get("time_to_target_of_best_fixed")
        print(
            f"{controller:>12}  {_cell(row['median_time_to_target'], '.1f'):>18}"
            f"  {row['reached_target']:>3}/{row['runs']:<3}"
            f"  {_cell(row['median_final_accuracy'], '.3f'):>14}  {_cell(row['median_train_seconds'], '.1f'):>17}"
            f"  {_cell(row['median_samples_per_second'], '.0f'):>9}  {_cell(fraction, '.3f'):>13}"
            + (f"  {_cell(of_time, '.3f'):>17}" if timed else "")
            + f"  {_cell(row['median_throughput_to_ideal'], '.3f'):>18}"
            + (f"  {_cell(row['median_work_to_ideal'], '.3f'):>16}" if args.architecture == "causal-lm" else "")
            + f"  {_cell(row['median_network_share'], '.3f'):>23}"
        )


def _target(args: argparse.Namespace) -> str:
    """What time to target is timed to: a validation loss or accuracy."""
    return f"loss {args.target_loss}" if args.target_loss is not None else f"accuracy {args.target_accuracy}"


def _cell(value: float | None, spec: str) -> str:
    """A table cell: ``value`` formatted, ``-`` where nothing was measured."""
    return "-" if value is None else format(value, spec)
