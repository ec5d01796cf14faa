"""``dynamix bench replan``: does ``dynamix plan`` choose the same placement when it is run again?

Runs ``dynamix plan --model dlrm --save-profile`` ``--runs`` times, each a fresh process profiling
afresh, as a user running the command again would; then plans every saved profile at each target of
``--throughput`` (one catalogue) and counts the distinct placements (resource, units and layers of
every stage) per target, with every run's margin there (``placement_margin``: how far its profile's
times could be off before its placement changes). The profiles' spreads and whole-pass times are
reported beside them.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from lightning_dynamix.bench.records import arguments_record, machine_description
from lightning_dynamix.placement import (
    CostModel,
    InfeasibleError,
    ModelProfile,
    load_catalogue,
    placement_margin,
    solve_dp,
)

CATALOGUE = Path(__file__).resolve().parents[2] / "examples" / "placement" / "catalogue.yaml"
SAMPLES = 65536  # the example data's samples per epoch (the cost per hour, which ranks placements, ignores it)
# within reach of the example catalogue with the runner's terms on a small machine (docs/benchmarks/placement.md)
DEFAULT_TARGETS = "50000,100000,200000,300000,400000"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=5, help="fresh `dynamix plan` runs, each profiling (default 5)")
    parser.add_argument(
        "--throughput", default=DEFAULT_TARGETS, help=f"targets, samples/s, comma-separated (default {DEFAULT_TARGETS})"
    )
    parser.add_argument("--resources", type=Path, default=CATALOGUE, help="the catalogue (default the example's)")
    parser.add_argument("--no-runner", action="store_true", help="profile the layers alone (dynamix plan --no-runner)")
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")


def _targets(value: str) -> list[float]:
    try:
        targets = [float(t) for t in value.split(",")]
    except ValueError:
        raise SystemExit(
            f"dynamix bench replan: --throughput must be numbers separated by commas, got {value!r}"
        ) from None
    if not targets or any(t <= 0 for t in targets):
        raise SystemExit(f"dynamix bench replan: --throughput must be positive samples/s, got {value!r}")
    return targets


def _profile(path: Path, resources: Path, no_runner: bool) -> ModelProfile:
    command = [sys.executable, "-m", "lightning_dynamix.cli.main", "plan", "--model", "dlrm"]
    command += ["--resources", str(resources), "--throughput", "1", "--save-profile", str(path)]
    command += ["--no-runner"] if no_runner else []
    subprocess.run(command, check=True, capture_output=True)
    return ModelProfile.load(path)


def _placement(
    profile: ModelProfile, resources: Any, target: float, samples: int
) -> tuple[tuple[float, str], tuple[float | None, float | None]]:
    """The placement (cost per hour, stages) and its margin (slower, faster; see placement_margin)."""
    cost = CostModel(profile, resources, target, training_samples=samples)
    try:
        plan = solve_dp(cost)
    except InfeasibleError:
        return (math.inf, "infeasible"), (None, None)
    margin = placement_margin(cost)
    return (plan.cost_per_hour, plan.describe_stages()), (margin.slower, margin.faster)


def _percent(margin: float | None) -> str:
    return "-" if margin is None else f"{100 * margin:.1f}%"


def run(args: argparse.Namespace) -> None:
    if args.runs < 1:
        raise SystemExit(f"dynamix bench replan: --runs must be >= 1, got {args.runs}")
    targets = _targets(args.throughput)
    resources = load_catalogue(args.resources)
    with tempfile.TemporaryDirectory() as directory:
        profiles = []
        for run_index in range(args.runs):
            profiles.append(_profile(Path(directory) / f"profile-{run_index}.json", args.resources, args.no_runner))
            step = profiles[-1].step_seconds["cpu"] * profiles[-1].batch_size
            runner = profiles[-1].runner
            fixed = "" if runner is None else f", runner's fixed terms {1e3 * runner.fixed_seconds:.2f} ms per step"
            spread = 100 * profiles[-1].spread("cpu")
            print(f"run {run_index}: whole pass {1e3 * step:.2f} ms, spread {spread:.1f}%{fixed}")
    per_target = {}
    for target in targets:
        placements, margins = zip(*(_placement(profile, resources, target, SAMPLES) for profile in profiles))
        chosen = Counter(placements)
        per_target[f"{target:g}"] = {
            "distinct_placements": len(chosen),
            "placements": [
                {"runs": n, "cost_per_hour": cost, "stages": stages} for (cost, stages), n in chosen.items()
            ],
            "margins": [{"slower": slower, "faster": faster} for slower, faster in margins],
        }
    result = {
        "benchmark": "replan",
        "config": arguments_record(args),
        "machine": machine_description(),
        "profiles": [
            {
                "step_ms": 1e3 * p.step_seconds["cpu"] * p.batch_size,
                "spread": p.spread("cpu"),
                "runner": None if p.runner is None else p.runner.to_dict(),
            }
            for p in profiles
        ],
        "targets": per_target,
    }
    print(f"\ndynamix bench replan: DLRM, {args.runs} runs of `dynamix plan`, each profiling afresh")
    for target, row in per_target.items():
        margins = ", ".join(f"{_percent(m['slower'])}/{_percent(m['faster'])}" for m in row["margins"])
        print(f"target {target} samples/s: {row['distinct_placements']} distinct placement(s);"
              f" margins per run, slower/faster: {margins}")  # fmt: skip
        for placement in row["placements"]:
            print(f"  {placement['runs']} run(s): {placement['cost_per_hour']:.2f}/hour, {placement['stages']}")
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2))
