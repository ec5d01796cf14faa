"""Run one embedding server of a layer-offload job: ``python -m lightning_dynamix.serve``.

On one machine :class:`~lightning_dynamix.strategies.LayerOffloadStrategy` starts its servers
itself. On a cluster, start one of these per server, on any machines, with the address the trainers
will use (the machine of trainer rank 0 and the strategy's ``server_port``)::

    python -m lightning_dynamix.serve --address 10.0.0.1:29600 \\
        --server-rank 0 --num-servers 2 --num-trainers 8

The server joins the job's ``torch.distributed.rpc`` group, creates its shards when the trainers
set up, serves lookups and updates, and exits once every trainer has finished. It exits with an
error when the trainers stay silent for ``--timeout`` seconds (a job that died), or, when started
by a trainer, as soon as that trainer's process is gone.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_dynamix.offload.embedding_server import DEFAULT_TIMEOUT_S, EmbeddingServer, parse_address
from lightning_dynamix.offload.server_process import run_server


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m lightning_dynamix.serve``."""
    parser = argparse.ArgumentParser(prog="python -m lightning_dynamix.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", required=True, type=parse_address, help="HOST:PORT of the job's rendezvous")
    parser.add_argument("--server-rank", required=True, type=int, help="this server, 0 .. num-servers - 1")
    parser.add_argument("--num-servers", required=True, type=int, help="embedding servers of the job")
    parser.add_argument("--num-trainers", required=True, type=int, help="trainer ranks of the job (all nodes)")
    parser.add_argument("--staleness", type=int, default=0, help="the strategy's staleness (default 0)")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds without a request before giving up"
    )
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        EmbeddingServer(args.server_rank, args.num_servers, args.num_trainers, args.staleness)
    except ValueError as error:
        parser.error(str(error))
    return run_server(
        args.address,
        args.server_rank,
        args.num_servers,
        args.num_trainers,
        args.staleness,
        args.timeout,
        args.parent_pid,
    )


if __name__ == "__main__":
    sys.exit(main())
