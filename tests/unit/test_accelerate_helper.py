"""DynamixAccelerate's checks that need no second process (the 2-process runs are in tests/distributed)."""

from __future__ import annotations

import pytest
import torch
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


def test_fault_tolerant_accelerate_refuses_what_it_cannot_do_naming_why(make_accelerator, monkeypatch):
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dynamix.integrations.fault_tolerant_accelerate import FaultTolerantAccelerate

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    address = "http://127.0.0.1:29510"
    with pytest.raises(ValueError, match="`lighthouse`"):
        FaultTolerantAccelerate(make_accelerator(), 12)
    with pytest.raises(ValueError, match="`global_batch_size`"):
        FaultTolerantAccelerate(make_accelerator(), 0, lighthouse=address)
    with pytest.raises(ValueError, match="`batch_size`"):
        FaultTolerantAccelerate(make_accelerator(), 12, lighthouse=address, batch_size=0)
    with pytest.raises(ValueError, match="`controller`"):
        FaultTolerantAccelerate(make_accelerator(), 12, lighthouse=address, controller="fastest")
    dynamix = FaultTolerantAccelerate(make_accelerator(), 12, lighthouse=address)
    with pytest.raises(RuntimeError, match=r"prepare\(\) must come before"):
        next(dynamix.batches(max_steps=1))
    model = nn.Linear(2, 2)
    loader = DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2)
    with pytest.raises(ValueError, match="`train_dataset`, not a DataLoader"):
        dynamix.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, train_dataset=loader.dataset)


def test_fault_tolerant_accelerate_refuses_fp16(make_accelerator):
    from lightning_dynamix.integrations.fault_tolerant_accelerate import FaultTolerantAccelerate

    with pytest.raises(ValueError, match=r"mixed_precision='fp16'.*'bf16'"):
        FaultTolerantAccelerate(make_accelerator(mixed_precision="fp16"), 12, lighthouse="http://127.0.0.1:29510")


def test_fault_tolerant_accelerate_refuses_gradient_accumulation(make_accelerator):
    from lightning_dynamix.integrations.fault_tolerant_accelerate import FaultTolerantAccelerate

    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2.*`global_batch_size`"):
        FaultTolerantAccelerate(
            make_accelerator(gradient_accumulation_steps=2), 12, lighthouse="http://127.0.0.1:29510"
        )


def test_a_time_source_that_is_not_one_is_refused_naming_it(single_process_accelerator):
    with pytest.raises(ValueError, match=r"`time_source` must be a TimeSource.*got 'clock'"):
        DynamixAccelerate(single_process_accelerator, time_source="clock")
