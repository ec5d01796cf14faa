"""The session's pool of ranks (tests/distributed/pool.py): a task finds the process as the pool started it,
whatever the task before it on the same ranks changed (tests of any module share a pool, in any order)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.distributed


def test_a_task_finds_the_process_as_the_pool_started_it_after_one_that_changed_it_and_ended_the_group(pools):
    pool = pools(2)
    before = pool.run("pool_checks", "the_process")
    pool.run("pool_checks", "change_the_process")
    after = pool.run("pool_checks", "the_process")
    assert after == before
    for rank, state in enumerate(after):
        launcher = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
        assert state["variables"] == launcher
        assert state["dtype"] == torch.float32
        assert state["world"] == 2
        assert state["sum"] == 2.0
        assert state["cwd"] != os.sep
