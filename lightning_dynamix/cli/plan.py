"""``dynamix plan``: profile a model, read a catalogue, and print the cheapest placement for a throughput.

    dynamix plan --model dlrm --resources examples/placement/catalogue.yaml --throughput 20000

``--model`` is ``dlrm`` (the CTR example with its data) or the class path of a LightningModule, with
``--data`` the class path of a LightningDataModule whose first training batch is the example batch.
The plan's table gives every layer its resource type; the all-CPU and all-GPU placements are priced
beside it. ``--output plan.json`` writes the plan for ``LayerOffloadStrategy(offload="plan.json")``.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

from lightning_dynamix.placement import (
    CostModel,
    InfeasibleError,
    PlacementPlan,
    load_catalogue,
    profile_model,
    solve_dp,
    solve_greedy,
)
from lightning_dynamix.placement.rl import load_rl_scheduler, solve_rl

SOLVERS = ("dp", "greedy", "rl")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="'dlrm', or a LightningModule's class path (pkg.module.Class)")
    parser.add_argument("--data", default=None, help="a LightningDataModule's class path (with a class-path --model)")
    parser.add_argument("--model-args", type=json.loads, default={}, help="the model's arguments, as JSON")
    parser.add_argument("--data-args", type=json.loads, default={}, help="the data module's arguments, as JSON")
    parser.add_argument("--resources", type=Path, required=True, help="the catalogue of resource types (YAML)")
    parser.add_argument("--throughput", type=float, required=True, help="the target, samples/s")
    parser.add_argument(
        "--solver", choices=SOLVERS, default="dp", help="dp (exact, default), greedy, or rl (HeterPS's scheduler)"
    )
    parser.add_argument(
        "--scheduler", type=Path, default=None, help="the RL scheduler file for --solver rl (default: the shipped one)"
    )
    parser.add_argument("--epochs", type=int, default=1, help="epochs the training cost is for (default 1)")
    parser.add_argument("--repeats", type=int, default=10, help="timed passes per layer when profiling (default 10)")
    parser.add_argument("--output", type=Path, default=None, help="write the plan here (.json or .yaml)")


def _load(class_path: str, what: str) -> Any:
    module_name, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise SystemExit(f"dynamix plan: cannot import the {what} {class_path!r}: {error}") from None


def _model_and_data(args: argparse.Namespace) -> tuple[Any, Any]:
    if args.model == "dlrm":
        from lightning_dynamix.data import CTRDataModule
        from lightning_dynamix.data.dlrm import DLRM

        data = CTRDataModule(**args.data_args)
        model_args = {"num_dense": data.spec.num_dense, "table_sizes": data.spec.table_sizes, **args.model_args}
        return DLRM(**model_args), data
    if args.data is None:
        raise SystemExit("dynamix plan: a class-path --model needs --data, the LightningDataModule of its batches")
    return _load(args.model, "model")(**args.model_args), _load(args.data, "data module")(**args.data_args)


def run(args: argparse.Namespace) -> None:
    resources = load_catalogue(args.resources)
    model, data = _model_and_data(args)
    if hasattr(data, "setup"):
        data.setup("fit")
    loader = data.train_dataloader()
    batch = next(iter(loader))
    profile = profile_model(model, batch, repeats=args.repeats)
    samples = len(loader.dataset) * args.epochs  # per epoch x epochs
    cost = CostModel(profile, resources, args.throughput, training_samples=samples)
    try:
        if args.solver == "rl":
            plan = solve_rl(cost, load_rl_scheduler(args.scheduler))
        else:
            plan = solve_dp(cost) if args.solver == "dp" else solve_greedy(cost)
    except ValueError as error:  # InfeasibleError too
        raise SystemExit(f"dynamix plan: {error}") from None
    print(f"dynamix plan: {type(model).__name__}, {len(profile.layers)} layers profiled on {list(profile.devices)}")
    print(f"target {args.throughput:g} samples/s, {samples} samples per epoch x {args.epochs} epochs, {args.solver}")
    _print_plan(plan, profile)
    print()
    print(f"{'placement':>10}  {'cost/hour':>10}  {'cost/epoch':>11}  throughput")
    for name, plan_or_error in _alternatives(cost, plan, args.epochs):
        print(f"{name:>10}  {plan_or_error}")
    if args.output is not None:
        plan.save(args.output)
        print(f"\nplan written to {args.output}")


def _print_plan(plan: PlacementPlan, profile: Any) -> None:
    print(f"\n{'layer':<24} {'kind':<7} {'resource':<16} {'stage':>5} {'units':>5}")
    for index, (layer, kind, resource) in enumerate(zip(plan.layers, plan.kinds, plan.assignment)):
        stage = next(s for s, st in enumerate(plan.stages) if st.first <= index <= st.last)
        print(f"{layer:<24} {kind:<7} {resource:<16} {stage:>5} {plan.stages[stage].units:>5}")


def _alternatives(cost: CostModel, plan: PlacementPlan, epochs: int) -> list[tuple[str, str]]:
    rows = [("chosen", _describe(plan, epochs))]
    for device in ("cpu", "gpu"):
        kinds = [r for r in cost.resources if r.device == device]
        if not kinds:
            rows.append((f"all-{device}", "no such resource in the catalogue"))
            continue
        try:
            rows.append((f"all-{device}", _describe(solve_dp(CostModel(
                cost.profile, kinds, cost.target, cost.training_samples, cost.parameter_copies
            )), epochs)))  # fmt: skip
        except InfeasibleError as error:
            rows.append((f"all-{device}", f"infeasible: {error}"))
    return rows


def _describe(plan: PlacementPlan, epochs: int) -> str:
    return (
        f"{plan.cost_per_hour:>10.3f}  {plan.training_cost / epochs:>11.4g}  {plan.throughput:.4g} samples/s"
        f" ({plan.sequential_throughput:.4g} with the stages run one after another)"
    )
