"""``dynamix bench balance``: achieved throughput against the ideal (the ranks finishing together, the all-reduce's
exposed time included; its share of the ideal step beside it), and against the best fixed split measured in the
same invocation (``--oracle``), per controller, in interleaved rounds."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
from typing import Any

from lightning_dynamix._stats import median_or
from lightning_dynamix.bench import harness
from lightning_dynamix.bench.arguments import splits
from lightning_dynamix.bench.cluster_runs import (
    add_cluster_arguments,
    change_steps,
    check_machine,
    contention_for,
    first_change,
    links_header,
    run_config,
)
from lightning_dynamix.bench.harness import RunResult, is_launcher_rank_zero, samples_per_second
from lightning_dynamix.bench.oracle import fixed_split_measure, search_best_fixed_split
from lightning_dynamix.bench.plots import plot_runs
from lightning_dynamix.bench.records import machine_description
from lightning_dynamix.bench.rounds import interleaved_rounds
from lightning_dynamix.bench.streamed import streamed_data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``dynamix bench balance``."""
    add_cluster_arguments(parser, batch_size=256, controllers="pid")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    parser.add_argument(
        "--streaming",
        nargs="?",
        const="shuffled",
        choices=("shuffled", "in-order"),
        default=None,
        help="read the training split as a LitData StreamingDataset, written into a temporary directory before the"
        " runs (mlp and transformer; needs litdata), each chunk's samples shuffled or, with 'in-order', in the"
        " chunk's own order (StreamingView(shuffle_within_chunks=False)); default: in memory, map-style",
    )
    parser.add_argument(
        "--min-batch-size",
        type=int,
        default=None,
        help="smallest size a rank may be given (default 1, or 2 for a model with BatchNorm); 0 lets the controller"
        " sit a straggler out",
    )
    parser.add_argument(
        "--keep-global-batch",
        action="store_true",
        help="goodput and ppo only move samples between ranks instead of also choosing the global batch",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs per controller, in turn with (under --oracle) a fresh run of the best fixed split, each round"
        " starting one further along (default 1)",
    )
    parser.add_argument(
        "--fixed-splits",
        type=splits,
        default=(),
        help="fixed splits of the global batch to run like the controllers, e.g. '128,128;171,85' (rows 'fixed"
        " A,B'); with a --schedule each phase between its changes is then judged against the best of them in that"
        " phase",
    )


_BEST = "best fixed split"  # the turn of each round that runs the oracle's best split again


def run(args: argparse.Namespace) -> None:
    """Run ``dynamix bench balance`` as ``args`` say, and print or write its results."""
    if args.min_batch_size is not None and args.min_batch_size < 0:
        raise SystemExit(f"--min-batch-size must be >= 0 (0: a rank may sit out), got {args.min_batch_size}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    total = args.batch_size * len(args.speeds)
    for split in args.fixed_splits:
        if len(split) != len(args.speeds) or sum(split) != total:
            raise SystemExit(
                f"--fixed-splits: {','.join(map(str, split))} must give each of the {len(args.speeds)} ranks a size,"
                f" summing to the global batch {total} (--batch-size x ranks)"
            )
    check_machine(args)
    if args.streaming and args.architecture not in ("mlp", "transformer"):
        raise SystemExit(
            f"--streaming reads the mlp and transformer workloads' data, not --architecture {args.architecture}"
        )
    with contention_for(args), streamed_data(args):
        summary = _runs(args)
    if summary is not None:
        _report(args, summary)


def _runs(args: argparse.Namespace) -> dict[str, Any] | None:
    controllers = args.controllers.split(",")
    half = args.steps // 2
    config = run_config(
        args,
        controller=controllers[0],
        epochs=1000,
        max_steps=args.steps,
        val_checks_per_epoch=1,
        min_batch_size=args.min_batch_size,
        keep_global_batch=args.keep_global_batch,
    )
    measure = fixed_split_measure(config, half)
    # the same run with fixed splits, measured before the controllers'
    low = args.min_batch_size if args.min_batch_size is not None else (2 if args.architecture == "resnet" else 1)
    oracle = search_best_fixed_split(args, measure, low) if args.oracle else None
    # the best of many noisy measurements is biased upwards: the controllers are judged against fresh
    # runs of that split, in interleaved rounds with theirs, so drift on the machine hits both alike
    best = tuple(oracle["best_split"]) if oracle is not None else None
    fixed = {f"fixed {','.join(map(str, split))}": split for split in args.fixed_splits}

    def measure_turn(turn: str, _: int) -> RunResult | float | None:
        if turn == _BEST:
            assert best is not None
            return harness.run(dataclasses.replace(config, controller="static", batch_sizes=best))
        if turn in fixed:
            return harness.run(dataclasses.replace(config, controller="static", batch_sizes=fixed[turn]))
        return harness.run(dataclasses.replace(config, controller=turn))

    turns = [*([_BEST] if best is not None else []), *fixed, *controllers]
    measured = interleaved_rounds(turns, args.rounds, measure_turn)
    best_runs: list[RunResult] = measured.pop(_BEST, [])  # type: ignore[arg-type]
    runs: dict[str, list[RunResult]] = measured  # type: ignore[assignment]
    if not is_launcher_rank_zero():
        return None
    fixed_rates = [samples_per_second(r, half) for r in best_runs]
    fixed_whole = [samples_per_second(r, 0) for r in best_runs]
    if oracle is not None:
        oracle["best_samples_per_second_rounds"] = fixed_rates
        oracle["best_samples_per_second"] = statistics.median(fixed_rates)
        oracle["best_samples_per_second_whole_run_rounds"] = fixed_whole
    change = first_change(args)
    table: dict[str, Any] = {}
    for controller, results in runs.items():
        rates = [samples_per_second(r, half) for r in results]
        whole = [samples_per_second(r, 0) for r in results]
        settling = None if change is None else settling_intervals(results[0], change)
        table[controller] = {
            "samples_per_second_rounds": rates,
            "samples_per_second_second_half": statistics.median(rates),
            "fraction_of_best_fixed_split": None
            if oracle is None
            else statistics.median(rates) / oracle["best_samples_per_second"],
            # each round against the same round's run of the best fixed split: the second half, and the whole run
            # (the controller's first decisions, which the fixed split does without, included)
            "fraction_of_best_fixed_split_rounds": None
            if oracle is None
            else [rate / best_rate for rate, best_rate in zip(rates, fixed_rates)],
            "samples_per_second_whole_run_rounds": whole,
            "fraction_of_best_fixed_split_whole_run_rounds": None
            if oracle is None
            else [rate / best_rate for rate, best_rate in zip(whole, fixed_whole)],
            # per round: the step whose decision first put every rank within 2% (of the global batch) of its share
            # in the run's final split
            "settled_at_step_rounds": [settled_at_step(r) for r in results],
            "throughput_to_ideal_second_half": statistics.median(_ratio_after(r, half) for r in results),
            # the all-reduce's share of the ideal step (what no split removes)
            "network_share_second_half": median_or(
                (_median_after(r, half, "network_share") for r in results), math.nan
            ),
            # the language model's: token positions per second (padding included), against their ideal, and padding
            "tokens_per_second_rounds": [_median_after(r, half, "work_throughput") for r in results],
            "tokens_to_ideal_second_half": statistics.median(
                _ratio_after(r, half, "work_throughput", "ideal_work_throughput") for r in results
            ),
            "padding_second_half": statistics.median(_median_after(r, half, "padding") for r in results),
            "final_batch_sizes": [r.intervals[-1]["next_batch_sizes"] if r.intervals else None for r in results],
            # each rank's sizes over the second half, per round: how far the controller kept moving them
            "size_spread_second_half": [size_spread(r, half) for r in results],
            # a speed change: decisions until the first round's sizes settled, and throughput / ideal after
            "settling_intervals": settling,
            "throughput_to_ideal_after_settling": _after_settling(results[0], change, args.interval, settling),
        }
    changes = change_steps(args)
    phases = phase_bounds(changes, args.steps) if changes else []
    for controller, results in runs.items():  # each phase between the load's changes on its own
        table[controller]["phases"] = [
            {
                "from_step": start,
                "to_step": end,
                "samples_per_second": statistics.median(
                    phase_samples_per_second(r, start, end, args.interval) for r in results
                ),
                # decisions after the phase's change until the first round's sizes settled for the phase
                "settling_decisions": settling_intervals(results[0], start, until_step=end)
                if start > 0 and controller not in fixed
                else None,
            }
            for start, end in phases
        ]
    for k, _ in enumerate(phases):  # against the best fixed split of each phase
        best_rate = max((table[name]["phases"][k]["samples_per_second"] for name in fixed), default=None)
        for row in table.values():
            phase = row["phases"][k]
            phase["fraction_of_best_fixed_split"] = None if not best_rate else phase["samples_per_second"] / best_rate
    if args.plot is not None:
        plot_runs({c: results[0] for c, results in runs.items()}, args.plot, title=f"speeds {list(args.speeds)}")
    return {
        "benchmark": "balance",
        "contention": args.contention,
        "speeds": list(args.speeds),
        "oracle": oracle,
        "controllers": table,
        "runs": {c: [r.intervals for r in results] for c, results in runs.items()},  # per controller, per round
        "config": dataclasses.asdict(config),
        "machine": machine_description(),
    }


def _report(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    if args.output is not None:
        args.output.write_text(json.dumps(summary, indent=2))
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
        return
    for controller, rounds in summary["runs"].items():
        print(
            f"\ndynamix bench balance: {len(args.speeds)} processes, speeds {list(args.speeds)} ({args.contention}),"
            f"{links_header(args)}"
            f" controller {controller}, {args.steps} steps, decisions every {args.interval}, first round"
        )
        print(
            f"{'step':>5}  {'batch sizes':>16}  {'compute per rank (ms)':>24}  {'throughput / ideal':>18}"
            f"  {'all-reduce / ideal step':>23}"
        )
        for i in rounds[0]:
            compute = ", ".join(f"{1e3 * c:.1f}" for c in i["compute_time"])
            sizes = ",".join(map(str, i["batch_sizes"]))
            print(
                f"{i['step']:>5}  {sizes:>16}  {compute:>24}  {i['throughput'] / i['ideal_throughput']:>18.3f}"
                f"  {i['network_share']:>23.3f}"
            )
    oracle = summary["oracle"]
    if oracle is not None:
        rounds = ", ".join(f"{v:.1f}" for v in oracle["best_samples_per_second_rounds"])
        print(
            f"\nbest fixed split {','.join(map(str, oracle['best_split']))} of {len(oracle['measured'])} measured"
            f" ({oracle['best_samples_per_second_in_search']:.1f} samples/s in the search, the mean of its two"
            f" measurements); run again in each round:"
            f" {rounds} samples/s"
        )
    print(
        f"{'controller':>10}  {'samples/s, second half (rounds)':>40}  {'of best fixed split':>19}  {'/ ideal':>7}"
        f"  {'all-reduce / ideal step':>23}"
    )
    for controller, row in summary["controllers"].items():
        rates = ", ".join(f"{v:.0f}" for v in row["samples_per_second_rounds"])
        fraction = row["fraction_of_best_fixed_split"]
        print(
            f"{controller:>10}  {rates:>40}  {'-' if fraction is None else f'{fraction:.3f}':>19}"
            f"  {row['throughput_to_ideal_second_half']:>7.3f}  {row['network_share_second_half']:>23.3f}"
        )
        if row["fraction_of_best_fixed_split_rounds"] is not None:
            halves = ", ".join(f"{v:.3f}" for v in row["fraction_of_best_fixed_split_rounds"])
            wholes = ", ".join(f"{v:.3f}" for v in row["fraction_of_best_fixed_split_whole_run_rounds"])
            print(f"{'':>10}  of the round's best fixed split: second half {halves}; whole run {wholes}")
        settled = ", ".join("-" if s is None else str(s) for s in row["settled_at_step_rounds"])
        print(f"{'':>10}  first within 2% of its final split at step (rounds): {settled}")
        if args.architecture == "causal-lm":
            tokens = ", ".join(f"{v:.0f}" for v in row["tokens_per_second_rounds"])
            print(
                f"{'':>10}  tokens/s, second half (rounds): {tokens}; / ideal {row['tokens_to_ideal_second_half']:.3f};"
                f" padding {100 * row['padding_second_half']:.1f}%"
            )
        spreads = [spread for spread in row["size_spread_second_half"] if spread]
        if spreads:
            worst = max(rank["of_global_batch"] for spread in spreads for rank in spread)
            ranges = "; ".join(", ".join(f"{rank['min']:g}-{rank['max']:g}" for rank in spread) for spread in spreads)
            print(
                f"{'':>10}  sizes over the second half per round: {ranges}"
                f" (widest {100 * worst:.1f}% of the global batch)"
            )
        if row["settling_intervals"] is not None:
            print(
                f"{'':>10}  after the change at step {first_change(args)}: settled in"
                f" {row['settling_intervals']} decision(s); throughput / ideal after settling"
                f" {_or_dash(row['throughput_to_ideal_after_settling'])}"
            )
        for phase in row.get("phases", []):
            settled = phase["settling_decisions"]
            print(
                f"{'':>10}  steps {phase['from_step']}-{phase['to_step']}: {phase['samples_per_second']:.0f} samples/s"
                f" ({_or_dash(phase['fraction_of_best_fixed_split'])} of the phase's best fixed split)"
                + ("" if settled is None else f", settled in {settled} decision(s)")
            )


def settled_at_step(result: RunResult, tolerance: float = 0.02) -> int | None:
    """The step of the first decision whose split put every rank within ``tolerance`` of its share of the global batch
    in the run's final split (shares, so a global batch that moved is compared by how it is divided); ``None``
    without decisions. A run that never moves settles at its first decision."""
    decisions = [(i["step"], i["next_batch_sizes"]) for i in result.intervals if i["next_batch_sizes"]]
    if not decisions:
        return None
    final = [b / sum(decisions[-1][1]) for b in decisions[-1][1]]

    def close(sizes: list[int]) -> bool:
        shares = [b / sum(sizes) for b in sizes]
        return len(shares) == len(final) and all(abs(a - f) <= tolerance for a, f in zip(shares, final))

    return next(step for step, sizes in decisions if close(sizes))  # the last decision is close to itself


def phase_bounds(changes: list[int], steps: int) -> list[tuple[int, int]]:
    """The run's phases between the steps its load changes at: ``[(0, c1), (c1, c2), ..., (ck, steps)]``."""
    edges = [0, *sorted({c for c in changes if 0 < c < steps}), steps]
    return list(itertools.pairwise(edges))


def phase_samples_per_second(result: RunResult, start: int, end: int, interval: int) -> float:
    """Median samples/s over the run's intervals wholly inside the phase ``(start, end]`` (steps)."""
    values = [i["throughput"] for i in result.intervals if i["step"] - interval >= start and i["step"] <= end]
    return statistics.median(values) if values else float("nan")


def size_spread(result: RunResult, after_step: int) -> list[dict[str, float]] | None:
    """Each rank's batch size over the run's intervals after ``after_step``: its least and largest, and their
    difference as a share of the global batch (how far the controller kept moving it); ``None`` without one."""
    sizes = [i["batch_sizes"] for i in result.intervals if i["step"] > after_step]
    if not sizes:
        return None
    spread = []
    for rank in range(len(sizes[0])):
        mine = [s[rank] for s in sizes]
        total = statistics.median(sum(s) for s in sizes)
        spread.append({"min": min(mine), "max": max(mine), "of_global_batch": (max(mine) - min(mine)) / total})
    return spread


def settling_intervals(
    result: RunResult, change_step: int, tolerance: float = 0.1, until_step: int | None = None
) -> int | None:
    """Decisions after ``change_step`` until the sizes stay within ``tolerance`` of the run's final ones
    (of the last decision up to ``until_step``, the next change, where given).

    Counts the decisions taken after the change up to and including the first one from which
    every later decision is within ``tolerance`` (relative, per rank) of the last decision;
    ``None`` when there were no decisions after the change.
    """
    after = [
        i["next_batch_sizes"]
        for i in result.intervals
        if i["step"] > change_step and i["next_batch_sizes"] and (until_step is None or i["step"] <= until_step)
    ]
    if not after:
        return None
    final = after[-1]

    def close(sizes: list[int]) -> bool:
        return all(abs(b - f) <= tolerance * f for b, f in zip(sizes, final, strict=True))

    settled = len(after)
    while settled > 0 and close(after[settled - 1]):
        settled -= 1
    return settled + 1


def _after_settling(result: RunResult, change: int | None, interval: int, settling: int | None) -> float | None:
    """Throughput / ideal after the sizes settled; ``None`` without a change, or when they settled at the run's end."""
    if change is None or settling is None:
        return None
    step = change + interval * settling
    return _ratio_after(result, step) if any(i["step"] > step for i in result.intervals) else None


def _or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _median_after(result: RunResult, step: int, key: str) -> float:
    """The median of the intervals' ``key`` after ``step`` (NaN where it was not measured: the work, the network)."""
    values = [i[key] for i in result.intervals if i["step"] > step and math.isfinite(i.get(key, math.nan))]
    return statistics.median(values) if values else math.nan


def _ratio_after(result: RunResult, step: int, achieved: str = "throughput", ideal: str = "ideal_throughput") -> float:
    """The median of the intervals' ``achieved / ideal`` after ``step`` (samples, or ``work_throughput``: tokens);
    NaN where no interval measured it."""
    ratios = [i[achieved] / i[ideal] for i in result.intervals if i["step"] > step and i.get(ideal, math.nan) > 0]
    return statistics.median(ratios) if ratios else math.nan
