"""Fixtures for one-process tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def isolated_process_group():
    """A fit in this process initialises a 1-rank process group: undo it (the launcher variables it sets
    are undone for every test, by tests/conftest.py)."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
