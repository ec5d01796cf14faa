"""Per-step fault tolerance's pieces that need no job: the participants' split, a lighthouse that is not there."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_dynamix.callbacks import DynamixCallback
from lightning_dynamix.control import PIDController
from lightning_dynamix.decisions import DecisionMaker, ReplicaBalancer
from lightning_dynamix.distributed import free_port
from lightning_dynamix.distributed.fault_tolerance import (
    FaultTolerantReplica,
    Lighthouse,
    machine_key,
    participant_sizes,
)
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


def _maker() -> DecisionMaker:
    return DecisionMaker(PIDController(), "pid", "none", "test")


@pytest.mark.parametrize(
    ("build", "argument"),
    [
        (lambda address: FaultTolerantReplica(0, 4, dict, print, lighthouse=address), "num_samples"),
        (lambda address: FaultTolerantReplica(10, 0, dict, print, lighthouse=address), "global_batch_size"),
        (lambda address: FaultTolerantReplica(10, 4, dict, print, lighthouse=address, backend="mpi"), "backend"),
        (lambda address: FaultTolerantReplica(10, 4, dict, print, lighthouse=address, replica_id="a:b"), "replica_id"),
        (lambda address: FaultTolerantReplica(10, 4, dict, print, lighthouse=address, timeout=0), "timeout"),
        (lambda address: Lighthouse(min_replicas=0), "min_replicas"),
        (lambda address: ReplicaBalancer(_maker(), interval=0), "interval"),
        (lambda address: ReplicaBalancer(_maker(), warmup_steps=-1), "warmup_steps"),
        (lambda address: ReplicaBalancer(_maker(), min_batch_size=0), "min_batch_size"),
        (lambda address: ReplicaBalancer(_maker(), min_batch_size=4, max_batch_size=2), "max_batch_size"),
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


@pytest.mark.distributed
def test_a_machine_key_is_the_same_in_every_process_and_exact_in_a_float64():
    key = machine_key("node-7")
    code = "from lightning_dynamix.distributed.fault_tolerance import machine_key; print(machine_key('node-7'))"
    env = dict(os.environ, PYTHONHASHSEED="123")  # another process, whose str hashes differ from this one's
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(other.stdout) == key
    assert key < 2**48
    assert float(key) == key
    assert machine_key("node-8") != key


def test_the_balancer_decides_every_interval_once_every_participant_measured_keyed_by_machine():
    balancer = ReplicaBalancer(_maker(), interval=2, warmup_steps=0)
    a, b, c = machine_key("a"), machine_key("b"), machine_key("c")
    # (seconds over the steps measured, steps, size): a does 1000 samples/s, b 250
    assert not balancer.decide(3, 0, [a, b], [(0.012, 2, 6), (0.048, 2, 6)])  # not a decision step
    assert not balancer.decide(4, 0, [a, b], [(0.012, 2, 6), (0.0, 0, 6)])  # b measured nothing yet
    assert balancer.decide(4, 0, [a, b], [(0.012, 2, 6), (0.048, 2, 6)])
    assert balancer.decided == {a: 10, b: 2}  # 12 in proportion to the speeds, at least 1 each
    assert balancer.history[-1].state.batch_sizes == (6, 6)
    # b left, c joined: a keeps what pid learnt about it; c starts from the others' mean, then its measurement
    assert balancer.decide(6, 0, [a, c], [(0.02, 2, 10), (0.004, 2, 2)])
    assert balancer.maker.regrouped_from == [0, None]
    assert set(balancer.decided) == {a, c}
    # the state a joining replica receives gives the same decisions
    other = ReplicaBalancer(_maker(), interval=2, warmup_steps=0)
    other.load_state_dict(balancer.state_dict())
    assert other.decided == balancer.decided
    assert other.maker.controller.state_dict() == balancer.maker.controller.state_dict()


def test_dynamix_callback_refuses_a_learning_rate_rule_under_the_fault_tolerant_strategy():
    strategy = FaultTolerantStrategy(12, lighthouse="http://127.0.0.1:29510")
    trainer = quiet_trainer(strategy=strategy, devices=1, max_steps=1, callbacks=[DynamixCallback(lr_scaling="linear")])
    with pytest.raises(MisconfigurationException, match="lr_scaling='none'"):
        trainer.fit(Net(num_samples=24))


@pytest.mark.distributed
def test_a_lighthouse_started_here_logs_no_line_per_quorum():
    script = (
        "import time\n"
        "from lightning_dynamix.distributed.fault_tolerance import Lighthouse\n"
        "with Lighthouse(min_replicas=1, quorum_tick=0.01):\n"
        "    time.sleep(0.3)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
    quiet = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0, quiet.stderr
    assert "[INFO]" not in quiet.stderr + quiet.stdout  # torchft's INFO line per quorum
