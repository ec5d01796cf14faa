"""What comparing arrivals costs at an interval's gather, on gloo processes of this machine.

The figures of docs/benchmarks/sharded.md, "What comparing arrivals costs".

    .venv/bin/python scripts/arrivals_cost.py [--launches N] [--repeats N]

Each launch starts 2 gloo processes that repeat what ``IntervalMeter`` adds to a gather when every rank reports
collectives inside its steps: three stamped all-gathers of one number (the clocks put on one line), one
``all_gather_object`` of 5 steps of 18 collectives (the ResNet with global BatchNorm), and the comparison. Rank 0
prints the median time a gather (and its spread), and a round's length, half of whose least bounds the offsets'
error.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_dynamix.distributed import free_port, gather_floats
from lightning_dynamix.metrics.arrivals import clock_offsets, own_time_inside

WARMUP = 20


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=3, help="launches of 2 processes, one after the other")
    parser.add_argument("--repeats", type=int, default=200, help="timed gathers per launch (default 200)")
    return parser


def _rank(rank: int, port: int, repeats: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    spans = [[(float(i), float(i) + 0.001) for i in range(18)] for _ in range(5)]
    totals, rounds = [], []
    for _ in range(WARMUP + repeats):
        start = time.perf_counter()
        stamped = []
        for _ in range(3):
            before = time.perf_counter()
            gather_floats([0.0])
            stamped.append((before, time.perf_counter()))
        everyone: list = [None, None]
        dist.all_gather_object(everyone, (stamped, spans))
        own_time_inside([steps for _, steps in everyone], clock_offsets([r for r, _ in everyone]))
        totals.append(time.perf_counter() - start)
        rounds += [after - before for before, after in stamped]
    if rank == 0:
        timed = totals[WARMUP:]
        print(
            f"a gather's arrivals: median {1e3 * statistics.median(timed):.2f} ms ({1e3 * min(timed):.2f}-"
            f"{1e3 * max(timed):.2f}); a round: median {1e6 * statistics.median(rounds):.0f} us, least"
            f" {1e6 * min(rounds):.0f} us"
        )
    dist.destroy_process_group()


def main() -> None:
    args = build_parser().parse_args()
    for _ in range(args.launches):
        mp.start_processes(_rank, args=(free_port(), args.repeats), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
