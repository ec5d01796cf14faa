"""Helpers to run a job script under Lightning's launcher and read what every rank saved."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from lightning_dynamix.distributed import job_environment
from tests import forkserver

JOBS = Path(__file__).parent / "jobs"
PRELOAD = ("lightning_dynamix",)  # what the fork server the jobs are forked from imports


def run_job(script: str, *args: object, cwd: Path, timeout: float = 300, check: bool = True) -> forkserver.Completed:
    """Run ``jobs/<script>`` as ``python script args...`` does (rank 0 starts the other ranks), forked from a Python
    that has imported the package (:mod:`tests.forkserver`; its ranks too).

    With ``check`` a non-zero exit fails the test; a job that outlives ``timeout`` seconds (a
    hang) always does.
    """
    done = forkserver.run_script(
        str(JOBS / script), [str(arg) for arg in args], cwd, job_environment(), timeout, PRELOAD
    )
    if check and done.returncode != 0:
        pytest.fail(f"{script} {args} exited with {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return done


def import_job(name: str) -> ModuleType:
    """The module ``jobs/<name>.py``, imported as its own (the jobs folder is not a package; its modules import each
    other as the ranks do, with the folder on the path)."""
    if str(JOBS) not in sys.path:
        sys.path.append(str(JOBS))
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
