"""Per-step fault tolerance on torchft: replicas killed and joining while the others keep training.

The same timeline runs three times: replicas of a plain PyTorch loop on FaultTolerantReplica, of a Lightning
Trainer with FaultTolerantStrategy, and of an Accelerate loop with FaultTolerantAccelerate."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_dynamix.data.sampler import EpochPermutation
from lightning_dynamix.distributed import job_environment
from lightning_dynamix.distributed.fault_tolerance import Lighthouse, participant_sizes
from tests import forkserver
from tests.conftest import LITDATA_SAMPLES
from tests.distributed.conftest import PRELOAD

pytestmark = pytest.mark.distributed

JOBS = Path(__file__).parent / "jobs"
sys.path.insert(0, str(JOBS))
from common import IndexedDataset, make_network, make_optimizer  # noqa: E402

NUM_SAMPLES, GLOBAL_BATCH, STEPS, SEED = 120, 12, 24, 3  # as in ft_replica_job.py


def start_replica(
    job: str, lighthouse: str, name: str, out: Path, *args: object, join_file: Path | None = None, **extra: str
) -> subprocess.Popen:
    """``job`` with the lighthouse, the replica's name, ``out`` and ``args`` (then ``join_file``) as arguments,
    and ``extra`` in its environment (variables the job reads as it runs)."""
    path = os.pathsep.join([str(JOBS), os.environ.get("PYTHONPATH", "")])
    env = dict(job_environment(), PYTHONPATH=path, **extra)
    command = [sys.executable, str(JOBS / job), lighthouse, name, str(out), *map(str, args)]
    command += [str(join_file)] if join_file is not None else []
    with (out / f"{name}.log").open("w") as log:
        return forkserver.popen(command, PRELOAD, free=tuple(extra), env=env, stdout=log, stderr=subprocess.STDOUT)


def steps_of(out: Path, name: str) -> list[dict]:
    path = out / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.05)


@pytest.fixture(
    scope="module",
    params=["ft_replica_job.py", "ft_lightning_job.py", "ft_accelerate_job.py"],
    ids=["loop", "lightning", "accelerate"],
)
def killed_and_joined(request, tmp_path_factory):
    """Three replicas asking for 8, 4 and 2 samples: r0 and r1 start, r1 is killed (SIGKILL, no notice: it sends
    it itself, so that the step it dies in is never a race) inside the step after three it trained beside r0, and
    r2 joins once r0 has committed eight steps; r0 and r2 train to the job's end. The step r1 died in is
    written to ``killed``. The replicas time the death and the join themselves (jobs/common.py): r0 waits after
    its eighth step and the one r1 died in until r2's replica is made, so that a test process slowed by a loaded
    machine cannot let it finish first."""
    out = tmp_path_factory.mktemp("ft")
    join = out / "join"
    hold = {"HOLD_AFTER_STEPS": "8", "KILLED_FILE": str(out / "killed"), "HOLD_FILE": str(out / "r2.ready")}
    # a heartbeat 2 s late drops a replica: a loaded machine never delays one that long
    with Lighthouse(min_replicas=1, heartbeat_timeout=2.0) as lighthouse:
        r0 = start_replica(request.param, lighthouse.address, "r0", out, 8, 0.2, **hold)
        r1 = start_replica(request.param, lighthouse.address, "r1", out, 4, 0.2, DIE_AFTER_STEPS_BESIDE="3")
        r2 = start_replica(request.param, lighthouse.address, "r2", out, 2, 0.2, join_file=join)
        processes = [r0, r1, r2]
        try:
            # r1 has trained three steps beside r0 (however late it started): it dies inside its next one
            assert r1.wait(timeout=120) == -signal.SIGKILL, (out / "r1.log").read_text()[-3000:]
            beside = sum(s["committed"] and len(s["sizes"]) == 2 for s in steps_of(out, "r1"))
            assert beside == 3, steps_of(out, "r1")
            # r2 joins once r0 has committed eight steps and, alone, the step r1 died in (not while r0 retries it)
            killed = int((out / "killed").read_text())
            committed = lambda: [s["step"] for s in steps_of(out, "r0") if s["committed"]]  # noqa: E731
            wait_for(lambda: len(committed()) >= 8 and killed in committed(), "r0's eighth step and the retried one")
            join.touch()
            assert r0.wait(timeout=90) == 0, (out / "r0.log").read_text()[-3000:]
            assert r2.wait(timeout=90) == 0, (out / "r2.log").read_text()[-3000:]
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
    return out


def committed_steps(out: Path, names: tuple[str, ...] = ("r0", "r1", "r2")) -> dict[int, dict]:
    """Every committed step, by step number, with the slices of the replicas that logged it (all agreeing)."""
    steps: dict[int, dict] = {}
    for name in names:
        for line in steps_of(out, name):
            if not line["committed"]:
                continue
            step = steps.setdefault(line["step"], {**line, "slices": {}})
            assert (step["epoch"], step["cursor"], step["sizes"]) == (line["epoch"], line["cursor"], line["sizes"])
            step["slices"][line["participant"]] = line["indices"]
    return steps


def test_every_sample_is_trained_exactly_once_per_epoch_by_the_committed_steps(killed_and_joined):
    assert_every_sample_once_per_epoch(committed_steps(killed_and_joined), STEPS)


def assert_every_sample_once_per_epoch(steps: dict[int, dict], count: int, num_samples: int = NUM_SAMPLES) -> None:
    assert sorted(steps) == list(range(count))
    order = EpochPermutation(num_samples, seed=SEED)
    seen: dict[int, list[int]] = {}
    for number in range(count):
        step = steps[number]
        order.set_epoch(step["epoch"])
        batch = order.indices(step["cursor"], step["cursor"] + sum(step["sizes"]))
        for participant, indices in step["slices"].items():  # each participant's slice, in participant order
            start = sum(step["sizes"][:participant])
            assert indices == batch[start : start + step["sizes"][participant]]
        seen.setdefault(step["epoch"], []).extend(batch)
    for epoch in range(max(seen)):  # every epoch but the last, which the job may end inside
        assert sorted(seen[epoch]) == list(range(num_samples)), epoch


def test_the_killed_replicas_step_is_trained_again_by_the_survivors_and_a_joiner_takes_its_share(killed_and_joined):
    r0 = steps_of(killed_and_joined, "r0")
    # r1 died inside step k: that step was not committed, and r0 trained its global batch again, alone
    k = int((killed_and_joined / "killed").read_text())
    before, again = (next(s for s in r0 if s["committed"] and s["step"] == n) for n in (k - 1, k))
    assert (before["sizes"], before["failed"]) == ([8, 4], 0)
    assert (again["cursor"] - before["cursor"]) % NUM_SAMPLES == GLOBAL_BATCH
    assert (again["sizes"], again["failed"]) == ([12], 1)
    assert k not in {s["step"] for s in steps_of(killed_and_joined, "r1") if s["committed"]}
    # r2 received the state from r0 (no file) and trained its share: 2 of every 10 asked for
    r2 = [s for s in steps_of(killed_and_joined, "r2") if s["committed"]]
    assert r2
    assert r2[0]["step"] >= 8
    full = [s for s in r2 if s["cursor"] + GLOBAL_BATCH + 2 <= NUM_SAMPLES]
    assert full
    assert all(s["sizes"] == [10, 2] for s in full)
    assert all(s["failed"] == 0 for s in r2)


@pytest.mark.parametrize("killed_and_joined", ["ft_lightning_job.py"], indirect=True, ids=["lightning"])
def test_lightning_counts_one_optimizer_step_per_committed_step_on_every_replica_a_joiner_included(killed_and_joined):
    for name in ("r0", "r2"):
        for step in steps_of(killed_and_joined, name):
            assert step["global_step"] == step["step"] + 1, (name, step)
            assert step["current_epoch"] == step["epoch"], (name, step)


def test_the_committed_steps_equal_one_process_trained_on_the_same_global_batches(killed_and_joined):
    assert_like_one_process(killed_and_joined, committed_steps(killed_and_joined), STEPS, ("r0", "r2"))


def assert_like_one_process(
    out: Path, steps: dict[int, dict], count: int, finishers: tuple[str, ...], num_samples: int = NUM_SAMPLES
) -> None:
    data, order = IndexedDataset(num_samples), EpochPermutation(num_samples, seed=SEED)
    network = make_network(0)
    optimizer = make_optimizer("sgd", network.parameters())
    for number in range(count):
        order.set_epoch(steps[number]["epoch"])
        index = torch.tensor(
            order.indices(steps[number]["cursor"], steps[number]["cursor"] + sum(steps[number]["sizes"]))
        )
        optimizer.zero_grad()
        F.cross_entropy(network(data.x[index]), data.y[index]).backward()
        optimizer.step()
    for name in finishers:
        trained = torch.load(out / f"{name}.pt")
        for key, value in network.state_dict().items():
            torch.testing.assert_close(trained[key], value, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------- a controller's sizes
BALANCED_STEPS = 30  # as in ft_balanced_job.py
# seconds per sample on each replica's virtual clock: r1 4x and r2 2x slower than r0; r3 joins as fast as r0
SECONDS_PER_SAMPLE = {"r0": 0.001, "r1": 0.004, "r2": 0.002, "r3": 0.001}


@pytest.fixture(scope="module")
def balanced(tmp_path_factory):
    """pid decides the sizes (every 2 steps, on virtual clocks): r0, r1 and r2 train; r1 dies inside a step after
    the first decision on the three; r3 joins once the others have decided on their own. The replicas time the
    death and the join's step themselves (jobs/ft_balanced_job.py), so a test process that a loaded machine slows
    cannot let them run past either: r0 and r2 wait after their decision on the two until r3's replica is made."""
    out = tmp_path_factory.mktemp("ft-balanced")
    join = out / "join"
    with Lighthouse(min_replicas=1, heartbeat_timeout=2.0) as lighthouse:
        processes = {}
        for name, seconds in SECONDS_PER_SAMPLE.items():
            joins = join if name == "r3" else None
            timing = {
                "r1": {"DIE_AFTER_DECIDING_ON": "3"},
                "r3": {},
            }.get(name, {"HOLD_AFTER_DECIDING_ON": "2", "HOLD_FILE": str(out / "r3.ready")})
            processes[name] = start_replica(
                "ft_balanced_job.py", lighthouse.address, name, out, seconds, 0.05, join_file=joins, **timing
            )
        try:
            on = lambda name, machines: [  # noqa: E731
                s for s in steps_of(out, name) if s["committed"] and s["decided_here"] and s["machines"] == machines
            ]
            # r1 trains one step at the sizes decided on the three, then dies inside the next
            assert processes["r1"].wait(timeout=120) == -signal.SIGKILL, (out / "r1.log").read_text()[-3000:]
            # on a loaded machine r1 may start late: r0 and r2 then decide on their own before it joins, too
            decided = on("r0", ["r0", "r1", "r2"])[0]["step"]
            wait_for(lambda: [s for s in on("r0", ["r0", "r2"]) if s["step"] > decided], "a decision on r0 and r2")
            join.touch()
            for name in ("r0", "r2", "r3"):
                assert processes[name].wait(timeout=90) == 0, (out / f"{name}.log").read_text()[-3000:]
        finally:
            for process in processes.values():
                if process.poll() is None:
                    process.kill()
    return out


def test_a_controller_splits_the_replicas_by_speed_and_follows_a_leave_and_a_join_at_once(balanced):
    r0 = [s for s in steps_of(balanced, "r0") if s["committed"]]
    decisions = [s for s in r0 if s["decided_here"]]
    # on three: sizes in proportion to the speeds measured (1000, 250 and 500 samples/s)
    on_three = next(s for s in decisions if s["machines"] == ["r0", "r1", "r2"])
    assert on_three["decided"] == {"r0": 7, "r1": 2, "r2": 3}
    assert [s["sizes"] for s in r0 if s["step"] == on_three["step"] + 1] == [[7, 2, 3]]
    # r1 dies: the very next committed step splits the global batch over r0 and r2 by their decided sizes (7:3)
    killed = int((balanced / "killed").read_text())
    after = next(s for s in r0 if s["step"] == killed)
    assert after["sizes"] == list(participant_sizes(GLOBAL_BATCH, [7, 3], NUM_SAMPLES))
    assert after["sizes"] == [8, 4]
    # the next decision keeps what pid knew about the machines that stay
    on_two = next(s for s in decisions if s["machines"] == ["r0", "r2"] and s["step"] > on_three["step"])
    assert on_two["speeds"] == pytest.approx([on_three["speeds"][0], on_three["speeds"][2]])
    assert on_two["decided"] == {"r0": 8, "r2": 4}
    # r3 joins with the controller's state and asks for a probe (a quarter of the others' mean) until measured
    r3 = [s for s in steps_of(balanced, "r3") if s["committed"]]
    first = r3[0]
    assert first["joined"]
    assert first["speeds"] == next(s["speeds"] for s in r0 if s["step"] == first["step"])
    assert first["sizes"] == list(participant_sizes(GLOBAL_BATCH, [8, 4, 0.25 * 6], NUM_SAMPLES)) == [7, 4, 1]
    on_joined = next(s for s in decisions if s["machines"] == ["r0", "r2", "r3"])
    assert on_joined["decided"] == {"r0": 5, "r2": 2, "r3": 5}  # measured: as fast as r0
    assert r0[-1]["sizes"] == [5, 2, 5]


def test_under_a_controller_every_sample_is_trained_once_and_the_steps_equal_one_process(balanced):
    steps = committed_steps(balanced, ("r0", "r1", "r2", "r3"))
    assert_every_sample_once_per_epoch(steps, BALANCED_STEPS)
    assert_like_one_process(balanced, steps, BALANCED_STEPS, ("r0", "r2", "r3"))


def test_dynamix_callback_under_the_fault_tolerant_strategy_decides_the_same_sizes_on_every_replica(tmp_path):
    # pid in DynamixCallback, each replica on a virtual clock: r1 computes 3x slower than r0
    with Lighthouse(min_replicas=2, heartbeat_timeout=2.0) as lighthouse:
        replicas = {
            name: start_replica(
                "ft_lightning_job.py", lighthouse.address, name, tmp_path, 6, 0.0, SECONDS_PER_SAMPLE=seconds
            )
            for name, seconds in (("r0", "0.001"), ("r1", "0.003"))
        }
        for name, process in replicas.items():
            assert process.wait(timeout=90) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    logs = {name: steps_of(tmp_path, name) for name in replicas}
    assert logs["r0"][-1]["decisions"] == logs["r1"][-1]["decisions"]  # the same decisions on both replicas
    decisions = logs["r0"][-1]["decisions"]
    assert [step for step, _ in decisions] == list(range(2, STEPS, 2))
    assert decisions[-1][1] == [9, 3]  # 12 in proportion to 1000 and 333 samples/s
    assert [s["sizes"] for s in logs["r0"][-3:]] == [[9, 3]] * 3
    assert_every_sample_once_per_epoch(committed_steps(tmp_path, ("r0", "r1")), STEPS)


def test_a_litdata_streaming_dataset_trains_like_one_process_under_the_fault_tolerant_strategy(tmp_path, litdata_dir):
    # two replicas whose Lightning module returns a DataLoader over a LitData StreamingDataset (150 samples)
    with Lighthouse(min_replicas=2, heartbeat_timeout=2.0) as lighthouse:
        replicas = {
            name: start_replica(
                "ft_lightning_job.py", lighthouse.address, name, tmp_path, 6, 0.0, LITDATA_DIR=str(litdata_dir)
            )
            for name in ("r0", "r1")
        }
        for name, process in replicas.items():
            assert process.wait(timeout=90) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    steps = committed_steps(tmp_path, ("r0", "r1"))
    assert_every_sample_once_per_epoch(steps, STEPS, LITDATA_SAMPLES)
    assert_like_one_process(tmp_path, steps, STEPS, ("r0", "r1"), LITDATA_SAMPLES)
