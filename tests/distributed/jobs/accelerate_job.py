"""DynamixAccelerate under `accelerate launch` or `torchrun`: uneven, changing sizes; every rank saves what it saw.

Usage: accelerate launch --multi_gpu --num_processes 2 accelerate_job.py \
    OUT_DIR [OPTIMIZER] [WORKERS] [ACCUMULATE] [sit-out | litdata=DIR]

With ACCUMULATE > 1 the loop runs under ``accelerator.accumulate(model)`` and a controller also
changes the sizes every 2 optimizer steps, so sizes change inside accumulation windows too.
With ``sit-out`` (``min_batch_size=0``, no controller) each rank in turn trains alone while the
other sits steps out. With ``litdata=DIR`` the data is the same samples as a LitData dataset in DIR (written by
write_litdata.py), through a DataLoader over its ``StreamingDataset``.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from common import IndexedDataset, make_network, make_optimizer
from torch.utils.data import DataLoader

from lightning_dynamix.control import Decision
from lightning_dynamix.integrations.accelerate import DynamixAccelerate

out = Path(sys.argv[1])
optimizer_name = sys.argv[2] if len(sys.argv) > 2 else "sgd"
workers = int(sys.argv[3]) if len(sys.argv) > 3 else 0
NUM_SAMPLES = 150
# (epoch, step within the epoch) after which every rank calls set_batch_sizes
PLAN = {(0, 3): [6, 2], (0, 6): [1, 9], (1, 2): [5, 5], (1, 5): [2, 3]}

accumulate = int(sys.argv[4]) if len(sys.argv) > 4 else 1
mode = sys.argv[5] if len(sys.argv) > 5 else ""
sit_out = mode == "sit-out"
litdata_dir = mode.removeprefix("litdata=") if mode.startswith("litdata=") else None
if sit_out:
    PLAN = {(0, 3): [0, 8], (0, 6): [5, 0], (1, 2): [5, 5], (1, 5): [0, 5]}


class Alternate:
    """A controller that ignores the measurements: [4, 4], then [2, 8], then [4, 4]..."""

    def __init__(self):
        self.calls = 0

    def decide(self, state):
        self.calls += 1
        return Decision((4, 4) if self.calls % 2 else (2, 8))

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state_dict):
        self.calls = state_dict["calls"]


# gloo processes on a machine without GPUs
accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=accumulate)
controller = {"controller": Alternate(), "interval": 2, "warmup_steps": 1} if accumulate > 1 and not sit_out else {}
dynamix = DynamixAccelerate(accelerator, batch_sizes=[3, 7], seed=11, min_batch_size=0 if sit_out else 1, **controller)
if optimizer_name == "errors":  # what bad input says, on every rank
    messages = {}

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    for name, build in (
        ("prepared", lambda: dynamix.prepare(accelerator.prepare(make_network(0)))),
        ("iterable", lambda: dynamix.prepare(DataLoader(Stream(), batch_size=2))),
        ("too-small", lambda: dynamix.prepare(DataLoader(IndexedDataset(5), batch_size=2))),
        ("prepared-ok", lambda: dynamix.prepare(DataLoader(IndexedDataset(NUM_SAMPLES), batch_size=4))),
        # every rank passes other sizes: all must fail, none may train on its own schedule or hang
        ("disagree", lambda: dynamix.set_batch_sizes([2 + accelerator.process_index, 8])),
    ):
        try:
            build()
        except ValueError as error:
            messages[name] = str(error)
    torch.save(messages, out / f"errors{accelerator.process_index}.pt")
    accelerator.end_training()  # waits for every rank and closes the process group: no gloo thread outlives it
    sys.exit(0)

network = make_network(0)
optimizer = make_optimizer(optimizer_name, network.parameters())
if litdata_dir is None:
    loader = DataLoader(IndexedDataset(NUM_SAMPLES), batch_size=4, shuffle=True, num_workers=workers)
else:
    import litdata

    loader = DataLoader(litdata.StreamingDataset(litdata_dir), batch_size=4, num_workers=workers)
model, optimizer, loader = dynamix.prepare(network, optimizer, loader)

steps, synced = [], []
for epoch in range(2):
    for step, batch in enumerate(loader):
        with accelerator.accumulate(model):  # a no-op context without accumulation
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
        synced.append(accelerator.sync_gradients)
        dynamix.step(loss)
        if (epoch, step) in PLAN:
            dynamix.set_batch_sizes(PLAN[(epoch, step)])

torch.save(
    {
        "steps": steps,
        "synced": synced,
        "global_step": dynamix.global_step,
        "decision_steps": [r.step for r in dynamix.history],
        "params": {k: v.detach().cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()},
    },
    out / f"rank{accelerator.process_index}.pt",
)
accelerator.end_training()
