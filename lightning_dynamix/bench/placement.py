"""``dynamix bench placement``: the placement solvers against the exact optimum, and the exact solver's speed.

* RL and greedy against exact: held-out random problems (seeds the scheduler never trained on),
  the cost of each solver's plan over the optimum's;
* the same on the DLRM example (35 layers profiled on this machine, the example catalogue), its
  layers alone and with the runner's terms, at 10% to 95% of the most the catalogue reaches;
* the dynamic programme's solve time on long chains (100 layers x 4 types by default).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from lightning_dynamix.bench.records import arguments_record, machine_description
from lightning_dynamix.bench.replan import CATALOGUE
from lightning_dynamix.placement import (
    CostModel,
    InfeasibleError,
    best_throughput,
    load_catalogue,
    profile_model,
    solve_dp,
    solve_greedy,
)
from lightning_dynamix.placement.random_chains import random_problem
from lightning_dynamix.placement.rl import SEARCH_ROUNDS, RLScheduler, load_rl_scheduler, solve_rl
from lightning_dynamix.strategies.layer_offload import profile_runner

HELD_OUT = 10_000_000  # training problems draw their seeds below 2**31 at random; these are fixed
DLRM_FRACTIONS = (0.1, 0.25, 0.5, 0.75, 0.95)  # of the most the catalogue reaches


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheduler", type=Path, default=None, help="RL scheduler file (default: the shipped one)")
    parser.add_argument("--problems", type=int, default=200, help="held-out problems (default 200)")
    parser.add_argument("--max-layers", type=int, default=12, help="layers per problem, 2 to this (default 12)")
    parser.add_argument("--types", type=int, default=4, help="resource types per problem (default 4)")
    parser.add_argument("--samples", type=int, default=32, help="sampled placements per RL solve (default 32)")
    parser.add_argument(
        "--search",
        type=int,
        default=SEARCH_ROUNDS,
        help=f"rounds of active search per RL solve (default {SEARCH_ROUNDS}; 0: the policy alone)",
    )
    parser.add_argument("--dp-layers", type=int, default=100, help="layers of the DP timing problems (default 100)")
    parser.add_argument("--dp-problems", type=int, default=20, help="DP timing problems (default 20)")
    parser.add_argument("--skip-dlrm", action="store_true", help="leave out the DLRM example")
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")


def _gaps(args: argparse.Namespace) -> dict[str, Any]:
    scheduler = load_rl_scheduler(args.scheduler)
    rl, greedy, skipped = [], [], 0
    rl_solve = _rl_solver(args, scheduler)
    for index in range(args.problems):
        model = random_problem(HELD_OUT + index, (2, args.max_layers), args.types)
        try:
            best = solve_dp(model).cost_per_hour
        except InfeasibleError:
            skipped += 1  # no placement at all: nothing to compare
            continue
        for gaps, solve in ((rl, rl_solve), (greedy, solve_greedy)):
            try:
                gaps.append(solve(model).cost_per_hour / best - 1)
            except InfeasibleError:
                gaps.append(math.inf)
    return {
        name: {
            "problems": len(gaps),
            "within_1_percent": sum(g <= 0.01 for g in gaps) / len(gaps),
            "within_5_percent": sum(g <= 0.05 for g in gaps) / len(gaps),
            "median_gap": statistics.median(gaps),
            "mean_gap_feasible": statistics.mean([g for g in gaps if math.isfinite(g)] or [math.nan]),
            "infeasible": sum(not math.isfinite(g) for g in gaps),
        }
        for name, gaps in (("rl", rl), ("greedy", greedy))
    } | {"skipped_infeasible_problems": skipped, "scheduler_training": scheduler.training}


def _rl_solver(args: argparse.Namespace, scheduler: RLScheduler) -> Any:
    return functools.partial(solve_rl, scheduler=scheduler, samples=args.samples, search=args.search)


def _solve_gap(solve: Any, model: CostModel, best: float) -> float:
    try:
        return solve(model).cost_per_hour / best - 1
    except InfeasibleError:
        return math.inf


def _dlrm(args: argparse.Namespace, scheduler: RLScheduler) -> list[dict[str, Any]]:
    """RL and greedy against exact on the DLRM example, profiled here, at fractions of its best reachable target."""
    from lightning_dynamix.data import CTRDataModule
    from lightning_dynamix.data.dlrm import DLRM

    data = CTRDataModule()
    data.setup("fit")
    loader = data.train_dataloader()
    model = DLRM(table_sizes=data.spec.table_sizes)
    layers = profile_model(model, next(iter(loader)))
    profiles = {"layers alone": layers, "with the runner's terms": layers.with_runner(profile_runner(model, loader))}
    resources = load_catalogue(CATALOGUE)
    rows = []
    for name, profile in profiles.items():
        reach = best_throughput(CostModel(profile, resources, 1.0))
        for fraction in DLRM_FRACTIONS:
            problem = CostModel(profile, resources, fraction * reach, training_samples=len(loader.dataset))
            best = solve_dp(problem).cost_per_hour
            rows.append(
                {
                    "profile": name,
                    "target": fraction * reach,
                    "fraction_of_reach": fraction,
                    "optimum_per_hour": best,
                    "rl_gap": _solve_gap(_rl_solver(args, scheduler), problem, best),
                    "greedy_gap": _solve_gap(solve_greedy, problem, best),
                }
            )
    return rows


def _dp_time(args: argparse.Namespace) -> dict[str, float]:
    times, index = [], 0
    while len(times) < args.dp_problems:
        model = random_problem(HELD_OUT + index, args.dp_layers, args.types)
        index += 1
        start = time.perf_counter()
        try:
            solve_dp(model)
        except InfeasibleError:
            continue  # its error searches the best reachable throughput: not a solve time
        times.append(time.perf_counter() - start)
    return {"median_ms": 1e3 * statistics.median(times), "max_ms": 1e3 * max(times), "problems_drawn": index}


def run(args: argparse.Namespace) -> None:
    if args.samples < 0 or args.search < 0 or (args.search and args.samples < 2):
        raise SystemExit(
            "dynamix bench placement: --samples must be >= 0 (>= 2 with --search, whose rounds draw that many)"
            f" and --search >= 0, got --samples {args.samples} and --search {args.search}"
        )
    result = {"benchmark": "placement", "config": arguments_record(args), "machine": machine_description()}
    result["against_exact"] = _gaps(args)
    result["dp_solve_time"] = _dp_time(args)
    if not args.skip_dlrm:
        result["dlrm"] = _dlrm(args, load_rl_scheduler(args.scheduler))
    print(f"dynamix bench placement: {args.problems} held-out problems, 2-{args.max_layers} layers, {args.types} types")
    print(f"{'solver':>7}  {'within 1%':>9}  {'within 5%':>9}  {'median gap':>10}  {'infeasible':>10}")
    for name in ("rl", "greedy"):
        row = result["against_exact"][name]
        print(
            f"{name:>7}  {row['within_1_percent']:>9.1%}  {row['within_5_percent']:>9.1%}"
            f"  {row['median_gap']:>10.2%}  {row['infeasible']:>10}"
        )
    timing = result["dp_solve_time"]
    print(
        f"exact DP, {args.dp_layers} layers x {args.types} types: median {timing['median_ms']:.1f} ms,"
        f" max {timing['max_ms']:.1f} ms over {args.dp_problems} problems (goal < 100 ms)"
    )
    if not args.skip_dlrm:
        rows = result["dlrm"]
        within = sum(row["rl_gap"] <= 0.01 for row in rows)
        print(f"DLRM example (35 layers, example catalogue): RL within 1% of the optimum at {within} of {len(rows)}")
        for row in rows:
            print(
                f"  {row['profile']:>24}, {row['fraction_of_reach']:.0%} of reach ({row['target']:.4g} samples/s):"
                f" optimum {row['optimum_per_hour']:.2f}/h, RL {row['rl_gap']:+.1%}, greedy {row['greedy_gap']:+.1%}"
            )
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2, default=str))
