"""A port for a process group or an RPC group to meet at."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port that no socket of this machine is bound to now, on any of its addresses.

    The port is free when asked; a process that binds it later may find it taken by another in between
    (the window is short, and a rendezvous that fails says so).
    """
    with socket.socket() as probe:
        probe.bind(("", 0))  # every address: a port free there is free on loopback too
        return probe.getsockname()[1]
