"""Per-step fault tolerance's pieces that need no job: the participants' split, a lighthouse that is not there."""

from __future__ import annotations

import time

import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_dynamix.distributed import free_port
from lightning_dynamix.distributed.fault_tolerance import FaultTolerantReplica, Lighthouse, participant_sizes
from lightning_dynamix.strategies import FaultTolerantStrategy
from tests.distributed.jobs.common import Net, quiet_trainer


def test_an_unreachable_lighthouse_is_refused_at_once_naming_its_address():
    address = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=address.replace(".", r"\.")):
        FaultTolerantReplica(10, 4, dict, lambda state: None, lighthouse=address)
    assert time.monotonic() - started < 30  # not torchft's retries until its connect timeout
    with pytest.raises(ValueError, match="`lighthouse`"):
        FaultTolerantReplica(10, 4, dict, lambda state: None, lighthouse="http://nowhere")


def test_participants_split_the_global_batch_in_proportion_and_the_epoch_end_takes_what_remains():
    assert participant_sizes(12, [8, 4], remaining=120) == (8, 4)
    assert participant_sizes(12, [6.0, 6.0, 12.0], remaining=120) == (3, 3, 6)
    assert participant_sizes(12, [1, 1], remaining=14) == (6, 6)  # leaves 2: one per participant
    assert participant_sizes(12, [1, 1], remaining=13) == (7, 6)  # the last step takes all 13
    assert participant_sizes(12, [1, 3], remaining=5) == (1, 4)
    assert participant_sizes(12, [1, 1, 1], remaining=2) == (1, 1, 0)  # more participants than samples


@pytest.mark.parametrize(
    ("build", "argument"),
    [
        (lambda address: FaultTolerantReplica(0, 4, dict, print, lighthouse=address), "num_samples"),
        (lambda address: FaultTolerantReplica(10, 0, dict, print, lighthouse=address), "global_batch_size"),
        (lambda address: FaultTolerantReplica(10, 4, dict, print, lighthouse=address, backend="mpi"), "backend"),
        (lambda address: FaultTolerantReplica(10, 4, dict, print, lighthouse=address, replica_id="a:b"), "replica_id"),
        (lambda address: FaultTolerantReplica(10, 4, dict, print, lighthouse=address, timeout=0), "timeout"),
        (lambda address: Lighthouse(min_replicas=0), "min_replicas"),
        (lambda address: Lighthouse(heartbeat_timeout=0), "heartbeat_timeout"),
    ],
)
def test_bad_arguments_are_refused_naming_them(build, argument):
    with Lighthouse() as lighthouse, pytest.raises(ValueError, match=f"`{argument}`"):
        build(lighthouse.address)


def test_the_strategy_needs_a_lighthouse_and_refuses_what_it_cannot_do(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="`lighthouse`"):
        FaultTolerantStrategy(12)
    with pytest.raises(ValueError, match="`lighthouse`"):
        FaultTolerantStrategy(12, lighthouse="nowhere")
    with pytest.raises(ValueError, match="`global_batch_size`"):
        FaultTolerantStrategy(0, lighthouse="http://127.0.0.1:29510")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")
    assert FaultTolerantStrategy(12).lighthouse == "http://127.0.0.1:29510"
    for kwargs, message in (({"accumulate_grad_batches": 2}, "accumulate"),):
        trainer = quiet_trainer(strategy=FaultTolerantStrategy(12), devices=1, max_steps=1, **kwargs)
        with pytest.raises(MisconfigurationException, match=message):
            trainer.fit(Net(num_samples=24))
    manual = Net(num_samples=24, manual=True)
    with pytest.raises(MisconfigurationException, match="automatic optimisation"):
        quiet_trainer(strategy=FaultTolerantStrategy(12), devices=1, max_steps=1).fit(manual)
