"""DynamixAccelerate(sync_batchnorm=True): a BatchNorm model on uneven, changing sizes with 0 and 1; every rank saves.

Usage: torchrun --nproc_per_node 3 accelerate_batch_norm_job.py OUT_DIR
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from common import IndexedDataset, batch_norm_network, make_optimizer
from torch.utils.data import DataLoader

from lightning_dynamix.integrations.accelerate import DynamixAccelerate

out = Path(sys.argv[1])
NUM_SAMPLES = 150
# (epoch, step within the epoch) after which every rank calls set_batch_sizes: rank 0 sits out (it ran first,
# and its statistics must still come back), one rank trains alone, and a rank trains one sample
PLAN = {(0, 1): [0, 9, 6], (0, 4): [1, 8, 0], (0, 7): [0, 7, 0], (1, 2): [0, 0, 7], (1, 5): [6, 1, 4]}

accelerator = Accelerator(cpu=not torch.cuda.is_available())
dynamix = DynamixAccelerate(accelerator, batch_sizes=[3, 7, 5], seed=5, min_batch_size=0, sync_batchnorm=True)
network = batch_norm_network(0)
optimizer = make_optimizer("adam", network.parameters())
loader = DataLoader(IndexedDataset(NUM_SAMPLES), batch_size=5)
model, optimizer, loader = dynamix.prepare(network, optimizer, loader)

steps = []
for epoch in range(2):
    for step, batch in enumerate(loader):
        if dynamix.sits_out:
            steps.append((epoch, step, []))
            loss = dynamix.zero_loss()
        else:
            index, x, y = batch
            steps.append((epoch, step, index.tolist()))
            loss = F.cross_entropy(model(x), y)
        dynamix.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        dynamix.step(loss)
        if (epoch, step) in PLAN:
            dynamix.set_batch_sizes(PLAN[(epoch, step)])

state = accelerator.unwrap_model(model).state_dict()
torch.save(
    {
        "steps": steps,
        "state": {k: v.detach().cpu().clone() for k, v in state.items()},
        "least_batch_size": dynamix.least_batch_size,
    },
    out / f"rank{accelerator.process_index}.pt",
)
accelerator.end_training()
