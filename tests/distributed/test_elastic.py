"""torch elastic on one machine: a node is preempted mid-epoch, the survivors go on, a node joins, nothing is lost.

Three torchrun agents on 127.0.0.1 (``--nnodes 2:3 --nproc-per-node 1``, one Lightning worker each,
jobs/elastic_job.py) train with PreemptionCheckpoint. The node of rank 0 gets a SIGTERM mid-epoch
(every process of it, as a machine's shutdown sends): every rank saves the same step and exits,
torch elastic restarts the two survivors, which resume the checkpoint with ``ckpt_path="last"``.
Then a fourth agent starts: torch elastic stops the two (a SIGTERM each, so they save again) and
restarts three, which finish the job (on a loaded machine an agent may miss a rendezvous's last call: the group
then forms on two and grows to three at the next). No launcher is restarted by hand.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from lightning_dynamix.bench.cluster import LocalElasticCluster
from tests import forkserver
from tests.distributed.conftest import JOBS, PRELOAD, import_job
from tests.distributed.test_regroup import global_steps

pytestmark = pytest.mark.distributed

NUM_SAMPLES = 150
PHASE_TIMEOUT = 180.0


def progress(out: Path) -> list[dict]:
    path = out / "progress"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_until(out: Path, cluster: LocalElasticCluster, event: str, world: int, after: int) -> list[dict]:
    """Wait until every rank of one launch on ``world`` nodes reported ``event`` at one step (progress from ``after``).

    ``event`` is ``"start"`` (training began) or ``"held"`` (waiting for the driver).
    """
    deadline = time.monotonic() + PHASE_TIMEOUT
    while time.monotonic() < deadline:
        seen = defaultdict(dict)
        for line in progress(out)[after:]:
            if line["event"] == event and line["world"] == world:
                seen[line["start"], line["step"]][line["rank"]] = line
        for ranks in seen.values():
            if len(ranks) == world:
                return [ranks[r] for r in range(world)]
        if any(node.poll() == 0 for node in cluster.nodes.values()):
            break  # the job ended
        time.sleep(0.1)
    logs = "\n".join(f"--- {name}\n{cluster.log(name)[-3000:]}" for name in cluster.nodes)
    pytest.fail(f"no launch on {world} nodes reported {event!r} on all its ranks\n{logs}")


@pytest.fixture(scope="module")
def elastic(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic")
    (out / "hold-w3").touch()
    (out / "hold-w2").touch()
    # the agents, the store and the workers forked from a Python that has imported the package (tests/forkserver.py:
    # the workers of each agent in its own process tree, which preempt walks, as a new Python's would be)
    with (
        forkserver.serving(PRELOAD, free=("DYNAMIX_MACHINE_ID", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")),
        LocalElasticCluster([JOBS / "elastic_job.py", out], out, nnodes="2:3") as cluster,
    ):
        cluster.add_nodes(["node-0", "node-1", "node-2"])
        held = wait_until(out, cluster, "held", 3, after=0)
        victim = held[0]["machine"]  # the node of rank 0: the workers' store and the checkpoint's writer go too
        mark = len(progress(out))
        cluster.preempt(victim)
        (out / "hold-w3").unlink()
        wait_until(out, cluster, "held", 2, after=mark)
        mark = len(progress(out))
        cluster.add_node("node-3")  # torch elastic sees a node waiting and restarts the group on 3
        wait_until(out, cluster, "start", 3, after=mark)
        (out / "hold-w2").unlink()
        finishers = [name for name in cluster.nodes if name != victim]
        codes = cluster.wait(finishers, timeout=300)
        codes[victim] = cluster.wait([victim], timeout=10)[victim]
        logs = {name: cluster.log(name) for name in cluster.nodes}
    launches, written = defaultdict(list), defaultdict(list)
    for path in out.glob("launch-*.pt"):  # launch-w<world>-from<step>-rank<rank>.pt
        world, rest = path.stem.removeprefix("launch-w").split("-from")
        key = (int(rest.split("-rank")[0]), int(world))
        launches[key].append(torch.load(path))
        written[key].append(path.stat().st_mtime)
    # by the step each began at; two at one step (one stopped before its first step) in the order they ended
    keys = sorted(launches, key=lambda key: (key[0], min(written[key])))
    ordered = [{"start": start, "ranks": launches[start, world]} for start, world in keys]
    return {
        "out": out, "victim": victim, "preempted_in": held[0]["start"], "codes": codes, "logs": logs,
        "launches": ordered,
    }  # fmt: skip


def test_torch_elastic_restarts_the_survivors_then_grows_back_and_the_job_finishes(elastic):
    codes, victim = elastic["codes"], elastic["victim"]
    finishers = {name: code for name, code in codes.items() if name != victim}
    logs = {name: log[-3000:] for name, log in elastic["logs"].items()}
    assert all(code == 0 for code in finishers.values()), (codes, logs)
    assert codes[victim] is not None
    assert codes[victim] != 0  # the preempted agent stopped for good
    launches = elastic["launches"]
    machines = [{r["machine"] for r in launch["ranks"]} for launch in launches]
    # three nodes when the victim went, then the two survivors; then, once node-3 is in, three again. A node that
    # reaches a rendezvous after its last call (a loaded machine) misses that round: the group forms on two and
    # grows at the next, so there may be more launches than these
    at = next(i for i, m in enumerate(machines) if launches[i]["start"] == elastic["preempted_in"] and len(m) == 3)
    assert machines[at] == {"node-0", "node-1", "node-2"}
    assert machines[at + 1] == {"node-0", "node-1", "node-2"} - {victim}
    assert {len(m) for m in machines} == {2, 3}
    last = launches[-1]["ranks"]
    assert {r["machine"] for r in last} == {"node-0", "node-1", "node-2", "node-3"} - {victim}
    assert all(r["exception"] is None for r in last)


def test_each_launch_saved_the_step_it_stopped_at_and_the_next_began_there(elastic):
    launches = elastic["launches"]
    assert launches[0]["start"] == 0
    for before, after in itertools.pairwise(launches):
        assert {r["exception"] for r in before["ranks"]} == {"Preempted"}
        assert {r["saved_step"] for r in before["ranks"]} == {after["start"]}
        assert {r["global_step"] for r in before["ranks"]} == {after["start"]}
        # every step from the launch's start to the saved one was trained, and no other
        assert {len(r["steps"]) for r in before["ranks"]} == {after["start"] - before["start"]}


def test_every_sample_once_per_epoch_and_the_parameters_of_one_process_on_the_same_global_batches(elastic):
    steps: dict[tuple[int, int], list[int]] = {}
    for launch in elastic["launches"]:
        trained = global_steps(launch["ranks"])
        assert not set(trained) & set(steps), "a step was trained twice"
        steps.update(trained)
    for epoch in (0, 1):
        seen = [i for (e, _), indices in steps.items() if e == epoch for i in indices]
        assert sorted(seen) == list(range(NUM_SAMPLES))
    common = import_job("common")
    ordered = [(epoch, batch_idx, steps[epoch, batch_idx]) for epoch, batch_idx in sorted(steps)]
    reference, _ = common.train_one_process(ordered, NUM_SAMPLES, "adam")
    for rank in elastic["launches"][-1]["ranks"]:
        worst = max((rank["params"][k] - reference[k]).abs().max().item() for k in reference)
        assert worst <= 1e-6, f"max abs difference {worst}"
