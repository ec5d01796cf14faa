"""One replica of a fault-tolerant job (FaultTolerantReplica): trains until the job's last committed step.

Usage: python ft_replica_job.py LIGHTHOUSE REPLICA_ID OUT_DIR [BATCH_SIZE [STEP_SECONDS [JOIN_FILE]]]

Writes OUT_DIR/REPLICA_ID.jsonl, one line per step it took part in (its plan and whether it was
committed), and OUT_DIR/REPLICA_ID.pt with its final parameters. BATCH_SIZE is the size it asks for;
STEP_SECONDS sleeps in each step after its backward; once OUT_DIR/REPLICA_ID.die exists it SIGKILLs itself
there instead, inside its next step (common.inside_a_step). With JOIN_FILE it joins the job once that file exists (its
imports done before: a joiner that is ready, as a spare machine would be).
"""

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

from lightning_dynamix.distributed.fault_tolerance import FaultTolerantReplica

NUM_SAMPLES, GLOBAL_BATCH, STEPS = 120, 12, 24  # two epochs of 10 full steps, the 11th taking 12 + 0

lighthouse, replica_id, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
batch_size = int(sys.argv[4]) if len(sys.argv) > 4 else None
pause = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
join_file = Path(sys.argv[6]) if len(sys.argv) > 6 else None

data = IndexedDataset(NUM_SAMPLES)
network = make_network(0)
optimizer = make_optimizer("sgd", network.parameters())
state_dict, load_state_dict = replica_state(network, optimizer)
wait_to_join(join_file)
replica = FaultTolerantReplica(
    NUM_SAMPLES,
    GLOBAL_BATCH,
    state_dict,
    load_state_dict,
    lighthouse=lighthouse,
    replica_id=replica_id,
    seed=3,
    timeout=5.0,
)
replica_made(out, replica_id)
log = (out / f"{replica_id}.jsonl").open("a")
while replica.step < STEPS:
    plan = replica.begin_step(batch_size)
    if replica.step >= STEPS:  # a joining replica may have received the state of a finished job
        break
    index = torch.tensor(plan.indices, dtype=torch.long)
    optimizer.zero_grad()
    loss = F.cross_entropy(network(data.x[index]), data.y[index])
    loss.backward()
    inside_a_step(out, replica_id, plan.step, pause)
    replica.sync_gradients(network.parameters())
    committed = replica.commit()
    if committed:
        optimizer.step()
    write_plan(log, plan, replica, committed)
torch.save({k: v.clone() for k, v in network.state_dict().items()}, out / f"{replica_id}.pt")
replica.close()
