"""DynamixAccelerate's checks that need no second process (the 2-process runs are in tests/distributed)."""

from __future__ import annotations

import pytest
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import GradientAccumulationPlugin

from lightning_dynamix.integrations.accelerate import DynamixAccelerate


@pytest.fixture
def make_accelerator():
    """``Accelerator(cpu=True, **kwargs)`` in this one process; Accelerate's shared state is reset afterwards."""
    yield lambda **kwargs: Accelerator(cpu=True, **kwargs)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.fixture
def single_process_accelerator(make_accelerator):
    return make_accelerator()


def test_a_single_process_accelerator_is_refused_with_the_launch_command(single_process_accelerator):
    with pytest.raises(ValueError, match=r"runs 1 process.*accelerate launch --multi_gpu --num_processes N"):
        DynamixAccelerate(single_process_accelerator)


def test_processes_launched_but_not_joined_get_the_cpu_hint(single_process_accelerator, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # a launcher started two processes, Accelerate did not join them
    with pytest.raises(ValueError, match=r"launcher started 2.*Accelerator\(cpu=not torch.cuda.is_available\(\)\)"):
        DynamixAccelerate(single_process_accelerator)


def test_something_else_than_an_accelerator_is_refused():
    with pytest.raises(ValueError, match=r"`accelerator` must be an accelerate\.Accelerator, got str"):
        DynamixAccelerate("accelerator")


def test_all_reducing_every_accumulated_batch_is_refused(make_accelerator):
    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)
    with pytest.raises(ValueError, match=r"sync_each_batch=True.*Use sync_each_batch=False"):
        DynamixAccelerate(make_accelerator(gradient_accumulation_plugin=plugin))
