"""``dynamix bench offload``: LayerOffloadStrategy against the same DLRM trained in one process.

Two measurements, both of one trainer process on this machine:

* speed: the median step time and samples/s of the DLRM example (26 Criteo-like tables), with the
  tables in the trainer (plain Lightning) and on 1 or 2 embedding servers at staleness 0 and 1,
  run back to back in rounds;
* memory: for the tables in the trainer and on each number of servers, the largest rows per table
  (26 tables, doubling) that trains within a fixed budget of trainer memory (peak resident set
  size), each size probed in a fresh process.

``--links TRAINER,SERVER`` (Mbit/s; ``0`` or ``-``: no limit) runs every speed set-up with the trainer and each
server on hosts of their own (:class:`~lightning_dynamix.bench.hosts.Hosts`, network namespaces; needs root):
the trainer a process on the first host (the set-up with the tables in the trainer too), the servers started
as a cluster starts them on the others, every lookup and update crossing the links.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynamix.bench.hosts import (
    SERVER_PORT,
    Hosts,
    HostsUnavailable,
    check_hosts,
    describe_links,
    offload_job_result,
    parse_links,
)
from lightning_dynamix.bench.records import arguments_record, machine_description
from lightning_dynamix.bench.rounds import interleaved_rounds
from lightning_dynamix.bench.timing import StepTimer, timed_trainer
from lightning_dynamix.data import CRITEO_LIKE_TABLE_SIZES, CTRDataModule
from lightning_dynamix.data.dlrm import DLRM
from lightning_dynamix.distributed import job_environment
from lightning_dynamix.strategies import LayerOffloadStrategy

NUM_TABLES = len(CRITEO_LIKE_TABLE_SIZES)
# (name, servers, staleness, prefetch depth, trainer threads); servers 0: the tables in the trainer, plain
# Lightning. Depth 1 reads a batch ahead and overlaps its lookup with the step before (pipelined); 0 looks
# a step up when it starts. Threads None: the strategy's default (a core left to each server launched);
# "all": every core to the trainer, as the runner did before it left cores to its servers.
ALL_CORES = "all"
SETUPS: list[tuple[str, int, int, int, int | str | None]] = [("in-process", 0, 0, 0, None)] + [
    (
        f"{servers} server{'s' if servers > 1 else ''}{', staleness 1' if staleness else ''}{suffix}",
        servers,
        staleness,
        depth,
        threads,
    )
    for servers in (1, 2)
    for staleness in (0, 1)
    for depth, threads, suffix in ((0, ALL_CORES, ", before"), (0, None, ", not pipelined"), (1, None, ""))
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=512, help="samples per step (default 512)")
    parser.add_argument("--embedding-dim", type=int, default=16, help="values per embedding row (default 16)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every set-up (default 3)")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per run (default 60)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps at the start of each run (default 10)")
    parser.add_argument(
        "--memory-budget-mib", type=int, default=1536, help="trainer peak memory budget, MiB (default 1536)"
    )
    parser.add_argument(
        "--max-rows", type=int, default=2**21, help="the largest rows per table probed (default 2097152)"
    )
    parser.add_argument(
        "--servers", default="1,2", help="numbers of embedding servers set up, for speed and memory (default 1,2)"
    )
    parser.add_argument(
        "--setups", default=None, help="the speed set-ups to run, by name, separated by semicolons (default: every one)"
    )
    parser.add_argument("--skip-memory", action="store_true", help="measure speed only")
    parser.add_argument("--skip-speed", action="store_true", help="measure memory only")
    parser.add_argument(
        "--accelerator", default="cpu", help="the trainer's device: cpu (default) or gpu (the servers stay on CPU)"
    )
    parser.add_argument(
        "--links",
        default=None,
        help="the speed set-ups with the trainer and each server on a host of its own (network namespaces, needs"
        " root), on links of these rates in Mbit/s: TRAINER,SERVER (0 or -: no limit), every server at the second"
        " (default: all on this machine's loopback)",
    )
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)  # one speed run, on the trainer's host
    parser.add_argument("--probe-rows", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe-servers", type=int, default=0, help=argparse.SUPPRESS)


def _trainer(
    servers: int,
    staleness: int,
    steps: int,
    callbacks: list[Any],
    accelerator: str = "cpu",
    depth: int | None = None,
    threads: int | str | None = None,
    server_port: int | None = None,
) -> Trainer:
    strategy: Any = "auto"
    if servers:
        strategy = LayerOffloadStrategy(
            num_embedding_servers=servers,
            staleness=staleness,
            return_embeddings=False,
            prefetch_depth=depth,
            trainer_threads=torch.get_num_threads() if threads == ALL_CORES else threads,
            launch_servers=server_port is None,  # elsewhere: started on hosts of their own, meeting at the port
            server_port=server_port,
        )
    return timed_trainer(strategy, steps, callbacks, accelerator)


def _server_counts(servers: str) -> list[int]:
    """The numbers of servers ``--servers`` lists."""
    try:
        counts = {int(n) for n in servers.split(",")}
    except ValueError:
        counts = set()
    if not counts or not counts <= {1, 2}:
        raise SystemExit(f"dynamix bench offload: `--servers` must list 1 and/or 2, got {servers!r}")
    return sorted(counts)


def _speed(args: argparse.Namespace) -> dict[str, Any]:
    counts = _server_counts(args.servers)
    setups = [setup for setup in SETUPS if setup[1] == 0 or setup[1] in counts]
    if args.setups is not None:
        names = [name.strip() for name in args.setups.split(";") if name.strip()]
        known = [name for name, *_ in setups]
        unknown = [name for name in names if name not in known]
        if unknown or "in-process" not in names:
            raise SystemExit(
                f"dynamix bench offload: `--setups` must name in-process and any of {'; '.join(known)}"
                f" (with --servers {args.servers}), got {args.setups!r}"
            )
        setups = [setup for setup in setups if setup[0] in names]
    by_name = {name: rest for name, *rest in setups}
    # on hosts: the trainer on the first, each server on one more
    links = args.links
    on_hosts = Hosts([links[0]] + [links[1]] * max(counts)) if links is not None else contextlib.nullcontext()
    with on_hosts as hosts:

        def measure(name: str, round_index: int) -> float:
            servers, staleness, depth, threads = by_name[name]
            run = {"servers": servers, "staleness": staleness, "depth": depth, "threads": threads}
            step = _step_on_hosts(args, run, round_index, hosts) if hosts else _step(args, run, round_index)
            print(f"round {round_index} {name:>32}: {1e3 * step:8.2f} ms/step", flush=True)
            return step

        steps = interleaved_rounds(list(by_name), args.rounds, measure)
    base = statistics.median(steps["in-process"])
    return {
        name: {
            "median_step_ms": 1e3 * statistics.median(values),
            "samples_per_s": args.batch_size / statistics.median(values),
            "step_time_vs_in_process": statistics.median(values) / base,
            "step_ms_per_round": [1e3 * v for v in values],
        }
        for name, values in steps.items()
    }


def _step(args: argparse.Namespace, run: dict[str, Any], seed: int, server_port: int | None = None) -> float:
    """One speed run in this process: the median step's seconds (``server_port``: the servers started elsewhere)."""
    samples = args.batch_size * (args.steps + args.warmup + 1)
    data = CTRDataModule(num_samples=samples, num_val_samples=1, batch_size=args.batch_size)
    model = DLRM(embedding_dim=args.embedding_dim, seed=seed)
    timer = StepTimer(warmup=args.warmup)
    steps = args.steps + args.warmup + 1
    trainer = _trainer(
        run["servers"], run["staleness"], steps, [timer], args.accelerator, run["depth"], run["threads"], server_port
    )
    trainer.fit(model, datamodule=data)
    return timer.timings[0].median_step_seconds


_JOB_ARGS = ("batch_size", "embedding_dim", "steps", "warmup", "accelerator")


def _step_on_hosts(args: argparse.Namespace, run: dict[str, Any], seed: int, hosts: Hosts) -> float:
    """:func:`_step` with the trainer a process on host 0 and each server one on a host of its own."""
    spec = {"args": {a: getattr(args, a) for a in _JOB_ARGS}, "run": run, "seed": seed}
    module = "lightning_dynamix.bench.offload"
    result = offload_job_result(hosts, module, spec, run["servers"], run["staleness"], "dynamix bench offload")
    return float(result["step_seconds"])


def _job(text: str) -> None:
    """``--job``: one speed run in this process (on the trainer's host), its servers started by the caller."""
    spec = json.loads(text)
    run = spec["run"]
    step = _step(argparse.Namespace(**spec["args"]), run, spec["seed"], SERVER_PORT if run["servers"] else None)
    Path(spec["output"]).write_text(json.dumps({"step_seconds": step}))


def _probe(args: argparse.Namespace) -> None:
    """One short fit with ``--probe-rows`` rows per table; prints the trainer's peak memory."""
    rows, servers = args.probe_rows, args.probe_servers
    generator = torch.Generator().manual_seed(0)
    count = args.batch_size * 4
    data = TensorDataset(
        torch.randn(count, 13, generator=generator),
        torch.randint(0, rows, (count, NUM_TABLES), generator=generator),
        torch.randint(0, 2, (count,), generator=generator).float(),
    )
    # the tables of an offloaded model are never built in the trainer (meta device)
    model = DLRM(table_sizes=[rows] * NUM_TABLES, embedding_dim=args.embedding_dim, meta_embeddings=servers > 0)
    _trainer(servers, 0, 4, []).fit(model, DataLoader(data, batch_size=args.batch_size))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(json.dumps({"rows": rows, "servers": servers, "peak_bytes": peak}))


def _peak_bytes(args: argparse.Namespace, rows: int, servers: int) -> int | None:
    command = [sys.executable, "-m", "lightning_dynamix.bench.offload", "--probe-rows", str(rows)]
    command += ["--probe-servers", str(servers), "--batch-size", str(args.batch_size)]
    command += ["--embedding-dim", str(args.embedding_dim)]
    # a fresh job: not the variables Lightning left in this process for the runs of the speed measurement
    proc = subprocess.run(command, capture_output=True, text=True, env=job_environment())
    if proc.returncode != 0:  # out of memory, or a failure: this size does not train
        print(f"{rows} rows per table on {servers} servers failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return int(json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"])


def _memory(args: argparse.Namespace) -> dict[str, Any]:
    budget = args.memory_budget_mib * 2**20
    results = {}
    counts = _server_counts(args.servers)
    for name, servers in [("in-process", 0)] + [(f"{n} server{'s' if n > 1 else ''}", n) for n in counts]:
        rows, largest, probes = 2**14, None, []
        while rows <= args.max_rows:
            peak = _peak_bytes(args, rows, servers)
            probes.append({"rows": rows, "peak_mib": None if peak is None else peak / 2**20})
            print(f"{name:>10}: {rows:>9} rows per table, trainer peak {probes[-1]['peak_mib']} MiB", flush=True)
            if peak is None or peak > budget:
                break
            largest, rows = rows, rows * 2
        results[name] = {
            "largest_rows_per_table": largest,
            "table_bytes_at_largest": None if largest is None else largest * NUM_TABLES * args.embedding_dim * 4,
            "reached_max_rows": largest == args.max_rows,
            "probes": probes,
        }
    return results


def run(args: argparse.Namespace) -> None:
    if args.probe_rows is not None:
        _probe(args)
        return
    if args.job is not None:
        _job(args.job)
        return
    if args.links is not None:
        try:
            args.links = parse_links(args.links, 2)
            check_hosts()
        except (ValueError, HostsUnavailable) as error:
            raise SystemExit(f"dynamix bench offload: --links (TRAINER,SERVER): {error}") from None
    result: dict[str, Any] = {
        "benchmark": "offload",
        "config": arguments_record(args),
        "machine": machine_description(),
    }
    if not args.skip_speed:
        result["speed"] = _speed(args)
    device = "CPU" if args.accelerator == "cpu" else args.accelerator.upper()
    hosted = "" if args.links is None else f"; trainer and servers on {describe_links(args.links)} (trainer, servers)"
    print(f"\ndynamix bench offload: DLRM, {NUM_TABLES} tables, batch {args.batch_size}, 1 trainer ({device}){hosted}")
    print(f"{'set-up':>32}  {'ms/step':>8}  {'samples/s':>9}  {'vs in-process':>13}")
    for name, row in result.get("speed", {}).items():
        print(
            f"{name:>32}  {row['median_step_ms']:>8.2f}  {row['samples_per_s']:>9.0f}"
            f"  {row['step_time_vs_in_process']:>13.2f}"
        )
    if not args.skip_memory:
        result["memory"] = _memory(args)
        print(f"\nlargest rows per table within {args.memory_budget_mib} MiB of trainer memory:")
        for name, row in result["memory"].items():
            cap = " (the largest probed)" if row["reached_max_rows"] else ""
            print(f"{name:>10}: {row['largest_rows_per_table']}{cap}")
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2))


def main(argv: list[str] | None = None) -> None:
    """``python -m lightning_dynamix.bench.offload [options]``: ``dynamix bench offload`` without the command's
    other dependencies."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dynamix.bench.offload", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
