"""``dynamix bench balance`` and ``dynamix bench tta``: what rebalancing buys on a heterogeneous cluster.

The cluster is emulated (sleeps) or made of real contention on this machine
(:mod:`lightning_dynamix.bench.contention`); with ``--oracle`` every controller is judged against
the best fixed split of the same global batch, searched for and re-measured in the same invocation.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_dynamix.bench import contention
from lightning_dynamix.bench.experiments import RunConfig, RunResult, floats, is_launcher_rank_zero, run
from lightning_dynamix.bench.hosts import HostsUnavailable, check_hosts, describe_links, parse_links
from lightning_dynamix.bench.load import LoadChange, check_changes, parse_change
from lightning_dynamix.bench.plots import plot_runs
from lightning_dynamix.bench.records import machine_description
from lightning_dynamix.control.allocation import split_in_proportion
from lightning_dynamix.control.lr_scaling import lr_scale, validate_lr_scaling
from lightning_dynamix.data.workloads import ARCHITECTURES


def _schedule(text: str) -> tuple[tuple[int, int, float] | LoadChange, ...]:
    """``STEP:RANK:CHANGE[,...]``: a factor (the emulator's), or a change of the rank's machine
    (:mod:`lightning_dynamix.bench.load`: ``busy+N``, ``busy-N``, ``quota=F``, ``link=R``)."""
    entries: list[tuple[int, int, float] | LoadChange] = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            raise argparse.ArgumentTypeError(f"an entry must be STEP:RANK:CHANGE (whole STEP and RANK), got {item!r}")
        step, rank, change = int(parts[0]), int(parts[1]), parts[2]
        try:
            entries.append((step, rank, float(change)))
        except ValueError:
            try:
                entries.append(parse_change(step, rank, change))
            except ValueError as error:
                raise argparse.ArgumentTypeError(str(error)) from None
    return tuple(entries)


def _common(parser: argparse.ArgumentParser, batch_size: int) -> None:
    parser.add_argument("--speeds", type=floats, default=(1.0, 3.0), help="slowdown per rank (default 1,3)")
    parser.add_argument(
        "--contention",
        default="emulate",
        help="how ranks are made slow: emulate (sleeps, default), busy (a core per rank, speeds[r] - 1 busy"
        " processes beside rank r), quota (a cgroup CPU quota of 1/speeds[r] cores), threads (max(speeds)/speeds[r]"
        " threads on cores of their own)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=batch_size,
        help=f"initial batch size of every rank (default {batch_size})",
    )
    parser.add_argument("--interval", type=int, default=5, help="optimizer steps per decision (default 5)")
    parser.add_argument(
        "--schedule",
        type=_schedule,
        default=(),
        help="speed changes STEP:RANK:FACTOR,... (e.g. 50:1:3 makes rank 1 3x slower from step 50)",
    )
    parser.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="width of the classifier's layers (default 768); the resnet's first stage (default 16)",
    )
    parser.add_argument(
        "--architecture",
        choices=ARCHITECTURES,
        default="mlp",
        help="the classifier: mlp (default), a small transformer encoder (another model family), or resnet (a"
        " ResNet-style network with BatchNorm on synthetic images)",
    )
    parser.add_argument(
        "--sync-batchnorm",
        action="store_true",
        help="BatchNorm over the global batch (Trainer(sync_batchnorm=True), GlobalBatchNorm); default: per rank",
    )
    parser.add_argument(
        "--links",
        default=None,
        help="each rank on a host of its own (a network namespace, needs root) with this link rate in Mbit/s, one"
        " a rank (0 or -: no limit), e.g. 1000,1000,50; combines with every --contention (default: loopback)",
    )
    parser.add_argument("--num-samples", type=int, default=16384, help="training samples per epoch (default 16384)")
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--plot", type=Path, default=None, help="also write a PNG of sizes and times here")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument(
        "--oracle",
        action="store_true",
        help="first search the best fixed split of the initial global batch (measured runs, from the even split"
        " moving samples between two ranks while faster, in ever finer moves) and judge every controller against it",
    )
    parser.add_argument(
        "--oracle-finest",
        type=int,
        default=None,
        help="the oracle's finest move between two ranks, in samples (default: the global batch / 64, at least 1)",
    )
    parser.add_argument(
        "--oracle-confirm",
        type=int,
        default=3,
        help="after the search, measure the splits that measured best once more, this many of them, and choose"
        " the best mean of two (default 3; 0: the search's best single measurement)",
    )


def _hidden(args: argparse.Namespace) -> int:
    """``--hidden``, or the architecture's default width."""
    if args.hidden is not None:
        return args.hidden
    return 16 if args.architecture == "resnet" else 768


def _finest(args: argparse.Namespace, world: int) -> int:
    if args.oracle_finest is not None and args.oracle_finest < 1:
        raise SystemExit(f"--oracle-finest must be >= 1, got {args.oracle_finest}")
    return args.oracle_finest or max(1, args.batch_size * world // 64)


def add_balance_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser, batch_size=256)
    parser.add_argument(
        "--controller",
        default="pid",
        help="static, pid, goodput or ppo, or several comma-separated, run in turn (default pid)",
    )
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
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
        type=_splits,
        default=(),
        help="fixed splits of the global batch to run like the controllers, e.g. '128,128;171,85' (rows 'fixed"
        " A,B'); with a --schedule each phase between its changes is then judged against the best of them in that"
        " phase",
    )


def _splits(text: str) -> tuple[tuple[int, ...], ...]:
    """``"128,128;171,85"``: fixed splits, each of whole samples >= 1 per rank."""
    splits = []
    for part in text.split(";"):
        try:
            split = tuple(int(v) for v in part.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"each split must be whole samples per rank, got {part!r} in {text!r}"
            ) from None
        if any(v < 1 for v in split):
            raise argparse.ArgumentTypeError(f"each rank needs >= 1 sample, got {part!r} in {text!r}")
        splits.append(split)
    return tuple(splits)


def phase_bounds(changes: list[int], steps: int) -> list[tuple[int, int]]:
    """The run's phases between the steps its load changes at: ``[(0, c1), (c1, c2), ..., (ck, steps)]``."""
    edges = [0, *sorted({c for c in changes if 0 < c < steps}), steps]
    return list(itertools.pairwise(edges))


def phase_samples_per_second(result: RunResult, start: int, end: int, interval: int) -> float:
    """Median samples/s over the run's intervals wholly inside the phase ``(start, end]`` (steps)."""
    values = [i["throughput"] for i in result.intervals if i["step"] - interval >= start and i["step"] <= end]
    return statistics.median(values) if values else float("nan")


def samples_per_second(result: RunResult, after_step: int) -> float:
    """The run's achieved samples/s: the median over its measured intervals after ``after_step``."""
    values = [i["throughput"] for i in result.intervals if i["step"] > after_step]
    return statistics.median(values) if values else float("nan")


def neighbour_splits(split: tuple[int, ...], delta: int, low: int = 1) -> list[tuple[int, ...]]:
    """``split`` with ``delta`` samples moved from one rank to another, every way; a rank with fewer than
    ``delta`` above ``low`` gives what it has above ``low`` (so a search can reach the bound itself)."""
    found = []
    for give in range(len(split)):
        moved_samples = min(delta, split[give] - low)
        for take in range(len(split)):
            if give != take and moved_samples > 0:
                moved = list(split)
                moved[give] -= moved_samples
                moved[take] += moved_samples
                found.append(tuple(moved))
    return found


def find_best_fixed_split(
    measure: Any, global_batch: int, world: int, finest: int = 1, low: int = 1, confirm: int = 3
) -> tuple[tuple[int, ...], float, dict[tuple[int, ...], float]]:
    """Pattern search over fixed splits of ``global_batch``: from the even split, move ``delta`` samples
    between two ranks while that is faster (down to ``low`` samples on a rank), then halve ``delta``
    (a quarter of a rank's share first), down to ``finest``. ``measure(split)`` returns samples/s; each
    split is measured once in the search.

    The best of many noisy measurements is biased upwards: the search ends on whichever split read
    luckiest. So the ``confirm`` splits that measured best are measured once more each, and the one
    whose two measurements have the highest mean is chosen (``confirm=0``: the search's best as is).

    Returns the chosen split, the mean of its measurements and every split's first measurement.
    """
    base, extra = divmod(global_batch, world)
    best = tuple(base + (1 if r < extra else 0) for r in range(world))
    measured: dict[tuple[int, ...], float] = {best: measure(best)}
    delta = max(finest, global_batch // (4 * world))
    while True:
        improved = True
        while improved:
            improved = False
            for split in neighbour_splits(best, delta, low):
                if split not in measured:
                    measured[split] = measure(split)
                if measured[split] > measured[best]:
                    best, improved = split, True
        if delta <= finest:
            break
        delta = max(finest, delta // 2)
    if confirm < 1:
        return best, measured[best], measured
    top = sorted(measured, key=lambda split: measured[split], reverse=True)[:confirm]
    means = {split: (measured[split] + measure(split)) / 2 for split in top}
    best = max(top, key=lambda split: means[split])
    return best, means[best], measured


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


def _ratio_after(result: RunResult, step: int) -> float:
    ratios = [i["throughput"] / i["ideal_throughput"] for i in result.intervals if i["step"] > step]
    return statistics.median(ratios) if ratios else float("nan")


def _change_steps(args: argparse.Namespace) -> list[int]:
    """The steps of the schedule's changes, the emulator's and the machine's."""
    return [entry[0] for entry in args.schedule] + [change.step for change in args.load_changes]


def _first_change(args: argparse.Namespace) -> int | None:
    """The step of the schedule's first change, ``None`` without one."""
    return min(_change_steps(args), default=None)


def _links(args: argparse.Namespace) -> str:
    """`` hosts on links of R,R Mbit/s,`` for a header, where ``--links`` put the ranks on hosts."""
    return "" if args.links is None else f" {describe_links(args.links)},"


def _machine(args: argparse.Namespace) -> None:
    """``--links`` as rates and the schedule split into the emulator's factors (``args.schedule``) and the machine's
    changes (``args.load_changes``), each checked against the run and this machine: a ``SystemExit`` saying what
    is wrong."""
    try:
        if args.links is not None:
            args.links = tuple(parse_links(args.links, len(args.speeds)))
            check_hosts()
        args.load_changes = tuple(c for c in args.schedule if isinstance(c, LoadChange))
        args.schedule = tuple(c for c in args.schedule if not isinstance(c, LoadChange))
        check_changes(args.load_changes, args.contention, len(args.speeds), args.links is not None)
    except (ValueError, HostsUnavailable) as error:
        raise SystemExit(str(error)) from None


def _contention(args: argparse.Namespace) -> contention.Contention:
    """The contention ``args`` ask for, checked against this machine: a ``SystemExit`` saying what it cannot do."""
    try:
        places = contention.plan(args.contention, args.speeds)
        if places is not None and args.schedule:
            raise ValueError(
                f"--schedule changes the emulator's speeds: it needs --contention emulate, not {args.contention}"
            )
        # only the launching process starts busy processes and cgroups; its ranks take their places
        return contention.Contention(places if is_launcher_rank_zero() else None)
    except ValueError as error:
        raise SystemExit(str(error)) from None


def _fixed_split_measure(config: RunConfig, after_step: int) -> Callable[[tuple[int, ...]], float]:
    """Samples/s of ``config`` run with a fixed split, after ``after_step``; every rank gets the figure."""

    def measure(split: tuple[int, ...]) -> float:
        result = run(dataclasses.replace(config, controller="static", batch_sizes=split), on_every_rank=True)
        assert result is not None  # every rank takes the search's next step
        value = samples_per_second(result, after_step)
        if is_launcher_rank_zero():
            print(f"fixed split {','.join(map(str, split))}: {value:.1f} samples/s", flush=True)
        return value

    return measure


def _oracle(args: argparse.Namespace, measure: Callable[[tuple[int, ...]], float], low: int) -> dict[str, Any]:
    """The oracle's search for the best fixed split of the initial global batch (see :func:`find_best_fixed_split`)."""
    world = len(args.speeds)
    if args.oracle_confirm < 0:
        raise SystemExit(f"--oracle-confirm must be >= 0 (0: no second measurements), got {args.oracle_confirm}")
    calls: list[tuple[tuple[int, ...], float]] = []

    def recorded(split: tuple[int, ...]) -> float:
        value = measure(split)
        calls.append((split, value))
        return value

    best, rate, measured = find_best_fixed_split(
        recorded, args.batch_size * world, world, _finest(args, world), low, confirm=args.oracle_confirm
    )
    again = calls[len(measured) :]
    return {
        "best_split": list(best),
        "best_samples_per_second_in_search": rate,
        "measured": [{"split": list(k), "samples_per_second": v} for k, v in measured.items()],
        # the best splits of the search measured once more: their first and second samples/s
        "confirmed": [{"split": list(k), "samples_per_second": [measured[k], v]} for k, v in again],
    }


def run_balance(args: argparse.Namespace) -> None:
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
    _machine(args)
    with _contention(args):
        summary = _balance_runs(args)
    if summary is not None:
        _report_balance(args, summary)


def _balance_runs(args: argparse.Namespace) -> dict[str, Any] | None:
    controllers = args.controller.split(",")
    half = args.steps // 2
    config = RunConfig(
        controller=controllers[0],
        speeds=args.speeds,
        contention=args.contention,
        batch_size=args.batch_size,
        epochs=1000,
        max_steps=args.steps,
        interval=args.interval,
        hidden=_hidden(args),
        num_samples=args.num_samples,
        architecture=args.architecture,
        sync_batchnorm=args.sync_batchnorm,
        schedule=args.schedule,
        links=args.links,
        load_changes=args.load_changes,
        val_checks_per_epoch=1,
        min_batch_size=args.min_batch_size,
        keep_global_batch=args.keep_global_batch,
    )
    measure = _fixed_split_measure(config, half)
    # the same run with fixed splits, measured before the controllers'
    low = args.min_batch_size if args.min_batch_size is not None else (2 if args.architecture == "resnet" else 1)
    oracle = _oracle(args, measure, low) if args.oracle else None
    fixed_rates: list[float] = []
    runs: dict[str, list[RunResult]] = {c: [] for c in controllers}
    # the best of many noisy measurements is biased upwards: the controllers are judged against fresh
    # runs of that split, in turn with theirs, so drift on the machine hits both alike; each round starts
    # one further along the list, so that none always runs first or last
    best = tuple(oracle["best_split"]) if oracle is not None else None
    fixed = {f"fixed {','.join(map(str, split))}": split for split in args.fixed_splits}
    runs.update({name: [] for name in fixed})
    turns: list[str | None] = [*([None] if best is not None else []), *fixed, *controllers]
    for k in range(args.rounds):
        for controller in turns[k % len(turns) :] + turns[: k % len(turns)]:
            if controller is None:
                assert best is not None
                fixed_rates.append(measure(best))
                continue
            if controller in fixed:
                result = run(dataclasses.replace(config, controller="static", batch_sizes=fixed[controller]))
            else:
                result = run(dataclasses.replace(config, controller=controller))
            if result is not None:
                runs[controller].append(result)
    if not is_launcher_rank_zero():
        return None
    if oracle is not None:
        oracle["best_samples_per_second_rounds"] = fixed_rates
        oracle["best_samples_per_second"] = statistics.median(fixed_rates)
    change = _first_change(args)
    table: dict[str, Any] = {}
    for controller, results in runs.items():
        rates = [samples_per_second(r, half) for r in results]
        settling = None if change is None else settling_intervals(results[0], change)
        table[controller] = {
            "samples_per_second_rounds": rates,
            "samples_per_second_second_half": statistics.median(rates),
            "fraction_of_best_fixed_split": None
            if oracle is None
            else statistics.median(rates) / oracle["best_samples_per_second"],
            "throughput_to_ideal_second_half": statistics.median(_ratio_after(r, half) for r in results),
            "final_batch_sizes": [r.intervals[-1]["next_batch_sizes"] if r.intervals else None for r in results],
            # each rank's sizes over the second half, per round: how far the controller kept moving them
            "size_spread_second_half": [size_spread(r, half) for r in results],
            # a speed change: decisions until the first round's sizes settled, and throughput / ideal after
            "settling_intervals": settling,
            "throughput_to_ideal_after_settling": _after_settling(results[0], change, args.interval, settling),
        }
    changes = _change_steps(args)
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


def _report_balance(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    if args.output is not None:
        args.output.write_text(json.dumps(summary, indent=2))
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
        return
    for controller, rounds in summary["runs"].items():
        print(
            f"\ndynamix bench balance: {len(args.speeds)} processes, speeds {list(args.speeds)} ({args.contention}),"
            f"{_links(args)}"
            f" controller {controller}, {args.steps} steps, decisions every {args.interval}, first round"
        )
        print(f"{'step':>5}  {'batch sizes':>16}  {'compute per rank (ms)':>24}  {'throughput / ideal':>18}")
        for i in rounds[0]:
            compute = ", ".join(f"{1e3 * c:.1f}" for c in i["compute_time"])
            sizes = ",".join(map(str, i["batch_sizes"]))
            print(f"{i['step']:>5}  {sizes:>16}  {compute:>24}  {i['throughput'] / i['ideal_throughput']:>18.3f}")
    oracle = summary["oracle"]
    if oracle is not None:
        rounds = ", ".join(f"{v:.1f}" for v in oracle["best_samples_per_second_rounds"])
        print(
            f"\nbest fixed split {','.join(map(str, oracle['best_split']))} of {len(oracle['measured'])} measured"
            f" ({oracle['best_samples_per_second_in_search']:.1f} samples/s in the search, the mean of its two"
            f" measurements); run again in each round:"
            f" {rounds} samples/s"
        )
    print(f"{'controller':>10}  {'samples/s, second half (rounds)':>40}  {'of best fixed split':>19}  {'/ ideal':>7}")
    for controller, row in summary["controllers"].items():
        rates = ", ".join(f"{v:.0f}" for v in row["samples_per_second_rounds"])
        fraction = row["fraction_of_best_fixed_split"]
        print(
            f"{controller:>10}  {rates:>40}  {'-' if fraction is None else f'{fraction:.3f}':>19}"
            f"  {row['throughput_to_ideal_second_half']:>7.3f}"
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
                f"{'':>10}  after the change at step {_first_change(args)}: settled in"
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


def add_tta_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser, batch_size=128)
    parser.add_argument(
        "--controllers", default="static,pid,goodput,ppo", help="comma-separated (default static,pid,goodput,ppo)"
    )
    parser.add_argument("--seeds", type=int, default=3, help="runs per controller, seeds 0..N-1 (default 3)")
    parser.add_argument("--epochs", type=int, default=10, help="training epochs per run (default 10)")
    parser.add_argument("--target-accuracy", type=float, default=0.85, help="accuracy to time (default 0.85)")
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
        type=_global_batches,
        default=(),
        help="comma-separated global batches (samples), each trained fixed like the controllers (rows fixed@B: the"
        " oracle's best split, or the even one without --oracle, scaled to B; the learning rate scaled by"
        " --lr-scaling, adascale taken as sqrt); 'best-fixed' is then the one that reached the target first",
    )


def _global_batches(text: str) -> tuple[int, ...]:
    """``"256,512,1024"``: global batches of the oracle's fixed runs, whole samples >= 1, no repeats."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated whole numbers of samples, got {text!r}") from None
    if any(v < 1 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"must be distinct global batches >= 1 sample, got {text!r}")
    return values


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


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run_tta(args: argparse.Namespace) -> None:
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
    _machine(args)
    with _contention(args):
        output = _tta_runs(args)
    if output is not None:
        _report_tta(args, output)


def _tta_runs(args: argparse.Namespace) -> dict[str, Any] | None:
    controllers = args.controllers.split(",")
    base = RunConfig(
        speeds=args.speeds,
        contention=args.contention,
        batch_size=args.batch_size,
        epochs=args.epochs,
        interval=args.interval,
        hidden=_hidden(args),
        num_samples=args.num_samples,
        architecture=args.architecture,
        sync_batchnorm=args.sync_batchnorm,
        lr=args.lr,
        lr_scaling=args.lr_scaling,
        depth=args.depth,
        optimizer=args.optimizer,
        target_accuracy=args.target_accuracy,
        schedule=args.schedule,
        links=args.links,
        load_changes=args.load_changes,
        pid_max_global_batch=args.pid_max_global_batch,
    )
    best: tuple[int, ...] | None = None
    oracle = None
    if args.oracle:  # short runs of fixed splits, then the best one trained like the controllers
        search = dataclasses.replace(base, epochs=1000, max_steps=args.oracle_steps, val_checks_per_epoch=1)
        oracle = _oracle(args, _fixed_split_measure(search, args.oracle_steps // 2), low=1)
        best = tuple(oracle["best_split"])
    # fixed runs: row name -> (split, learning rate)
    fixed: dict[str, tuple[tuple[int, ...], float]] = {}
    if best is not None and not args.oracle_global_batches:
        fixed["best-fixed"] = (best, args.lr)
    split = best or (args.batch_size,) * len(args.speeds)
    for total in args.oracle_global_batches:
        fixed[f"fixed@{total}"] = fixed_global_batch(split, total, args.lr, args.lr_scaling)
    controllers = [*fixed, *controllers]
    results: dict[str, list[RunResult]] = {c: [] for c in controllers}
    for seed in range(args.seeds):
        for controller in controllers:  # interleaved: drift on the machine hits all alike
            if controller in fixed:
                sizes, lr = fixed[controller]
                config = dataclasses.replace(
                    base,
                    controller="static",
                    batch_sizes=sizes,
                    lr=lr,
                    max_batch_size=max(base.max_batch_size, *sizes),
                    seed=seed,
                )
            else:
                config = dataclasses.replace(base, controller=controller, seed=seed)
            if args.log_dir is not None:
                config = dataclasses.replace(config, log_dir=str(args.log_dir / f"{controller}-seed{seed}"))
            result = run(config)
            if result is not None:
                results[controller].append(result)
    if not is_launcher_rank_zero():
        return None
    table = {}
    for controller, runs in results.items():
        reached = [r.time_to_target for r in runs if r.time_to_target is not None]
        table[controller] = {
            "median_samples_per_second": _median([r.samples / r.train_seconds for r in runs if r.train_seconds > 0]),
            "runs": len(runs),
            "reached_target": len(reached),
            "median_time_to_target": _median(reached) if len(reached) == len(runs) else None,
            "times_to_target": [r.time_to_target for r in runs],
            "median_final_accuracy": _median([r.final_accuracy for r in runs]),
            "median_train_seconds": _median([r.train_seconds for r in runs]),
            "median_throughput_to_ideal": _median([r.throughput_to_ideal for r in runs]),
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
        "controllers": table,
        "runs": {c: [r.as_dict() for r in rs] for c, rs in results.items()},
        "machine": machine_description(),
    }
    if args.plot is not None:
        plot_runs({c: rs[0] for c, rs in results.items() if rs}, args.plot, title="seed 0")
    return output


def _report_tta(args: argparse.Namespace, output: dict[str, Any]) -> None:
    if args.output is not None:
        args.output.write_text(json.dumps(output, indent=2))
    if args.json:
        print(json.dumps({k: v for k, v in output.items() if k != "runs"}, indent=2))
        return
    changes = "".join(f", rank {r} x{f:g} from step {s}" for s, r, f in args.schedule)
    norm = ", global BatchNorm" if args.sync_batchnorm else ""
    model = f"{args.architecture} (hidden {_hidden(args)}, depth {args.depth}, {args.optimizer} lr {args.lr:g}{norm})"
    print(
        f"\ndynamix bench tta: {model}, speeds {list(args.speeds)} ({args.contention}){changes},{_links(args)}"
        f" {args.epochs} epochs,"
        f" target accuracy {args.target_accuracy}, {args.seeds} seeds (medians)"
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
    )
    for controller, row in output["controllers"].items():
        tta = row["median_time_to_target"]
        tta_text = f"{tta:.1f}" if tta is not None else "-"
        fraction = row.get("fraction_of_best_fixed_split")
        of_time = row.get("time_to_target_of_best_fixed")
        print(
            f"{controller:>12}  {tta_text:>18}  {row['reached_target']:>3}/{row['runs']:<3}"
            f"  {row['median_final_accuracy']:>14.3f}  {row['median_train_seconds']:>17.1f}"
            f"  {row['median_samples_per_second'] or 0:>9.0f}  {'-' if fraction is None else f'{fraction:.3f}':>13}"
            + (f"  {'-' if of_time is None else f'{of_time:.3f}':>17}" if timed else "")
            + f"  {row['median_throughput_to_ideal']:>18.3f}"
        )
