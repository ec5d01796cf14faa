"""Entry point of the ``dynamix`` command."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence

from lightning_dynamix.bench import core as bench
from lightning_dynamix.bench import device as bench_device
from lightning_dynamix.bench import elastic as bench_elastic
from lightning_dynamix.bench import heterogeneity as bench_heterogeneity
from lightning_dynamix.bench import offload as bench_offload
from lightning_dynamix.bench import placement as bench_placement
from lightning_dynamix.bench import plan as bench_plan
from lightning_dynamix.bench import policy as bench_policy
from lightning_dynamix.bench import replan as bench_replan
from lightning_dynamix.bench import sit_out as bench_sit_out
from lightning_dynamix.cli import demo, plan, policy, report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynamix", description="lightning-dynamix: heterogeneous data parallelism")
    commands = parser.add_subparsers(dest="command", required=True)

    demo_parser = commands.add_parser(
        "demo", help="a 2-process job with one rank 3x slower: static batches, then DynamixCallback"
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=demo.run_demo)

    report_parser = commands.add_parser(
        "report", help="plots and a summary of what the controller did, from a run's CSV or TensorBoard logs"
    )
    report.add_arguments(report_parser)
    report_parser.set_defaults(func=report.run_report)

    train = commands.add_parser(
        "train-policy", help="train a batch-size policy with PPO in the cluster simulator and write its policy file"
    )
    policy.add_train_arguments(train)
    train.set_defaults(func=policy.run_train)
    simulate = commands.add_parser(
        "simulate", help="controllers compared in the cluster simulator on held-out scenarios: time to accuracy"
    )
    policy.add_simulate_arguments(simulate)
    simulate.set_defaults(func=policy.run_simulate)
    calibrate = commands.add_parser(
        "calibrate", help="fit a simulator scenario to a run's logged metrics and replay the run to check it"
    )
    policy.add_calibrate_arguments(calibrate)
    calibrate.set_defaults(func=policy.run_calibrate)

    plan_parser = commands.add_parser(
        "plan", help="profile a model and print the cheapest placement of its layers on a catalogue's resources"
    )
    plan.add_arguments(plan_parser)
    plan_parser.set_defaults(func=plan.run)

    bench_parser = commands.add_parser("bench", help="measured benchmarks")
    benchmarks = bench_parser.add_subparsers(dest="benchmark", required=True)
    overhead = benchmarks.add_parser(
        "overhead", help="HeterogeneousDDPStrategy with equal sizes against Lightning's ddp, back to back"
    )
    bench.add_overhead_arguments(overhead)
    overhead.set_defaults(func=bench.run_overhead)
    hook = benchmarks.add_parser(
        "hook", help="the weighted all-reduce hook against DDP's built-in reduction, interleaved per iteration"
    )
    bench.add_hook_arguments(hook)
    hook.set_defaults(func=bench.run_hook)
    balance = benchmarks.add_parser("balance", help="achieved throughput against the ideal sum of rank speeds")
    bench_heterogeneity.add_balance_arguments(balance)
    balance.set_defaults(func=bench_heterogeneity.run_balance)
    tta = benchmarks.add_parser("tta", help="time to target accuracy and final accuracy per controller")
    bench_heterogeneity.add_tta_arguments(tta)
    tta.set_defaults(func=bench_heterogeneity.run_tta)
    policy_bench = benchmarks.add_parser("policy", help="PPOController's decision time at several world sizes")
    bench_policy.add_arguments(policy_bench)
    policy_bench.set_defaults(func=bench_policy.run)
    offload = benchmarks.add_parser(
        "offload", help="LayerOffloadStrategy against one process: step time, and the largest tables in a memory budget"
    )
    bench_offload.add_arguments(offload)
    offload.set_defaults(func=bench_offload.run)
    placement = benchmarks.add_parser(
        "placement", help="the RL and greedy placement solvers against the exact one, and the exact one's solve time"
    )
    bench_placement.add_arguments(placement)
    placement.set_defaults(func=bench_placement.run)
    plan_bench = benchmarks.add_parser(
        "plan", help="a placement plan's predicted throughput against the plan run with LayerOffloadStrategy"
    )
    bench_plan.add_arguments(plan_bench)
    plan_bench.set_defaults(func=bench_plan.run)
    replan = benchmarks.add_parser(
        "replan", help="`dynamix plan` run again and again: does it choose the same placement each time?"
    )
    bench_replan.add_arguments(replan)
    replan.set_defaults(func=bench_replan.run)
    sit_out = benchmarks.add_parser(
        "sit-out", help="a step's time while ranks sit out (min_batch_size=0), and while the sitting ranks change"
    )
    bench_sit_out.add_arguments(sit_out)
    sit_out.set_defaults(func=bench_sit_out.run)
    elastic = benchmarks.add_parser(
        "elastic", help="a node preempted and back under torch elastic: work lost, recovery and time to accuracy"
    )
    bench_elastic.add_arguments(elastic)
    elastic.set_defaults(func=bench_elastic.run)
    device = benchmarks.add_parser(
        "device", help="this machine's accelerator: exactness per precision, device timing, memory recovery, NVML"
    )
    bench_device.add_arguments(device)
    device.set_defaults(func=bench_device.run)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    # a deprecation inside Lightning's own pytree helper, printed on every step with recent torch
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
