"""One replica of a fault-tolerant Accelerate job (FaultTolerantAccelerate), to the job's last committed step.

Usage: python ft_accelerate_job.py LIGHTHOUSE REPLICA_ID OUT_DIR BATCH_SIZE STEP_SECONDS [JOIN_FILE]

As ft_replica_job.py, through an Accelerator of one process: writes OUT_DIR/REPLICA_ID.jsonl (one line per step it
took part in) and OUT_DIR/REPLICA_ID.pt; sleeps STEP_SECONDS in each step, or dies there once OUT_DIR/REPLICA_ID.die
exists (common.inside_a_step). With JOIN_FILE it joins once that file exists.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from common import IndexedDataset, inside_a_step, make_network, make_optimizer, replica_made, wait_to_join, write_plan

from lightning_dynamix.integrations.fault_tolerant_accelerate import FaultTolerantAccelerate

NUM_SAMPLES, GLOBAL_BATCH, STEPS = 120, 12, 24

lighthouse, replica_id, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
batch_size, pause = int(sys.argv[4]), float(sys.argv[5])
join_file = Path(sys.argv[6]) if len(sys.argv) > 6 else None

accelerator = Accelerator(cpu=True)
network = make_network(0)
optimizer = make_optimizer("sgd", network.parameters())
wait_to_join(join_file)
dynamix = FaultTolerantAccelerate(
    accelerator, GLOBAL_BATCH, lighthouse=lighthouse, replica_id=replica_id, batch_size=batch_size, seed=3, timeout=5.0
)
model, optimizer = dynamix.prepare(network, optimizer, train_dataset=IndexedDataset(NUM_SAMPLES))
replica_made(out, replica_id)
log = (out / f"{replica_id}.jsonl").open("a")
for _, x, y in dynamix.batches(max_steps=STEPS):
    loss = F.cross_entropy(model(x), y)
    inside_a_step(out, replica_id, dynamix.plan.step, pause)
    plan = dynamix.plan
    committed = dynamix.backward(loss)
    if committed:
        optimizer.step()
    optimizer.zero_grad()
    write_plan(log, plan, dynamix.replica, committed)
torch.save({k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}, out / f"{replica_id}.pt")
dynamix.close()
