"""``dynamix bench hook``: the weighted all-reduce hook against DDP's built-in reduction, interleaved per iteration."""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from lightning_dynamix import WeightedAllReduceState, weighted_allreduce_hook
from lightning_dynamix.bench.overhead import NUM_CLASSES, add_job_arguments, network_name
from lightning_dynamix.bench.records import arguments_record, machine_description
from lightning_dynamix.data.synthetic import make_mlp
from lightning_dynamix.distributed import free_port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``dynamix bench hook``."""
    add_job_arguments(parser)
    parser.add_argument("--iterations", type=int, default=400, help="timed iterations per variant (default 400)")


# the built-in reduction twice: the difference between the two is the noise floor of the measurement
_HOOK_VARIANTS = ("ddp built-in", "ddp built-in, again", "weighted hook, weight 1", "weighted hook, weight 0.5")


def _hook_worker(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.devices)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    network = make_mlp(args.features, args.hidden, NUM_CLASSES)
    models = [DistributedDataParallel(copy.deepcopy(network)) for _ in _HOOK_VARIANTS]
    models[2].register_comm_hook(WeightedAllReduceState(weight=1.0), weighted_allreduce_hook)
    models[3].register_comm_hook(WeightedAllReduceState(weight=0.5), weighted_allreduce_hook)
    x, y = torch.randn(args.batch_size, args.features), torch.randint(NUM_CLASSES, (args.batch_size,))
    times: list[list[float]] = [[] for _ in models]
    warmup = 20
    shuffler = random.Random(0)  # the same order on every rank: the all-reduces must match up
    order = list(range(len(models)))
    for iteration in range(warmup + args.iterations):
        shuffler.shuffle(order)  # a new order every iteration: no variant always follows another
        for index in order:
            start = time.perf_counter()
            F.cross_entropy(models[index](x), y).backward()
            if iteration >= warmup:
                times[index].append(time.perf_counter() - start)
    if rank == 0:
        queue.put([statistics.median(t) for t in times])
    # Drop the DDP models while the process group is still registered. Otherwise a reducer can
    # hold the group's last reference, and its destructor joins gloo's worker threads with the
    # GIL held while one of them needs the GIL to free its finished work: a hang at exit.
    del models
    dist.barrier()
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    """Forward + backward with DDP's built-in reduction against the weighted hook, interleaved."""
    port = free_port()
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.start_processes(_hook_worker, args=(args, port, queue), nprocs=args.devices, start_method="spawn")
    medians = queue.get()
    base = medians[0]
    result = {
        "benchmark": "hook",
        "median_ms": {name: 1e3 * m for name, m in zip(_HOOK_VARIANTS, medians)},
        "ratio_to_builtin": {name: m / base for name, m in zip(_HOOK_VARIANTS, medians)},
        "config": arguments_record(args),
        "machine": machine_description(),
    }
    print(
        f"\ndynamix bench hook: {args.devices} processes (gloo, CPU), forward + backward of an"
        f" {network_name(args)}, batch {args.batch_size}, {args.iterations} iterations"
        " per variant in random interleaved order"
    )
    for name, median in zip(_HOOK_VARIANTS, medians):
        print(f"{name:>26}: {1e3 * median:8.3f} ms  ({median / base:.4f} of the built-in reduction)")
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2))
