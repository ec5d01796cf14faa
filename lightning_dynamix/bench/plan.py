"""``dynamix bench plan``: a placement plan's predicted throughput against the plan run with LayerOffloadStrategy.

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/bench/plan.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer

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
from lightning_dynamix.data import CTRDataModule
from lightning_dynamix.data.dlrm import DLRM
from lightning_dynamix.placement import CostModel, PlacementPlan, ResourceType, profile_model
from lightning_dynamix.placement.profile import DEFAULT_REPEATS
from lightning_dynamix.strategies import LayerOffloadStrategy
from lightning_dynamix.strategies.layer_offload import profile_runner, threads_beside_servers

GIB = 2**30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=512, help="samples per step (default 512)")
    parser.add_argument("--servers", default="1,2", help="numbers of embedding servers to plan for (default 1,2)")
    parser.add_argument("--rounds", type=int, default=2, help="training runs per plan and staleness (default 2)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run (default 40)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps at the start of each run (default 10)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=f"timed samples per layer when profiling (default {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--accelerator", choices=("cpu", "gpu"), default="cpu", help="the trainer's device (default cpu)"
    )
    parser.add_argument("--no-runner", action="store_true", help="plan the layers alone, without the runner's terms")
    parser.add_argument(
        "--links",
        default=None,
        help="the trainer and each server on a host of its own (network namespaces, needs root), on links of these"
        " rates in Mbit/s: TRAINER,SERVER (0 or -: no limit), every server at the second; the catalogue gives the"
        " types these rates (default: all on this machine's loopback)",
    )
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)  # one measurement, on the trainer's host


def loopback_bandwidth(total_bytes: int = 64 * 2**20, chunk: int = 2**20) -> float:
    """Bytes/s through a local TCP connection (what the servers' requests travel on here)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        received = 0

        def receive() -> None:
            nonlocal received
            connection, _ = server.accept()
            with connection:
                while received < total_bytes:
                    data = connection.recv(chunk)
                    if not data:
                        break
                    received += len(data)

        reader = threading.Thread(target=receive)
        reader.start()
        payload = bytes(chunk)
        with socket.create_connection(("127.0.0.1", port)) as sender:
            start = time.perf_counter()
            for _ in range(total_bytes // chunk):
                sender.sendall(payload)
            reader.join()
            return received / (time.perf_counter() - start)


def _resources(
    profile: Any, servers: int, bandwidth: tuple[float, float], trainer_device: str, spare_cores: int
) -> list[ResourceType]:
    """The catalogue of this machine: ``bandwidth`` is the trainer's and the servers' links, bytes/s."""
    trainer_link, server_link = bandwidth
    copies = 3  # the cost model's parameter_copies
    dense = sum(layer.parameter_bytes for layer in profile.layers if layer.kind == "dense")
    sparse = sum(layer.parameter_bytes for layer in profile.layers if layer.kind == "sparse")
    speed = {"dense": 1.0, "sparse": 1.0}  # this machine's CPU cores, and its GPU for a gpu trainer
    # the servers share the cores the trainer leaves: a server with less than a core of its own is slower
    share = min(1.0, max(spare_cores, 1) / servers)
    return [
        # memory for a 1/(servers - 0.5) share of the tables: the plan needs exactly `servers` of them
        ResourceType("embedding-server", "cpu", 1.0, servers, math.ceil(copies * sparse / (servers - 0.5)),
                     server_link, {"dense": share, "sparse": share}),
        ResourceType("trainer", trainer_device, 1.0, 1, 2 * copies * dense, trainer_link, speed),
    ]  # fmt: skip


class _LookupRequests(Callback):
    """The trainer's count of lookup requests after every step."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.counts.append(trainer.strategy.client.lookup_requests)


def _measure(
    plan: PlacementPlan,
    args: argparse.Namespace,
    seed: int,
    threads: int,
    staleness: int,
    hosts: Hosts | None = None,
) -> tuple[float, float]:
    """The median step's seconds, and the lookup requests per step after the warm-up (on ``hosts`` where given:
    the trainer on host 0, server ``k`` on host ``k + 1``)."""
    if hosts is not None:
        return _measure_on_hosts(plan, args, seed, threads, staleness, hosts)
    return _measure_here(plan, args, seed, threads, staleness)


def _measure_on_hosts(
    plan: PlacementPlan, args: argparse.Namespace, seed: int, threads: int, staleness: int, hosts: Hosts
) -> tuple[float, float]:
    """:func:`_measure` with the trainer a process on host 0 and each server one on a host of its own."""
    spec = {
        "plan": plan.to_dict(),
        "args": {name: getattr(args, name) for name in ("batch_size", "steps", "warmup", "accelerator")},
        "seed": seed,
        "threads": threads,
        "staleness": staleness,
    }
    module, servers = "lightning_dynamix.bench.plan", plan.embedding_servers()
    measured = offload_job_result(hosts, module, spec, servers, staleness, "dynamix bench plan")
    return measured["step_seconds"], measured["requests_per_step"]


def _measure_job(text: str) -> None:
    """``--job``: one measurement in this process (on the trainer's host), the servers started by the caller."""
    spec = json.loads(text)
    args = argparse.Namespace(**spec["args"])
    plan = PlacementPlan.from_dict(spec["plan"])
    step, requests = _measure_here(
        plan, args, spec["seed"], spec["threads"], spec["staleness"], server_port=SERVER_PORT
    )
    Path(spec["output"]).write_text(json.dumps({"step_seconds": step, "requests_per_step": requests}))


def _measure_here(
    plan: PlacementPlan,
    args: argparse.Namespace,
    seed: int,
    threads: int,
    staleness: int,
    server_port: int | None = None,
) -> tuple[float, float]:
    """The measurement in this process; with ``server_port`` the servers are started elsewhere and meet it there."""
    samples = args.batch_size * (args.steps + args.warmup + 1)
    data = CTRDataModule(num_samples=samples, num_val_samples=1, batch_size=args.batch_size)
    model = DLRM(table_sizes=data.spec.table_sizes, seed=seed, meta_embeddings=True)
    timer, requests = StepTimer(warmup=args.warmup), _LookupRequests()
    strategy = LayerOffloadStrategy(
        offload=plan,
        return_embeddings=False,
        trainer_threads=threads,
        staleness=staleness,
        launch_servers=server_port is None,
        server_port=server_port,
    )
    trainer = timed_trainer(strategy, args.steps + args.warmup + 1, [timer, requests], args.accelerator)
    trainer.fit(model, datamodule=data)
    # a step's count includes the lookup of the batch read ahead, and the last step has none to read:
    # the steps between the warm-up and the last one, whatever the depth, count one step's requests each
    counts = requests.counts[args.warmup : -1]
    return timer.timings[0].median_step_seconds, (counts[-1] - counts[0]) / max(len(counts) - 1, 1)


def _measured_round(
    plan: Any, args: argparse.Namespace, threads: int, hosts: Any, lookups: list[float], staleness: int, index: int
) -> float:
    """One round's step of ``plan`` run at ``staleness`` (seconds); its lookups per step appended to ``lookups``."""
    step, requests = _measure(plan, args, index, threads, staleness, hosts)
    lookups.append(requests)
    servers = plan.embedding_servers()
    print(f"{servers} server(s), staleness {staleness}, round {index}: {1e3 * step:.2f} ms/step", flush=True)
    return step


def run(args: argparse.Namespace) -> None:
    if args.job is not None:
        _measure_job(args.job)
        return
    links: list[float | None] | None = None
    if args.links is not None:
        try:
            links = parse_links(args.links, 2)
            check_hosts()
        except (ValueError, HostsUnavailable) as error:
            raise SystemExit(f"dynamix bench plan: --links (TRAINER,SERVER): {error}") from None
    counts = [int(n) for n in args.servers.split(",")]
    if not counts or min(counts) < 1:
        raise SystemExit(f"dynamix bench plan: `--servers` must list ints >= 1, got {args.servers!r}")
    data = CTRDataModule(batch_size=args.batch_size)
    data.setup("fit")
    model = DLRM(table_sizes=data.spec.table_sizes)
    # the trainer's resource type, and the device its layers are profiled on
    trainer_device, trainer_profile = ("cpu", "cpu") if args.accelerator == "cpu" else ("gpu", "cuda")
    devices = sorted({"cpu", trainer_profile})
    # the trainer's threads, profiled as it will train: the strategy leaves a core to each server it launches
    threads = threads_beside_servers(max(counts))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        loader = data.train_dataloader()
        profile = profile_model(model, next(iter(loader)), devices=devices, repeats=args.repeats)
        if not args.no_runner:
            profile = profile.with_runner(profile_runner(model, loader, trainer_threads=threads))
    finally:
        torch.set_num_threads(before)
    bandwidth = loopback_bandwidth()
    # each type's link: its host's rate where --links gives one, else the loopback's
    rates = links or [None, None]
    link_bandwidth = tuple(bandwidth if rate is None else rate * 1e6 / 8 for rate in rates)
    tables = [index for index, layer in enumerate(profile.layers) if layer.kind == "sparse"]
    sparse_ms = sum(profile.layers[i].seconds["cpu"] for i in tables) * args.batch_size * 1e3
    dense_ms = sum(layer.seconds[trainer_profile] for layer in profile.layers if layer.kind == "dense")
    dense_ms *= args.batch_size * 1e3
    result: dict[str, Any] = {
        "benchmark": "plan",
        "config": arguments_record(args),
        "machine": machine_description(),
        "loopback_bytes_per_s": bandwidth,
        "links_mbit_per_s": links,
        "link_bytes_per_s": {"trainer": link_bandwidth[0], "embedding-server": link_bandwidth[1]},
        "trainer_threads": threads,
        "runner": None if profile.runner is None else profile.runner.to_dict(),
        "profile": {
            "tables_ms_per_batch": sparse_ms,
            "dense_layers_ms_per_batch": dense_ms,
            "unattributed_ms_per_batch": profile.unattributed_seconds(trainer_profile) * args.batch_size * 1e3,
            "whole_pass_ms_per_batch": profile.step_seconds[trainer_profile] * args.batch_size * 1e3,
        },
        "plans": {},
    }
    for servers in counts:
        spare = len(os.sched_getaffinity(0)) - threads if args.accelerator == "cpu" else len(os.sched_getaffinity(0))
        resources = _resources(profile, servers, link_bandwidth, trainer_device, spare)
        cost = CostModel(profile, resources, target_throughput=1.0)
        plan = cost.plan([0 if index in tables else 1 for index in range(len(profile.layers))], solver="fixed")
        if plan is None or plan.embedding_servers() != servers:
            raise SystemExit(f"dynamix bench plan: the plan for {servers} servers came out as {plan}")
        lookups = []
        # on hosts: the trainer on the first, each server on one more
        on_hosts = Hosts([rates[0]] + [rates[1]] * servers) if links is not None else contextlib.nullcontext()
        with on_hosts as hosts:
            measure = functools.partial(_measured_round, plan, args, threads, hosts, lookups)
            steps = interleaved_rounds([0, 1], args.rounds, measure)
        measured = {staleness: args.batch_size / statistics.median(values) for staleness, values in steps.items()}
        result["plans"][str(servers)] = {
            "plan": plan.to_dict(),
            "predicted_pipelined_samples_per_s": plan.throughput,
            "predicted_sequential_samples_per_s": plan.sequential_throughput,
            # staleness 0: a lookup waits for the update before it, the stages run one after another
            "measured_samples_per_s": measured[0],
            "measured_over_sequential": measured[0] / plan.sequential_throughput,
            "measured_step_ms_per_round": [1e3 * s for s in steps[0]],
            # staleness 1 with read-ahead: the servers' work overlaps the trainer's, as a pipeline
            "measured_staleness_1_samples_per_s": measured[1],
            "measured_staleness_1_over_pipelined": measured[1] / plan.throughput,
            "measured_staleness_1_step_ms_per_round": [1e3 * s for s in steps[1]],
            "unmodelled_ms_per_step": 1e3 * args.batch_size * (1 / measured[0] - 1 / plan.sequential_throughput),
            # lookups counted by the trainer, and one push per server
            "requests_per_step": statistics.mean(lookups) + servers,
        }
    print(
        f"\ndynamix bench plan: DLRM, {len(tables)} tables, batch {args.batch_size},"
        f" 1 trainer ({args.accelerator.upper()}), servers on the CPU;"
        f" profile per batch: tables {sparse_ms:.2f} ms, dense layers {dense_ms:.2f} ms,"
        f" unattributed {result['profile']['unattributed_ms_per_batch']:.2f} ms;"
        f" loopback {bandwidth / 1e9:.2f} GB/s; trainer threads {threads}"
        + ("" if links is None else f"; trainer and servers on {describe_links(links)} (trainer, servers)")
    )
    if profile.runner is not None:
        print(f"runner per step: {profile.runner.summary()}")
    print(
        f"{'servers':>7}  {'sequential':>10}  {'staleness 0':>11}  {'meas/pred':>9}"
        f"  {'pipelined':>10}  {'staleness 1':>11}  {'meas/pred':>9}  {'requests/step':>13}"
    )
    for servers, row in result["plans"].items():
        print(
            f"{servers:>7}  {row['predicted_sequential_samples_per_s']:>10.0f}  {row['measured_samples_per_s']:>11.0f}"
            f"  {row['measured_over_sequential']:>9.3f}  {row['predicted_pipelined_samples_per_s']:>10.0f}"
            f"  {row['measured_staleness_1_samples_per_s']:>11.0f}  {row['measured_staleness_1_over_pipelined']:>9.3f}"
            f"  {row['requests_per_step']:>13g}"
        )
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2))


def main(argv: list[str] | None = None) -> None:
    """``python -m lightning_dynamix.bench.plan``: the bench without the ``dynamix`` command's other dependencies
    (and how a measurement starts on the trainer's host)."""
    parser = argparse.ArgumentParser(prog="python -m lightning_dynamix.bench.plan", description=__doc__.split("\n")[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
