"""The embedding servers of a fit: where trainers and servers meet, the server processes, the RPC group.

Servers and trainers meet over ``torch.distributed.rpc`` at an address on trainer 0's machine
(:func:`meeting_address`). On one machine trainer 0 starts the servers (:func:`launch_server`), and stops
them at the end (:func:`stop_servers`); on a cluster they are started with ``python -m
lightning_dynamix.serve``. Every trainer joins the group (:func:`join_servers`) and leaves it
(:func:`leave_servers`) once the servers have nothing left to do.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed.rpc as rpc

from lightning_dynamix import _compat
from lightning_dynamix.distributed import free_port
from lightning_dynamix.offload import server_launcher
from lightning_dynamix.offload.embedding_server import listening_toward, parse_address, rpc_options, trainer_name
from lightning_dynamix.offload.server_launcher import LaunchedServer
from lightning_dynamix.offload.server_process import server_command, server_environment

if TYPE_CHECKING:
    from lightning_dynamix.strategies.layer_offload.embedding_offload import OffloadingStrategy

SERVER_EXIT_WAIT_S = 30.0  # seconds a server has to exit on its own at the end of a fit before it is killed


def threads_beside_servers(servers: int, trainers: int = 1) -> int:
    """torch's intra-op threads for each of ``trainers`` trainer processes on a machine that also runs
    ``servers`` embedding servers: its cores less one per server, shared (at least 1, and never more
    than this process has now). What ``LayerOffloadStrategy(trainer_threads=None)`` sets there."""
    cores = len(os.sched_getaffinity(0))
    return min(torch.get_num_threads(), max(1, (cores - servers) // trainers))


def meeting_address(strategy: OffloadingStrategy, server_port: int | None) -> str:
    """``HOST:PORT`` where ``strategy``'s trainers and their servers meet: its main address (loopback without a
    cluster environment) and ``server_port``, or a port free on trainer 0's machine, which every trainer is told
    (a collective where ``server_port`` is None)."""
    environment = strategy.cluster_environment
    host = environment.main_address if environment is not None else "127.0.0.1"
    port = server_port
    if port is None:
        port = strategy.broadcast(free_port() if strategy.is_global_zero else None, src=0)
    return parse_address(f"{host}:{port}")


def launch_server(
    address: str, server: int, num_servers: int, num_trainers: int, staleness: int, timeout_s: float
) -> subprocess.Popen | LaunchedServer:
    """Start embedding server ``server`` of ``num_servers`` as a CPU process of this machine, to meet the
    trainers at ``address``; it exits with this process (``timeout_s``: seconds any wait of it may take).

    On Linux it is forked by this process's server launcher (:mod:`lightning_dynamix.offload.server_launcher`),
    which imported torch once for every server this process starts; elsewhere it is a new Python.
    """
    env = server_environment()
    args = [
        "--address",
        address,
        "--server-rank",
        str(server),
        "--num-servers",
        str(num_servers),
        "--num-trainers",
        str(num_trainers),
        "--staleness",
        str(staleness),
        "--timeout",
        str(timeout_s),
    ]
    if sys.platform == "linux":
        return server_launcher.launch(args, env)
    return subprocess.Popen(server_command(*args, "--parent-pid", str(os.getpid())), env=env)


def join_servers(
    trainer_rank: int, num_trainers: int, num_servers: int, address: str, timeout_s: float, launched: bool
) -> None:
    """Join the RPC group of the job's ``num_trainers`` trainers and ``num_servers`` servers at ``address``.

    Raises:
        RuntimeError: when they do not all meet within ``timeout_s`` seconds, with how to start servers that
            were not ``launched`` by the strategy.
    """
    # torch.distributed.rpc numbers, per process, its rendezvous keys (by init_rpc calls) and its
    # all-gathers (by the set of worker names). The servers are new processes at every fit, so a
    # trainer's second fit would wait for keys and sequence numbers they never write. The earlier
    # group is shut down and each fit meets at a store of its own: counting from zero is safe.
    _compat.reset_rpc_counters()
    try:
        with listening_toward(address):  # the servers reach it on the network of the meeting address
            rpc.init_rpc(
                trainer_name(trainer_rank),
                rank=trainer_rank,
                world_size=num_trainers + num_servers,
                rpc_backend_options=rpc_options(address, timeout_s),
            )
    except torch.distributed.DistError as error:  # the store timed out, or the address was not there
        if launched:
            hint = "a server this strategy started may have failed as it started (its output is above)"
        else:
            hint = (
                f"start them with `python -m lightning_dynamix.serve --address {address} --server-rank S"
                f" --num-servers {num_servers} --num-trainers {num_trainers}`, S from 0 to"
                f" {num_servers - 1}, or pass the `server_port` they were given"
            )
        raise RuntimeError(
            f"{trainer_name(trainer_rank)}: the job's {num_servers} embedding server(s) and"
            f" {num_trainers} trainer(s) did not all meet at {address} within the strategy's timeout of"
            f" {timeout_s:g} s: {hint} ({error})"
        ) from error


def leave_servers() -> None:
    """Leave the RPC group, once every trainer agreed that nothing is in flight (or the fit failed)."""
    # Not rpc's graceful shutdown: its barrier counts shutdowns per process, so a trainer's
    # second fit would never meet the new servers there. The trainers' `finish` is the agreement
    # that nothing is in flight (the servers wait for every trainer's).
    rpc.shutdown(graceful=False)


def stop_servers(servers: Sequence[subprocess.Popen | LaunchedServer], finished: bool, failed: bool) -> None:
    """Stop the server processes this trainer launched, and reap them.

    Args:
        servers: the processes.
        finished: every trainer was answered at the end of the fit: the servers have nothing left to do.
        failed: the fit failed: a server that does not exit at once is killed.
    """
    for server in servers:
        if finished:
            # Nothing is left for them to do: on their own they would wait a grace period for the last
            # answer to leave (they cannot know it arrived), then shut down; the trainers know.
            server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=0 if failed else SERVER_EXIT_WAIT_S)
        if server.poll() is None:
            server.kill()
            server.wait()
