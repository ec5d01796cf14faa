"""What ``dynamix bench balance`` and ``dynamix bench tta`` share: the cluster they run on (speeds, contention, hosts
and their links, load changes), the model, the arguments that describe them and the run configuration built from them.

The cluster is emulated (sleeps) or made of real contention on this machine (:mod:`lightning_dynamix.bench.contention`),
on loopback or on hosts with shaped links (:mod:`lightning_dynamix.bench.hosts`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lightning_dynamix.bench import contention
from lightning_dynamix.bench.arguments import floats
from lightning_dynamix.bench.harness import RunConfig, is_launcher_rank_zero
from lightning_dynamix.bench.hosts import HostsUnavailable, check_hosts, describe_links, parse_links
from lightning_dynamix.bench.load import LoadChange, check_changes, parse_change
from lightning_dynamix.data.workloads import ARCHITECTURES


def schedule(text: str) -> tuple[tuple[int, int, float] | LoadChange, ...]:
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


def add_cluster_arguments(parser: argparse.ArgumentParser, batch_size: int, controllers: str) -> None:
    """The arguments both benchmarks take: the controllers to run, the cluster, the model, the oracle and the output;
    ``batch_size`` and ``controllers`` are their defaults."""
    parser.add_argument(
        "--controllers",
        default=controllers,
        help=f"static, pid, goodput or ppo, one or several comma-separated, each run in turn (default {controllers})",
    )
    # the name `dynamix bench balance` once took, still read
    parser.add_argument("--controller", dest="controllers", help=argparse.SUPPRESS)
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
        type=schedule,
        default=(),
        help="speed changes STEP:RANK:FACTOR,... (e.g. 50:1:3 makes rank 1 3x slower from step 50)",
    )
    parser.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="width of the classifier's layers (default 768); the resnet's first stage (default 16); the causal-lm's"
        " model width (default 128)",
    )
    parser.add_argument(
        "--architecture",
        choices=(*ARCHITECTURES, "causal-lm"),
        default="mlp",
        help="the classifier: mlp (default), a small transformer encoder (another model family), or resnet (a"
        " ResNet-style network with BatchNorm on synthetic images); or causal-lm, a causal transformer language"
        " model on token sequences of 4-39 tokens, gradients weighted by tokens",
    )
    parser.add_argument(
        "--group-by-length",
        type=int,
        default=None,
        help="causal-lm: batches of alike lengths, each run of this many samples of the order sorted by length"
        " (HeterogeneousDDPStrategy(group_by_length=N)); default: sequences at random",
    )
    parser.add_argument(
        "--sharded",
        action="store_true",
        help="shard the model with FSDP2 (fully_shard on each layer or block) under HeterogeneousFSDPStrategy;"
        " default: DDP (HeterogeneousDDPStrategy)",
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


def hidden_width(args: argparse.Namespace) -> int:
    """``--hidden``, or the architecture's default width."""
    if args.hidden is not None:
        return args.hidden
    return {"resnet": 16, "causal-lm": 128}.get(args.architecture, 768)


def run_config(args: argparse.Namespace, **fields: Any) -> RunConfig:
    """The run every controller of ``args`` trains: the cluster and the model the arguments describe, and ``fields``
    (the controller, the budget, what only one benchmark sets)."""
    return RunConfig(
        speeds=args.speeds,
        contention=args.contention,
        batch_size=args.batch_size,
        interval=args.interval,
        hidden=hidden_width(args),
        num_samples=args.num_samples,
        architecture=args.architecture,
        sync_batchnorm=args.sync_batchnorm,
        schedule=args.schedule,
        links=args.links,
        load_changes=args.load_changes,
        group_by_length=args.group_by_length,
        sharded=args.sharded,
        streaming_dir=getattr(args, "streaming_dir", None),
        streaming_in_order=getattr(args, "streaming", None) == "in-order",
        **fields,
    )


def change_steps(args: argparse.Namespace) -> list[int]:
    """The steps of the schedule's changes, the emulator's and the machine's."""
    return [entry[0] for entry in args.schedule] + [change.step for change in args.load_changes]


def first_change(args: argparse.Namespace) -> int | None:
    """The step of the schedule's first change, ``None`` without one."""
    return min(change_steps(args), default=None)


def links_header(args: argparse.Namespace) -> str:
    """`` hosts on links of R,R Mbit/s,`` for a header, where ``--links`` put the ranks on hosts."""
    return "" if args.links is None else f" {describe_links(args.links)},"


def check_machine(args: argparse.Namespace) -> None:
    """``--links`` as rates and the schedule split into the emulator's factors (``args.schedule``) and the machine's
    changes (``args.load_changes``), each checked against the run and this machine: a ``SystemExit`` saying what
    is wrong."""
    if args.sharded and args.architecture == "causal-lm":
        raise SystemExit("--sharded trains the classification workloads (mlp, transformer, resnet), not causal-lm")
    if args.group_by_length is not None and (args.architecture != "causal-lm" or args.group_by_length < 2):
        raise SystemExit(
            f"--group-by-length needs --architecture causal-lm and at least 2 samples, got {args.group_by_length}"
            f" with --architecture {args.architecture}"
        )
    try:
        if args.links is not None:
            args.links = tuple(parse_links(args.links, len(args.speeds)))
            check_hosts()
        args.load_changes = tuple(c for c in args.schedule if isinstance(c, LoadChange))
        args.schedule = tuple(c for c in args.schedule if not isinstance(c, LoadChange))
        check_changes(args.load_changes, args.contention, len(args.speeds), args.links is not None)
    except (ValueError, HostsUnavailable) as error:
        raise SystemExit(str(error)) from None


def contention_for(args: argparse.Namespace) -> contention.Contention:
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
