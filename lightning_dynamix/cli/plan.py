"""``dynamix plan``: profile a model, read a catalogue, and print the cheapest placement for a throughput.

    dynamix plan --model dlrm --resources examples/placement/catalogue.yaml --throughput 20000

``--model`` is ``dlrm`` (the CTR example with its data) or the class path of a LightningModule, with
``--data`` the class path of a LightningDataModule whose first training batch is the example batch.
The plan's table gives every layer its resource type; the all-CPU and all-GPU placements are priced
beside it. ``--output plan.json`` writes the plan for ``LayerOffloadStrategy(offload="plan.json")``.
``--save-profile profile.json`` writes the profile measured, and ``--profile profile.json`` plans
from it instead of profiling again: solvers compared on one profile, a plan reproduced exactly.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
from pathlib import Path
from typing import Any

from lightning_dynamix.placement import (
    CostModel,
    InfeasibleError,
    ModelProfile,
    PlacementPlan,
    load_catalogue,
    placement_margin,
    profile_model,
    solve_dp,
    solve_greedy,
)
from lightning_dynamix.placement.profile import DEFAULT_REPEATS, layer_names
from lightning_dynamix.placement.rl import SEARCH_ROUNDS, load_rl_scheduler, solve_rl
from lightning_dynamix.strategies.layer_offload import profile_runner

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
    parser.add_argument(
        "--rl-search",
        type=int,
        default=SEARCH_ROUNDS,
        help=f"rounds of active search on the model for --solver rl (default {SEARCH_ROUNDS}; 0: the policy alone)",
    )
    parser.add_argument("--epochs", type=int, default=1, help="epochs the training cost is for (default 1)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"timed samples per layer when profiling, the fastest kept (default {DEFAULT_REPEATS})",
    )
    parser.add_argument("--output", type=Path, default=None, help="write the plan here (.json or .yaml)")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="plan from this profile (written by --save-profile) instead of profiling the model again; the model"
        " and data are still loaded, to check the layers and count the samples",
    )
    parser.add_argument("--save-profile", type=Path, default=None, help="write the profile measured here (JSON)")
    parser.add_argument(
        "--no-runner",
        action="store_true",
        help="price the layers alone, without what a step of LayerOffloadStrategy pays beside them (its loop,"
        " round trips, rows and optimiser step, measured by default)",
    )


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
    if args.rl_search < 0:
        raise SystemExit(f"dynamix plan: --rl-search must be >= 0 (0: the policy alone), got {args.rl_search}")
    resources = load_catalogue(args.resources)
    model, data = _model_and_data(args)
    if hasattr(data, "setup"):
        data.setup("fit")
    loader = data.train_dataloader()
    batch = next(iter(loader))
    if args.profile is not None:
        profile = _saved_profile(args, model, batch)
    else:
        profile = profile_model(model, batch, repeats=DEFAULT_REPEATS if args.repeats is None else args.repeats)
        if not args.no_runner:
            profile = profile.with_runner(profile_runner(model, loader))
    if args.no_runner:
        profile = profile.with_runner(None)
    if args.save_profile is not None:
        profile.save(args.save_profile)
    samples = len(loader.dataset) * args.epochs  # per epoch x epochs
    cost = CostModel(profile, resources, args.throughput, training_samples=samples)
    try:
        if args.solver == "rl":
            plan = solve_rl(cost, load_rl_scheduler(args.scheduler), search=args.rl_search)
        else:
            plan = solve_dp(cost) if args.solver == "dp" else solve_greedy(cost)
    except ValueError as error:  # InfeasibleError too
        raise SystemExit(f"dynamix plan: {error}") from None
    source = f"read from {args.profile}" if args.profile is not None else "profiled"
    print(f"dynamix plan: {type(model).__name__}, {len(profile.layers)} layers {source} on {list(profile.devices)}")
    for device in profile.devices:
        print(_spread_line(profile, device))
    print(_runner_line(profile))
    if args.save_profile is not None:
        print(f"profile written to {args.save_profile}")
    print(f"target {args.throughput:g} samples/s, {samples} samples per epoch x {args.epochs} epochs, {args.solver}")
    _print_plan(plan, profile)
    if args.solver == "dp":
        print(_margin_line(cost, profile, saved=args.profile is not None))
    if plan.sequential_throughput < args.throughput:
        print(_one_after_another_line(plan))
    print()
    print(f"{'placement':>10}  {'cost/hour':>10}  {'cost/epoch':>11}  throughput")
    for name, plan_or_error in _alternatives(cost, plan, args.epochs):
        print(f"{name:>10}  {plan_or_error}")
    if args.output is not None:
        plan.save(args.output)
        print(f"\nplan written to {args.output}")


def _saved_profile(args: argparse.Namespace, model: Any, batch: Any) -> ModelProfile:
    """The profile of ``--profile``, checked against the model: a ``SystemExit`` saying what does not match."""
    if args.repeats is not None:
        raise SystemExit(
            f"dynamix plan: --repeats {args.repeats} times a new profile, but --profile {args.profile} plans from a"
            " saved one; give one or the other"
        )
    try:
        profile = ModelProfile.load(args.profile)
    except FileNotFoundError:
        raise SystemExit(f"dynamix plan: --profile {args.profile} does not exist") from None
    except (ValueError, KeyError, TypeError) as error:  # JSON errors are ValueErrors
        raise SystemExit(
            f"dynamix plan: --profile {args.profile} is not a profile written by --save-profile"
            f" ({type(error).__name__}: {error})"
        ) from None
    expected = layer_names(model, batch)
    saved = tuple(layer.name for layer in profile.layers)
    if saved != expected:
        first = next((i for i, (a, b) in enumerate(zip(saved, expected)) if a != b), min(len(saved), len(expected)))
        raise SystemExit(
            f"dynamix plan: --profile {args.profile} is of another model: it lists {len(saved)} layers, this"
            f" {type(model).__name__} runs {len(expected)}, and they differ from layer {first}"
            f" ({saved[first] if first < len(saved) else 'none'!r} in the profile,"
            f" {expected[first] if first < len(expected) else 'none'!r} in the model)"
        )
    return profile


def _spread_line(profile: ModelProfile, device: str) -> str:
    """How far the profile's timings on ``device`` can be trusted: the spread of their samples."""
    if not profile.layers[0].spread:
        return f"  {device}: the profile records no spread (written before spreads were kept)"
    widest = max(profile.layers, key=lambda layer: layer.spread[device])
    whole = 1e3 * profile.step_seconds[device] * profile.batch_size
    return (
        f"  {device}: whole pass {whole:.2f} ms per batch of {profile.batch_size} (spread"
        f" {100 * profile.step_spread[device]:.1f}%), layers' spread {100 * profile.spread(device):.1f}% weighted by"
        f" time, widest {widest.name} {100 * widest.spread[device]:.1f}% (interquartile range over the median)"
    )


def _runner_line(profile: ModelProfile) -> str:
    """The runner's terms the plan includes, per step of the profile's batch."""
    runner = profile.runner
    if runner is None:
        return "  runner: not included (the layers alone are priced)"
    return f"  runner, per step: {runner.summary()}"


def _margin_line(cost: CostModel, profile: ModelProfile, saved: bool) -> str:
    """How far the profile may be off before the plan changes, and whether that is within its own spread
    (with how to keep one profile, unless it was read from one: ``saved``)."""
    margin = placement_margin(cost)

    def side(moved: float | None, other: PlacementPlan | None, way: str) -> str:
        if moved is None:
            return f"a profile up to {100 * margin.limit:.0f}% {way} gets the same placement"
        if other is None:
            return f"a profile {100 * moved:.1f}% {way} gets none (no placement is feasible)"
        return f"a profile {100 * moved:.1f}% {way} gets another placement ({other.describe_stages()})"

    slower = side(margin.slower, margin.slower_plan, "slower")
    line = f"\nmargin: {slower}; {side(margin.faster, margin.faster_plan, 'faster')}"
    spread = max([*profile.step_spread.values(), *(profile.spread(device) for device in profile.devices)], default=0)
    nearest = min(m for m in (margin.slower, margin.faster, math.inf) if m is not None)
    if nearest < spread:
        line += f"\n  that is within this profile's own spread ({100 * spread:.1f}%): profiled again, it may differ"
        line += "" if saved else "; --save-profile and --profile plan from one profile"
    return line


def _one_after_another_line(plan: PlacementPlan) -> str:
    """For a plan that meets its target only with its stages overlapped: LayerOffloadStrategy's default does not."""
    return (
        f"\nnote: the target is met with the {len(plan.stages)} stages overlapped ({plan.throughput:.4g} samples/s)."
        f" LayerOffloadStrategy at staleness=0, its default, runs them one after another:"
        f" {plan.sequential_throughput:.4g} samples/s. staleness=1 overlaps a lookup with the step before;"
        " that forecast is an upper bound"
    )


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
