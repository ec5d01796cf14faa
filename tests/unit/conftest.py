"""Fixtures for one-process tests."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist


@pytest.fixture
def isolated_process_group():
    """A fit in this process initialises a 1-rank process group and sets launcher variables: undo both."""
    environ = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
