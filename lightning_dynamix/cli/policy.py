"""``dynamix train-policy``, ``dynamix simulate`` and ``dynamix calibrate``: the learned controller's commands
(its benchmark, ``dynamix bench policy``, is :mod:`lightning_dynamix.bench.policy`)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from lightning_dynamix.bench.arguments import positive_ints
from lightning_dynamix.rl.train import EVALUATION_SEED, PRESETS, preset

DEFAULT_CONTROLLERS = "static,pid,goodput,ppo"


def _names(text: str) -> list[str]:
    from lightning_dynamix.control import CONTROLLERS

    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in names if n not in CONTROLLERS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"controllers must be among {sorted(CONTROLLERS)}, got {text!r}")
    return names


# ---------------------------------------------------------------------------------------------- train-policy
def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="default", help="training configuration (default: default)"
    )
    parser.add_argument("--timesteps", type=int, default=None, help="decision intervals to train on (preset's)")
    parser.add_argument("--seed", type=int, default=None, help="seed of PPO, the scenarios and the evaluation")
    parser.add_argument("--max-world-size", type=int, default=None, help="the most ranks the policy serves (64)")
    parser.add_argument("--n-envs", type=int, default=None, help="simulated jobs stepped together (preset's: 8)")
    parser.add_argument("--batch-size", type=int, default=None, help="PPO minibatch size (preset's: 512)")
    parser.add_argument(
        "--learning-rate", type=float, default=None, help="Adam's learning rate (preset's: 3e-4; lower to fine-tune)"
    )
    parser.add_argument("--clip-range", type=float, default=None, help="PPO's clip range (preset's: 0.2)")
    parser.add_argument(
        "--subprocesses", action="store_true", help="step the simulated jobs in their own processes (many cores)"
    )
    parser.add_argument("--device", default=None, help="where PPO's network trains: cpu (default) or cuda")
    parser.add_argument("--init", default=None, help="continue training this policy file ('default': the shipped one)")
    parser.add_argument("--output", type=Path, default=Path("dynamix_runs/policy/policy.safetensors"))
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="CSV and TensorBoard logs (default: beside --output)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-evaluate", action="store_true", help="skip the held-out comparison")


def run_train(args: argparse.Namespace) -> None:
    from lightning_dynamix.rl.train import train_policy

    overrides: dict[str, Any] = {
        "timesteps": args.timesteps,
        "seed": args.seed,
        "n_envs": args.n_envs,
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "clip_range": args.clip_range,
        "device": args.device,
        "subprocesses": True if args.subprocesses else None,
    }
    if args.max_world_size is not None:
        if args.max_world_size < 1:
            raise SystemExit(f"dynamix train-policy: --max-world-size must be >= 1, got {args.max_world_size}")
        largest = args.max_world_size
        base = PRESETS[args.preset]
        sizes = sorted({n for n in base.scenario_space.world_sizes if n <= largest} | {largest})
        evaluated = sorted({n for n in base.evaluation_world_sizes if n <= largest} | {largest})
        overrides["max_world_size"] = largest
        overrides["scenario_space"] = replace(base.scenario_space, world_sizes=tuple(sizes))
        overrides["evaluation_world_sizes"] = tuple(evaluated)
    try:
        config = preset(args.preset, **overrides)
    except ValueError as error:
        raise SystemExit(f"dynamix train-policy: {error}") from None
    log_dir = args.log_dir or args.output.parent / "logs"
    print(f"training a policy ({args.preset}: {config.timesteps} intervals, up to {config.max_world_size} ranks)")
    start = None
    if args.init is not None:
        from lightning_dynamix.control.ppo.files import PolicyFileError
        from lightning_dynamix.rl.train import initial_policy

        try:
            start = initial_policy(args.init, config)
        except (ValueError, FileNotFoundError, PolicyFileError) as error:
            raise SystemExit(f"dynamix train-policy: --init: {error}") from None
    path, record = train_policy(
        config,
        args.output,
        log_dir=log_dir,
        progress_bar=not args.no_progress,
        evaluate=not args.no_evaluate,
        preset_name=args.preset,
        init=start,
    )
    print(f"trained in {record['training_seconds']:.0f} s; mean episode reward {record['mean_episode_reward']}")
    if "evaluation" in record:
        print(evaluation_table(record["evaluation"]))
    print(f"policy written to {path}; logs in {log_dir}")
    print(f"use it with DynamixCallback(controller=PPOController({str(path)!r})) or dynamix simulate --policy {path}")


def evaluation_table(evaluation: dict[str, Any]) -> str:
    """Median time to target relative to static, share reaching it and median final accuracy, per world size."""
    lines = [
        f"held-out scenarios: {evaluation['scenarios']}",
        f"{'ranks':>6} {'controller':>10} {'time to target':>15} {'reached':>8} {'final acc':>9}",
    ]
    for size, per_controller in [*evaluation["by_world_size"].items(), ("all", evaluation["all"])]:
        for name, values in per_controller.items():
            ratio = values["median_time_to_target_vs_static"]
            lines.append(
                f"{size:>6} {name:>10} {'never' if ratio is None else f'{ratio:.2f} x static':>15}"
                f" {values['reached_target']:>8.0%} {values['median_final_accuracy']:>9.3f}"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- simulate
def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=positive_ints, default=[32], help="world sizes, comma-separated (default 32)")
    parser.add_argument(
        "--controllers", type=_names, default=_names(DEFAULT_CONTROLLERS), help=f"default {DEFAULT_CONTROLLERS}"
    )
    parser.add_argument("--scenarios", type=int, default=8, help="held-out scenarios per world size (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="which held-out scenarios (default 0)")
    parser.add_argument("--policy", default="default", help="policy file for ppo (default: the shipped one)")
    parser.add_argument(
        "--scenario", type=Path, default=None, help="a scenario JSON (from dynamix calibrate) instead of held-out ones"
    )
    parser.add_argument(
        "--oracle",
        action="store_true",
        help="also run the oracle: the simulator's true speeds and noise scale, the bound on what a controller can win",
    )
    parser.add_argument("--output-dir", type=Path, default=Path("dynamix_runs/simulate"))


def run_simulate(args: argparse.Namespace) -> None:
    from lightning_dynamix.rl.evaluate import compare, controller_factory, paired, summarize
    from lightning_dynamix.rl.simulator import ScenarioSpace

    if args.scenarios < 1:
        raise SystemExit(f"dynamix simulate: --scenarios must be >= 1, got {args.scenarios}")
    factories = {name: controller_factory(name, args.policy if name == "ppo" else None) for name in args.controllers}
    if "static" not in factories:
        factories = {"static": controller_factory("static"), **factories}
    if args.oracle:
        from lightning_dynamix.rl.evaluate import OracleController

        factories["oracle"] = lambda scenario: OracleController()
    space = ScenarioSpace()
    calibrated = None
    if args.scenario is not None:
        from lightning_dynamix.rl.simulator import Scenario

        try:
            calibrated = Scenario.from_dict(json.loads(args.scenario.read_text()))
        except (OSError, ValueError, TypeError) as error:
            raise SystemExit(f"dynamix simulate: cannot read the scenario {args.scenario}: {error}") from None
        args.nodes = [calibrated.world_size]
    args.output_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "scenarios_per_size": args.scenarios,
        "seed": args.seed,
        "policy": args.policy,
        "by_nodes": {},
    }
    all_results: dict[int, list[dict[str, Any]]] = {}
    for nodes in args.nodes:
        rng = np.random.default_rng([EVALUATION_SEED + args.seed, nodes])
        if calibrated is not None:
            scenarios = [calibrated] * args.scenarios  # one scenario, seeds i: different jitter and drift
        else:
            scenarios = [space.sample(rng, world_size=nodes) for _ in range(args.scenarios)]
        started = time.perf_counter()
        results = compare(scenarios, factories, seed=EVALUATION_SEED + args.seed)
        summary = summarize(results)
        all_results[nodes] = results
        report["by_nodes"][str(nodes)] = {
            "summary": {k: {m: (v if math.isfinite(v) else None) for m, v in d.items()} for k, d in summary.items()},
            "runs": [{name: r.to_dict() for name, r in per.items()} for per in results],
        }
        what = f"{args.scenario} x {args.scenarios} seeds" if calibrated else f"{args.scenarios} held-out scenarios"
        print(f"{nodes} nodes, {what} ({time.perf_counter() - started:.0f} s):")
        print(f"  {'controller':>10} {'time to target':>16} {'reached':>8} {'final accuracy':>15} {'throughput':>12}")
        for name, values in summary.items():
            ratio = values["median_time_to_target_vs_static"]
            print(
                f"  {name:>10} {('never' if not math.isfinite(ratio) else f'{ratio:.2f} x static'):>16}"
                f" {values['reached_target']:>8.0%} {values['median_final_accuracy']:>15.3f}"
                f" {values['median_throughput_vs_static']:>9.2f} x"
            )
        if "ppo" in summary:  # the same scenarios run by both: steadier than the medians' difference
            for other in (name for name in ("pid", "goodput") if name in summary):
                pair = paired(results, "ppo", other)
                report["by_nodes"][str(nodes)].setdefault("paired", {})[f"ppo/{other}"] = pair
                print(
                    f"  ppo / {other} per scenario: median {pair['median_ratio']:.3f}, faster on {pair['faster']},"
                    f" slower on {pair['slower']} (sign test p = {pair['sign_test_p']:.2g})"
                )
    (args.output_dir / "simulate.json").write_text(json.dumps(report, indent=1, default=_json_default))
    plot = _plot(all_results, args.output_dir / "simulate.png")
    print(f"results in {args.output_dir / 'simulate.json'}; plot {plot}")


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(type(value).__name__)


def _plot(all_results: dict[int, list[dict[str, Any]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(next(iter(all_results.values()))[0])
    sizes = sorted(all_results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        medians, accuracies = [], []
        for n in sizes:
            ratios = []
            for per in all_results[n]:
                base, mine = per["static"].time_to_target, per[name].time_to_target
                ratios.append(mine / base if math.isfinite(base) and math.isfinite(mine) else np.nan)
            medians.append(np.nanmedian(ratios) if np.isfinite(ratios).any() else np.nan)
            accuracies.append(
                100
                * statistics.median(per[name].final_accuracy - per["static"].final_accuracy for per in all_results[n])
            )
            xs = np.full(len(ratios), sizes.index(n) + (i - (len(names) - 1) / 2) * width)
            left.scatter(xs, ratios, s=8, alpha=0.4, color=f"C{i}")
        positions = np.arange(len(sizes)) + (i - (len(names) - 1) / 2) * width
        left.bar(positions, medians, width=width, color=f"C{i}", alpha=0.6, label=name)
        right.plot(sizes, accuracies, marker="o", color=f"C{i}", label=name)
    left.axhline(1.0, color="grey", lw=0.8)
    left.set_xticks(range(len(sizes)), [str(n) for n in sizes])
    left.set_xlabel("nodes")
    left.set_ylabel("time to target / static's (median bar, dots: scenarios)")
    left.set_title("time to target accuracy (lower is better)")
    left.legend()
    right.set_xscale("log", base=2)
    right.set_xticks(sizes, [str(n) for n in sizes])
    right.set_xlabel("nodes")
    right.axhline(0.0, color="grey", lw=0.8)
    right.set_ylabel("final accuracy - static's, points (median)")
    right.set_title("final accuracy after the same number of samples")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- calibrate
def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log_dir", type=Path, help="a run's logs (metrics.csv or TensorBoard event files)")
    parser.add_argument(
        "--output", type=Path, default=None, help="scenario JSON (default: scenario.json beside the logs)"
    )
    parser.add_argument("--dataset-size", type=int, default=100_000, help="samples per epoch (default 100000)")
    parser.add_argument(
        "--memory-limit", type=int, default=None, help="largest batch a rank holds (default: 16x the largest logged)"
    )
    parser.add_argument("--best-accuracy", type=float, default=0.9, help="accuracy at convergence (default 0.9)")


def run_calibrate(args: argparse.Namespace) -> None:
    from lightning_dynamix.cli.report import find_logs, merge_by_directory, read_log
    from lightning_dynamix.rl.calibrate import calibrate, replay

    if not args.log_dir.exists():
        raise SystemExit(f"dynamix calibrate: {args.log_dir} does not exist")
    logs = [g for g in merge_by_directory([read_log(p) for p in find_logs(args.log_dir)]) if g.ranks]
    if len(logs) != 1:
        found = ", ".join(str(g.source.parent) for g in logs) or "none"
        raise SystemExit(f"dynamix calibrate: needs the logs of exactly one run with per-rank metrics, found: {found}")
    log = logs[0]
    try:
        scenario, report = calibrate(
            log.series,
            log.ranks,
            dataset_size=args.dataset_size,
            memory_limit=args.memory_limit,
            best_accuracy=args.best_accuracy,
        )
    except ValueError as error:
        raise SystemExit(f"dynamix calibrate: {error}") from None
    rows = replay(scenario, log.ranks, report)
    output = args.output or log.source.parent / "scenario.json"
    output.write_text(json.dumps(scenario.to_dict(), indent=1))
    print(
        f"calibrated on {report.intervals} intervals of {report.interval_steps} steps,"
        f" {scenario.world_size} ranks ({log.source})"
    )
    for rank, (alpha, beta) in enumerate(report.compute_fit):
        print(
            f"  rank {rank}: compute {alpha * 1e3:.2f} ms + {beta * 1e3:.3f} ms/sample,"
            f" data {scenario.data_per_sample[rank] * 1e3:.3f} ms/sample"
        )
    print(
        f"  all-reduce {scenario.allreduce_time * 1e3:.2f} ms ({scenario.gradient_bytes / 1e6:.1f} MB at"
        f" {scenario.bandwidth * 8 / 1e6:.0f} Mbit/s, {scenario.overlap:.0%} hidden); noise scale"
        f" {scenario.noise_scale_start:.0f} -> {scenario.noise_scale_end:.0f};"
        f" loss {scenario.loss_start:.3f} -> {scenario.loss_end:.3f}"
    )
    print(f"  assumed (not in the logs): {report.assumed}")
    measured = [m for _, m, _ in rows]
    print(
        f"replay at the run's own sizes: median step time {statistics.median(measured) * 1e3:.1f} ms measured,"
        f" {statistics.median(s for _, _, s in rows) * 1e3:.1f} ms simulated;"
        f" median error {report.replay_step_time_error:.1%}"
    )
    print(f"scenario written to {output}; compare controllers on it: dynamix simulate --scenario {output}")
