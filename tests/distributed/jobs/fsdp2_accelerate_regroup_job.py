"""DynamixAccelerate with a sharded model: a state saved by 2 processes (torch distributed checkpoint) loaded by 3.

Usage: accelerate launch --multi_gpu --num_processes W fsdp2_accelerate_regroup_job.py OUT_DIR RUN

RUN ``full`` trains the transformer block with Adam straight through two epochs; ``mid`` stops after a
``save_state`` at optimizer step 5; ``resume`` (on another number of processes) loads it and trains to the end.
Sizes change at planned steps by global batch, split over the launch's processes. Every process saves the batches
it trained on and the full parameters.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from common import REGROUP_PLAN as PLAN
from common import IndexedDataset, make_optimizer, uneven
from fsdp2_lightning_job import network, shard
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader

from lightning_dynamix.integrations.accelerate import DynamixAccelerate

out, run = Path(sys.argv[1]), sys.argv[2]
MID_STEP = 5
accelerator = Accelerator(cpu=not torch.cuda.is_available())
world = accelerator.num_processes
dynamix = DynamixAccelerate(accelerator, seed=5)
model = shard(network("transformer"), init_device_mesh(accelerator.device.type, (world,)))
optimizer = make_optimizer("adam", model.parameters())
loader = DataLoader(IndexedDataset(150), batch_size=4)
model, optimizer, loader = dynamix.prepare(model, optimizer, loader)
if run == "resume":
    accelerator.load_state(str(out / "mid-state"))
steps, stop = [], False
for epoch in range(loader.epoch, 2):
    for index, x, y in loader:
        step = loader.loader.current_step
        steps.append((epoch, step, index.tolist()))
        dynamix.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        total = PLAN.get((epoch, step)) or (PLAN.get((epoch, -1)) if step == len(loader) - 1 else None)
        if total is not None:
            dynamix.set_batch_sizes(uneven(total, world))
        dynamix.step()
        if run == "mid" and dynamix.global_step == MID_STEP:
            stop = True
            break
    if stop:
        accelerator.save_state(str(out / "mid-state"))
        break
state = {k: v.full_tensor() for k, v in model.state_dict().items()}
torch.save(
    {"steps": steps, "params": {k: v.detach().cpu() for k, v in state.items()}},
    out / f"{run}-w{world}-rank{accelerator.process_index}.pt",
)
