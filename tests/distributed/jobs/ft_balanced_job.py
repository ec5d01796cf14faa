"""One replica of a fault-tolerant job whose sizes a controller decides (FaultTolerantReplica + ReplicaBalancer).

Usage: python ft_balanced_job.py LIGHTHOUSE REPLICA_ID OUT_DIR SECONDS_PER_SAMPLE STEP_SECONDS [JOIN_FILE]

pid (DynamixCallback's controller, in a DecisionMaker) decides every 2 committed steps. The replica's work is
timed on a virtual clock that only its own samples move, SECONDS_PER_SAMPLE each, so that what pid measures,
and so decides, is the same on every run. Writes OUT_DIR/REPLICA_ID.jsonl, one line per step it took part in
(common.write_plan, with the balancer's decided sizes by machine and the controller's machines and speeds),
and OUT_DIR/REPLICA_ID.pt with its final parameters. It sleeps STEP_SECONDS (real time) in each step, or dies
there once OUT_DIR/REPLICA_ID.die exists (common.inside_a_step). With JOIN_FILE it joins once that file exists.
Once its replica is made it writes OUT_DIR/REPLICA_ID.ready (common.replica_made).

The job, not the test, times what must happen at a step, so that a test process slowed by a loaded machine cannot
let the replicas run past it: with DIE_AFTER_DECIDING_ON=N in the environment the replica dies inside the second
step after the controller first decided sizes for N machines (one step trained at those sizes); with
HOLD_AFTER_DECIDING_ON=N and HOLD_FILE, once the controller decides for N machines after deciding for more (a
machine gone), it waits before its next step until HOLD_FILE exists.
"""

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from common import (
    IndexedDataset,
    inside_a_step,
    make_network,
    make_optimizer,
    replica_made,
    replica_state,
    wait_to_join,
    write_plan,
)

from lightning_dynamix.control import PIDController
from lightning_dynamix.decisions import DecisionMaker, ReplicaBalancer
from lightning_dynamix.distributed.fault_tolerance import FaultTolerantReplica, machine_key
from lightning_dynamix.metrics.clocks import HostClock

NUM_SAMPLES, GLOBAL_BATCH, STEPS, INTERVAL = 120, 12, 30, 2

lighthouse, replica_id, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
seconds_per_sample, pause = float(sys.argv[4]), float(sys.argv[5])
join_file = Path(sys.argv[6]) if len(sys.argv) > 6 else None
die_after = int(os.environ.get("DIE_AFTER_DECIDING_ON", 0))
hold_after = int(os.environ.get("HOLD_AFTER_DECIDING_ON", 0))
hold_file = Path(os.environ["HOLD_FILE"]) if hold_after else None

data = IndexedDataset(NUM_SAMPLES)
network = make_network(0)
optimizer = make_optimizer("sgd", network.parameters())
now = [0.0]  # the virtual clock: moved by this replica's own samples only
state_dict, load_state_dict = replica_state(network, optimizer)
wait_to_join(join_file)
maker = DecisionMaker(PIDController(smoothing=0.0), "pid", "none", "ft_balanced_job")
balancer = ReplicaBalancer(maker, interval=INTERVAL, warmup_steps=1)
replica = FaultTolerantReplica(
    NUM_SAMPLES,
    GLOBAL_BATCH,
    state_dict,
    load_state_dict,
    lighthouse=lighthouse,
    replica_id=replica_id,
    seed=3,
    timeout=5.0,
    balancer=balancer,
    time_source=HostClock(lambda: now[0]),
)
replica_made(out, replica_id)
log = (out / f"{replica_id}.jsonl").open("a")
decided_on: dict[int, int] = {}  # machines -> the step the controller first decided sizes for that many
held = False
names = {machine_key(f"r{i}"): f"r{i}" for i in range(4)}
while replica.step < STEPS:
    decisions = len(balancer.history)
    plan = replica.begin_step()
    if replica.step >= STEPS:  # a joining replica may have received the state of a finished job
        break
    index = torch.tensor(plan.indices, dtype=torch.long)
    optimizer.zero_grad()
    loss = F.cross_entropy(network(data.x[index]), data.y[index])
    loss.backward()
    now[0] += seconds_per_sample * plan.batch_size
    if die_after in decided_on and plan.step == decided_on[die_after] + 2:
        (out / f"{replica_id}.die").touch()
    inside_a_step(out, replica_id, plan.step, pause)
    replica.sync_gradients(network.parameters())
    committed = replica.commit()
    if committed:
        optimizer.step()
    speeds = maker.controller.state_dict().get("speeds")
    write_plan(
        log,
        plan,
        replica,
        committed,
        decided={names[k]: v for k, v in balancer.decided.items()},
        decided_here=len(balancer.history) > decisions,
        machines=[names[int(m)] for m in maker.machine_ids or []],
        speeds=speeds,
        joined=replica.joined,
    )
    machines = len(maker.machine_ids or [])
    if len(balancer.history) > decisions:
        fewer = any(more > machines for more in decided_on)
        decided_on.setdefault(machines, plan.step)
        if hold_file is not None and machines == hold_after and fewer and not held:
            held = True
            wait_to_join(hold_file)
torch.save({k: v.clone() for k, v in network.state_dict().items()}, out / f"{replica_id}.pt")
replica.close()
