"""How the CLI tests run the ``dynamix`` command: as a user runs it (a new process), or in the test's own."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path


def run(args: list[str], cwd: Path, timeout: float = 300) -> str:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        env.pop(name, None)
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output


def dynamix(*args: str, cwd: Path) -> str:
    return run([sys.executable, "-m", "lightning_dynamix.cli.main", *args], cwd=cwd)


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
