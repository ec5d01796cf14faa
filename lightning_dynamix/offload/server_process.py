"""One embedding server's process: serve until every trainer has finished (:func:`run_server`, what ``python -m
lightning_dynamix.serve`` runs), and the command a strategy starts one with (:func:`server_command`)."""

from __future__ import annotations

import os
import sys
import time

import torch.distributed
import torch.distributed.rpc as rpc

from lightning_dynamix.distributed.launching import job_environment
from lightning_dynamix.offload.embedding_server import (
    DEFAULT_TIMEOUT_S,
    EmbeddingServer,
    install,
    listening_toward,
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
        with listening_toward(address):  # on the network the trainers reach it through, not its host name's
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


# A server needs torch and lightning_dynamix.offload only, but importing any module of the package runs its
# __init__, which imports Lightning for the trainers (most of a server's start: docs/benchmarks/layer_offload.md).
# The servers a strategy launches, and their launcher, run beneath a bare stand-in for the package instead.
def server_environment() -> dict[str, str]:
    """The environment of a server this process starts: its own, without the variables of a job's rank (the
    server must not read the trainers' as its own), with no CUDA device and one intra-op thread."""
    env = job_environment()
    env["CUDA_VISIBLE_DEVICES"] = ""  # servers are CPU processes
    env["OMP_NUM_THREADS"] = "1"
    # torch's RPC warns of every connection closed without its graceful shutdown ("encountered error"), on
    # both ends, though nothing failed (docs/troubleshooting.md): a server's C++ side logs errors only
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


def bootstrap(module: str) -> str:
    """Python code (for ``python -c``) that runs ``module`` as ``python -m module`` does, beneath a bare stand-in
    for the package: none of its ``__init__``'s imports, Lightning's among them."""
    return (
        "import importlib.util, runpy, sys, types\n"
        "package = types.ModuleType('lightning_dynamix')\n"
        "package.__path__ = list(importlib.util.find_spec('lightning_dynamix').submodule_search_locations)\n"
        "sys.modules['lightning_dynamix'] = package\n"
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    )


_BOOTSTRAP = bootstrap("lightning_dynamix.serve")


def server_command(*args: str) -> list[str]:
    """The command that starts a server as ``python -m lightning_dynamix.serve ARGS`` does, without importing
    Lightning (it starts in about 1 s instead of 3)."""
    return [sys.executable, "-c", _BOOTSTRAP, *args]
