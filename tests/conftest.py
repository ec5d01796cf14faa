"""Fixtures for the whole suite."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """Every test leaves ``os.environ`` and torch's thread count as it found them.

    A Trainer run in this process sets the launcher's variables (``MASTER_PORT``, ``LOCAL_RANK``, ...)
    and ``OMP_NUM_THREADS``. A job a later test starts would inherit them: with ``OMP_NUM_THREADS=2``
    left behind, Lightning no longer gives each of a job's ranks its share of the cores, and 5 ranks
    of 2 threads each on 2 cores ran the exactness jobs 1.7 times slower (23 s against 13.7 s). A test
    that trains on one thread (``torch.set_num_threads(1)``) would likewise leave every later
    in-process run on one.
    """
    environ, threads = dict(os.environ), torch.get_num_threads()
    yield
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
