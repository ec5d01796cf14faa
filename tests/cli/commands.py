"""How the CLI tests run the ``dynamix`` command: as a user runs it (a new process), or in the test's own."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

from lightning_dynamix.distributed import job_environment


def run(args: list[str], cwd: Path, timeout: float = 300) -> str:
    return run_with_pid(args, cwd, timeout)[0]


def run_with_pid(args: list[str], cwd: Path, timeout: float = 300) -> tuple[str, int]:
    """``args`` run to its end (it must succeed): its output, stdout and stderr together, and its process id."""
    env = job_environment()
    with subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    output = stdout + stderr
    assert proc.returncode == 0, output[-6000:]
    return output, proc.pid


def dynamix(*args: str, cwd: Path) -> str:
    return run([sys.executable, "-m", "lightning_dynamix.cli.main", *args], cwd=cwd)


def dynamix_with_pid(*args: str, cwd: Path) -> tuple[str, int]:
    """``dynamix ARGS`` as :func:`dynamix`, and the id of its process: the hosts it made are named after it
    (``lightning_dynamix.bench.hosts.leftovers(prefix=f"dx{pid}n")``)."""
    return run_with_pid([sys.executable, "-m", "lightning_dynamix.cli.main", *args], cwd=cwd)


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
