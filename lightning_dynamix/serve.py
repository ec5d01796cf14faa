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
import os
import sys
import time
from collections.abc import Sequence

import torch.distributed
import torch.distributed.rpc as rpc

from lightning_dynamix.offload.server import (
    DEFAULT_TIMEOUT_S,
    EmbeddingServer,
    install,
    parse_address,
    rpc_options,
    server_name,
)

_REPLY_GRACE_S = 0.5


def run_server(
    address: str,
    server_rank: int,
    num_servers: int,
    num_trainers: int,
    staleness: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    parent_pid: int | None = None,
) -> int:
    """Serve until every trainer has finished; the process's exit status (0 when they did)."""
    server = EmbeddingServer(server_rank, num_servers, num_trainers, staleness)
    done = install(server)
    try:
        rpc.init_rpc(
            server_name(server_rank),
            rank=num_trainers + server_rank,
            world_size=num_trainers + num_servers,
            rpc_backend_options=rpc_options(address, timeout_s),
        )
    except torch.distributed.DistError as error:  # the store timed out, or no trainer listened at the address
        print(
            f"{server_name(server_rank)}: the job's {num_trainers} trainer(s) and {num_servers} server(s) did not"
            f" all meet at {address} within --timeout {timeout_s:g} s ({error})",
            file=sys.stderr,
        )
        return 1
    while not done.wait(1.0):
        if parent_pid is not None and os.getppid() != parent_pid:  # re-parented: the starter died
            name = server_name(server_rank)
            print(f"{name}: the trainer that started it (pid {parent_pid}) is gone", file=sys.stderr)
            rpc.shutdown(graceful=False)
            return 1
        idle = time.monotonic() - server.last_request
        if idle > timeout_s:
            print(f"{server_name(server_rank)}: no request from the trainers for {idle:.0f} s", file=sys.stderr)
            rpc.shutdown(graceful=False)
            return 1
    time.sleep(_REPLY_GRACE_S)  # let the answer to the last trainer's `finish` leave
    rpc.shutdown(graceful=False)  # every trainer has finished: nothing else is in flight
    return 0


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


# A server needs torch and lightning_dynamix.offload only, but importing any module of the package runs its
# __init__, which imports Lightning for the trainers (2 s of a server's 3 s start on the 2-core VM). The
# servers a strategy launches import this module beneath a bare stand-in for the package instead.
_BOOTSTRAP = (
    "import importlib.util, runpy, sys, types\n"
    "package = types.ModuleType('lightning_dynamix')\n"
    "package.__path__ = list(importlib.util.find_spec('lightning_dynamix').submodule_search_locations)\n"
    "sys.modules['lightning_dynamix'] = package\n"
    "runpy.run_module('lightning_dynamix.serve', run_name='__main__', alter_sys=True)\n"
)


def server_command(*args: str) -> list[str]:
    """The command that starts a server as ``python -m lightning_dynamix.serve ARGS`` does, without importing
    Lightning (it starts in about 1 s instead of 3)."""
    return [sys.executable, "-c", _BOOTSTRAP, *args]


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
