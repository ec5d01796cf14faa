"""How the CLI tests run the ``dynamix`` command: as a user runs it (a process of its own), or in the test's own."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

from lightning_dynamix.distributed import job_environment
from tests import forkserver

# imported once, by the fork server: the package (torch, Lightning) and the run harness most commands use; a command
# imports the rest itself (`lightning_dynamix.cli.main` is left out: runpy runs it anew as __main__)
PRELOAD = ("lightning_dynamix.bench.harness", "lightning_dynamix.cli.demo", "lightning_dynamix.bench.balance")


def dynamix(*args: str, cwd: Path) -> str:
    return dynamix_with_pid(*args, cwd=cwd)[0]


def dynamix_fails(*args: str, cwd: Path, timeout: float = 120) -> str:
    """``dynamix ARGS`` run as :func:`dynamix` runs it, which must exit with an error: its output."""
    done = _forked(args, cwd, timeout)
    assert done.returncode != 0, done.output[-6000:]
    return done.output


def dynamix_with_pid(*args: str, cwd: Path, timeout: float = 300) -> tuple[str, int]:
    """``dynamix ARGS`` run to its end in a process of its own (it must succeed): its output, stdout and stderr
    together, and its process id (the hosts it made are named after it:
    ``lightning_dynamix.bench.hosts.leftovers(prefix=f"dx{pid}n")``)."""
    done = _forked(args, cwd, timeout)
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.output[-6000:]}"
    return done.output, done.pid


def _forked(args: tuple[str, ...], cwd: Path, timeout: float) -> forkserver.Completed:
    """``python -m lightning_dynamix.cli.main ARGS`` forked from a Python that has imported torch and Lightning
    (:mod:`tests.forkserver`; a new Python takes 3.4 s of a core to), run to its end."""
    return forkserver.run_module("lightning_dynamix.cli.main", list(args), cwd, job_environment(), timeout, PRELOAD)


def dynamix_here(*args: str, cwd: Path, fails: bool = False) -> str:
    """``dynamix ARGS`` run in this process, for commands that start no process and leave no state behind
    (a new Python takes 3 s to import torch and Lightning); its output, stdout and stderr together. With
    ``fails`` it must exit with an error (whose message is in the output), else it must not."""
    from lightning_dynamix.cli.main import main

    out = io.StringIO()
    code: int | str | None = 0
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main(list(args))
        except SystemExit as exit:
            code = exit.code
            if isinstance(code, str):  # what Python prints of an uncaught SystemExit("message")
                print(code, file=sys.stderr)
    output = out.getvalue()
    assert (code not in (0, None)) == fails, f"exit code {code!r}\n{output[-6000:]}"
    return output
