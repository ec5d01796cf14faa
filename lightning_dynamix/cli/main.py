"""Entry point of the ``dynamix`` command: every command and every benchmark (``dynamix bench``) from one table."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_dynamix.bench import balance, device, elastic, hook, offload, overhead, placement, replan, sit_out, tta
from lightning_dynamix.bench import plan as plan_bench
from lightning_dynamix.bench import policy as policy_bench
from lightning_dynamix.cli import demo, plan, policy, report


@dataclass(frozen=True)
class Command:
    """One command of ``dynamix``: its name, its one-line help, its arguments and what runs it."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]


COMMANDS = (
    Command(
        "demo", "a 2-process job with one rank 3x slower: static batches, then DynamixCallback", demo.add_arguments,
        demo.run_demo,
    ),
    Command(
        "report", "plots and a summary of what the controller did, from a run's CSV or TensorBoard logs",
        report.add_arguments, report.run_report,
    ),
    Command(
        "train-policy", "train a batch-size policy with PPO in the cluster simulator and write its policy file",
        policy.add_train_arguments, policy.run_train,
    ),
    Command(
        "simulate", "controllers compared in the cluster simulator on held-out scenarios: time to accuracy",
        policy.add_simulate_arguments, policy.run_simulate,
    ),
    Command(
        "calibrate", "fit a simulator scenario to a run's logged metrics and replay the run to check it",
        policy.add_calibrate_arguments, policy.run_calibrate,
    ),
    Command(
        "plan", "profile a model and print the cheapest placement of its layers on a catalogue's resources",
        plan.add_arguments, plan.run,
    ),
)  # fmt: skip
"""The commands of ``dynamix``, in the order ``dynamix --help`` lists them."""

BENCHMARKS = (
    Command(
        "overhead", "HeterogeneousDDPStrategy with equal sizes against Lightning's ddp, in interleaved rounds",
        overhead.add_arguments, overhead.run,
    ),
    Command(
        "hook", "the weighted all-reduce hook against DDP's built-in reduction, interleaved per iteration",
        hook.add_arguments, hook.run,
    ),
    Command(
        "balance", "achieved throughput against the ideal and the best fixed split", balance.add_arguments, balance.run
    ),
    Command("tta", "time to target accuracy and final accuracy per controller", tta.add_arguments, tta.run),
    Command(
        "policy", "PPOController's decision time at several world sizes", policy_bench.add_arguments, policy_bench.run
    ),
    Command(
        "offload", "LayerOffloadStrategy against one process: step time, and the largest tables in a memory budget",
        offload.add_arguments, offload.run,
    ),
    Command(
        "placement", "the RL and greedy placement solvers against the exact one, and the exact one's solve time",
        placement.add_arguments, placement.run,
    ),
    Command(
        "plan", "a placement plan's predicted throughput against the plan run with LayerOffloadStrategy",
        plan_bench.add_arguments, plan_bench.run,
    ),
    Command(
        "replan", "`dynamix plan` run again and again: does it choose the same placement each time?",
        replan.add_arguments, replan.run,
    ),
    Command(
        "sit-out", "a step's time while ranks sit out (min_batch_size=0), and while the sitting ranks change",
        sit_out.add_arguments, sit_out.run,
    ),
    Command(
        "elastic", "a node preempted and back under torch elastic: work lost, recovery and time to accuracy",
        elastic.add_arguments, elastic.run,
    ),
    Command(
        "device", "this machine's accelerator: exactness per precision, device timing, memory recovery, NVML",
        device.add_arguments, device.run,
    ),
)  # fmt: skip
"""The benchmarks under ``dynamix bench``, each in the module of :mod:`lightning_dynamix.bench` named for it."""


def _register(commands: argparse._SubParsersAction, table: Sequence[Command]) -> None:
    for command in table:
        parser = commands.add_parser(command.name, help=command.help)
        command.add_arguments(parser)
        parser.set_defaults(func=command.run)


def build_parser() -> argparse.ArgumentParser:
    """The ``dynamix`` command line: :data:`COMMANDS`, and ``bench`` with :data:`BENCHMARKS`."""
    parser = argparse.ArgumentParser(prog="dynamix", description="lightning-dynamix: heterogeneous data parallelism")
    commands = parser.add_subparsers(dest="command", required=True)
    _register(commands, COMMANDS)
    bench = commands.add_parser("bench", help="measured benchmarks")
    _register(bench.add_subparsers(dest="benchmark", required=True), BENCHMARKS)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command ``argv`` (default: the process's arguments) names."""
    # a deprecation inside Lightning's own pytree helper, printed on every step with recent torch
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
