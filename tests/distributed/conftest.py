"""Helpers to run a job script under Lightning's launcher and read what every rank saved."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

JOBS = Path(__file__).parent / "jobs"


def run_job(
    script: str, *args: object, cwd: Path, timeout: float = 300, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``jobs/<script>`` as ``python script args...`` (rank 0 starts the other ranks).

    With ``check`` a non-zero exit fails the test; a job that outlives ``timeout`` seconds (a
    hang) always does.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        env.pop(name, None)  # left by an in-process Trainer: the job must launch its own ranks
    proc = subprocess.run(
        [sys.executable, str(JOBS / script), *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        pytest.fail(f"{script} {args} exited with {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def import_job(name: str) -> ModuleType:
    """The module ``jobs/<name>.py``, imported as its own (the jobs folder is not a package)."""
    spec = importlib.util.spec_from_file_location(name, JOBS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: dataclasses and pickling look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def job_helpers() -> ModuleType:
    return import_job("common")
