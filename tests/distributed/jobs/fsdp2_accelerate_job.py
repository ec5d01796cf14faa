"""DynamixAccelerate with a model sharded by fully_shard: uneven, changing sizes, 0 included; saves what it saw.

Usage: accelerate launch --multi_gpu --num_processes N fsdp2_accelerate_job.py OUT_DIR SCENARIO

The scenarios of fsdp2_lightning_job.py (a network, an optimizer, an accumulation), two epochs in float64 under
``accelerator.accumulate(model)``, the sizes changed mid-epoch (inside accumulation windows too) by
``set_batch_sizes``, a process given 0 samples at some steps running the placeholder its loader hands it.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from common import IndexedDataset, make_optimizer
from fsdp2_lightning_job import SCENARIOS, network, shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from lightning_dynamix.integrations.accelerate import DynamixAccelerate

out, name = Path(sys.argv[1]), sys.argv[2]
architecture, optimizer_name, accumulate = SCENARIOS.get(name, ("mlp", "sgd", 1))
accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=accumulate)
world = accelerator.num_processes
if name == "errors":  # what bad input says, on every rank
    mesh = init_device_mesh(accelerator.device.type, (world,))
    messages = {}
    loose = network("mlp")
    fully_shard(loose[0], mesh=mesh)  # the root's parameters are held by no fully_shard
    plain = network("batch-norm")
    fully_shard(plain, mesh=mesh)  # BatchNorm left as it is, then sync_batchnorm asked for
    for what, model, kwargs in [("loose", loose, {}), ("plain", plain, {"sync_batchnorm": True})]:
        try:
            DynamixAccelerate(accelerator, batch_sizes=[4] * world, **kwargs).prepare(model)
        except ValueError as error:
            messages[what] = str(error)
    sharded = DynamixAccelerate(accelerator, batch_sizes=[4] * world, min_batch_size=0)
    sharded.prepare(shard(network("mlp"), mesh), DataLoader(IndexedDataset(150), batch_size=4))
    try:
        sharded.zero_loss()
    except RuntimeError as error:
        messages["zero_loss"] = str(error)
    torch.save(messages, out / f"errors-rank{accelerator.process_index}.pt")
    sys.exit(0)
if world == 2:
    initial, plan = [3, 7], {(0, 2): [0, 8], (0, 5): [1, 9], (1, 1): [5, 0], (1, 4): [2, 3]}
else:
    initial = [3, 7, 5]
    plan = {(0, 2): [6, 0, 4], (0, 5): [0, 9, 1], (1, 1): [4, 4, 4], (1, 4): [2, 0, 1]}

model = shard(network(architecture), init_device_mesh(accelerator.device.type, (world,)))
optimizer = make_optimizer(optimizer_name, model.parameters())
dynamix = DynamixAccelerate(accelerator, batch_sizes=initial, min_batch_size=0, seed=11)
loader = DataLoader(IndexedDataset(150), batch_size=4)
model, optimizer, loader = dynamix.prepare(model, optimizer, loader)
assert dynamix.sharded
assert not isinstance(model, torch.nn.parallel.DistributedDataParallel)

steps, probes = [], []
for epoch in range(2):
    for batch_idx, (index, x, y) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            probe = dynamix.global_mean(loss.detach())
            dynamix.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        steps.append((epoch, batch_idx, [] if dynamix.sits_out else index.tolist()))
        probes.append(None if dynamix.sits_out else float(probe))
        sizes = plan.get((epoch, batch_idx))
        if sizes is not None:
            dynamix.set_batch_sizes(sizes)

state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
torch.save(
    {"steps": steps, "probes": probes, "state": {k: v.detach().cpu() for k, v in state.items()}},
    out / f"{name}-rank{accelerator.process_index}.pt",
)
