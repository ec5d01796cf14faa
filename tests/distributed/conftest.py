"""Helpers to run a job script under Lightning's launcher and read what every rank saved."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import pytest

from lightning_dynamix.distributed import job_environment

JOBS = Path(__file__).parent / "jobs"


def run_job(
    script: str, *args: object, cwd: Path, timeout: float = 300, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``jobs/<script>`` as ``python script args...`` (rank 0 starts the other ranks).

    With ``check`` a non-zero exit fails the test; a job that outlives ``timeout`` seconds (a
    hang) always does.
    """
    proc = subprocess.run(
        [sys.executable, str(JOBS / script), *map(str, args)],
        cwd=cwd,
        env=job_environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        pytest.fail(f"{script} {args} exited with {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def run_jobs(*jobs: tuple[str, tuple[object, ...], Path], timeout: float = 300) -> None:
    """Run several ``(script, args, cwd)`` jobs as :func:`run_job` does, all at once; fail with the output of
    each that exits with an error. One still running after ``timeout`` seconds (a hang) fails them all.

    Only for jobs whose results do not depend on how fast they run (exactness, not balance): they
    share the cores. A job's rank 0 imports Lightning before it starts the other ranks, which import
    it again, so one job alone keeps about one core busy; two at once took 13.7 s against 25.5 s one after the
    other (the exactness jobs on 2 cores).
    """
    deadline, failures = time.monotonic() + timeout, []
    with contextlib.ExitStack() as stack:
        started = []
        for script, args, cwd in jobs:
            # files, not pipes: a job that prints much never waits for the test to read it
            out, err = (stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2))
            command = [sys.executable, str(JOBS / script), *map(str, args)]
            proc = subprocess.Popen(command, cwd=cwd, env=job_environment(), stdout=out, stderr=err, text=True)
            stack.callback(lambda proc=proc: proc.poll() is None and proc.kill())  # a hang, or a failure beside it
            started.append((script, args, proc, out, err))
        for script, args, proc, out, err in started:
            code = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            if code != 0:
                out.seek(0)
                err.seek(0)
                failures.append(f"{script} {args} exited with {code}\n{out.read()[-4000:]}\n{err.read()[-8000:]}")
    if failures:
        pytest.fail("\n\n".join(failures))


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


@pytest.fixture(scope="session")
def pools():
    """``pools(n)``: a pool of ``n`` rank processes (tests/distributed/pool.py), started when first asked for and
    shared by every test of the session (of each pytest-xdist worker) that runs job scripts or tasks on it."""
    from tests.distributed.pool import RankPool, rank_pool

    started: dict[int, RankPool] = {}

    def pool(world_size: int) -> RankPool:
        if world_size not in started:
            started[world_size] = rank_pool(world_size)
        return started[world_size]

    yield pool
    for each in started.values():
        each.close()
