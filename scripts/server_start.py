"""How long an embedding server takes to start, as a new Python and forked by the launcher.

The figures of docs/benchmarks/layer_offload.md, "A server's start".

    .venv/bin/python scripts/server_start.py [--rounds N]

Each round starts a server with ``--help`` (which imports everything a server runs, then exits) both ways, one
after the other; the first forked start includes the launcher's own.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

from lightning_dynamix.offload.server_launcher import launch
from lightning_dynamix.offload.server_process import server_command, server_environment


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each starting a server both ways (default 5)")
    return parser


def main() -> None:
    rounds = build_parser().parse_args().rounds
    quiet, shown = os.open(os.devnull, os.O_WRONLY), os.dup(1)  # a forked server prints its --help to this stdout
    for round_ in range(rounds):
        began = time.perf_counter()
        subprocess.run(server_command("--help"), env=server_environment(), stdout=subprocess.DEVNULL, check=True)
        new = time.perf_counter() - began
        os.dup2(quiet, 1)
        try:
            began = time.perf_counter()
            status = launch(["--help"], server_environment()).wait()
            forked = time.perf_counter() - began
        finally:
            os.dup2(shown, 1)
        assert status == 0, f"a forked server's --help exited with {status}"
        print(f"round {round_}: a new Python {new:.2f} s, forked by the launcher {forked:.3f} s")


if __name__ == "__main__":
    main()
