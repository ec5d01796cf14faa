"""What a process gives the processes it starts: a port to meet at, and an environment without its own job's ranks."""

from __future__ import annotations

import os
import socket

JOB_VARIABLES = (
    "LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "LOCAL_WORLD_SIZE",
)  # fmt: skip
"""What Lightning or a launcher leaves in a process's environment about the job it runs in."""


def free_port() -> int:
    """A TCP port that no socket of this machine is bound to now, on any of its addresses.

    The port is free when asked; a process that binds it later may find it taken by another in between
    (the window is short, and a rendezvous that fails says so).
    """
    with socket.socket() as probe:
        probe.bind(("", 0))  # every address: a port free there is free on loopback too
        return probe.getsockname()[1]


def job_environment(**extra: str) -> dict[str, str]:
    """This process's environment for a process that is no rank of its job (a job of its own, an embedding server):
    none of :data:`JOB_VARIABLES` (a Trainer that ran here leaves them), output unbuffered, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env
