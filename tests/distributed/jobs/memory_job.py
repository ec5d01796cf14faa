"""Trains with a rank whose (emulated) device memory holds fewer samples than it is given; saves what it trained.

Usage: python memory_job.py OUT_DIR  (two ranks)

Rank 1's memory holds 9 samples. A resize gives it 10 mid-epoch, a start gives it 12 at the first step, and pid
pushes samples to it as the fast rank: each time the step runs out of memory, is split anew within rank 1's new
cap and trained again. Every rank saves the indices each step trained (the last attempt's), its parameters, the
caps and the states the callback gathered; the test compares the parameters with one process.
"""

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from common import IndexedDataset, Resizer, VirtualCompute, make_network, make_optimizer, quiet_trainer
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader

from lightning_dynamix import DynamixCallback, HeterogeneityEmulator, HeterogeneousDDPStrategy

out = Path(sys.argv[1])
NUM_SAMPLES = 150
LIMITS = [None, 9]


class Net(LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.net = make_network(0)
        self.optimizer = optimizer
        self.trained: dict[tuple[int, int], list[int]] = {}

    def training_step(self, batch, batch_idx):
        indices, x, y = batch
        self.trained[(self.current_epoch, batch_idx)] = indices.tolist()  # a retried step: the last attempt's
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return make_optimizer(self.optimizer, self.parameters())

    def train_dataloader(self):
        return DataLoader(IndexedDataset(NUM_SAMPLES), batch_size=4)


def fit(name: str, optimizer: str, sizes: list[int], callbacks: list, max_epochs: int = 2) -> None:
    strategy = HeterogeneousDDPStrategy(batch_sizes=sizes, seed=3, timeout=timedelta(seconds=60))
    emulator = HeterogeneityEmulator(factors=[1.0, 1.0], memory_limits=LIMITS)
    trainer = quiet_trainer(devices=2, strategy=strategy, callbacks=[*callbacks, emulator], max_epochs=max_epochs)
    model = Net(optimizer)
    trainer.fit(model)
    history = next((c.history for c in callbacks if isinstance(c, DynamixCallback)), [])
    torch.save(
        {
            "steps": [(e, b, indices) for (e, b), indices in sorted(model.trained.items())],
            "params": {k: v.detach().cpu().clone() for k, v in model.net.state_dict().items()},
            "caps": strategy.current_batch_size_caps,
            "recovered": strategy.steps_recovered_from_out_of_memory,
            "gathered_caps": [[w.max_batch_size for w in r.state.workers] for r in history],
            "decided": [list(r.decision.batch_sizes) for r in history if r.decision is not None],
        },
        out / f"{name}-rank{trainer.global_rank}.pt",
    )


# a resize past rank 1's memory mid-epoch, and later sizes that fit
fit("sgd", "sgd", [4, 4], [Resizer({(0, 2): [2, 10], (0, 8): [6, 6], (1, 3): [8, 4]})])
fit("adam", "adam", [4, 4], [Resizer({(0, 2): [2, 10], (0, 8): [6, 6], (1, 3): [8, 4]})])
# the very first step: nothing trained yet
fit("first-step", "sgd", [2, 12], [], max_epochs=1)
# pid moves samples to rank 1, five times as fast as rank 0 (on a virtual clock: the same decisions on every run),
# until its memory stops it: it asks 10 of 12, one more than the memory holds
fit(
    "pid",
    "sgd",
    [6, 6],
    [
        VirtualCompute(seconds_per_sample=1e-3, schedule=[[0, 0, 5.0]]),
        DynamixCallback("pid", interval=3, warmup_steps=2),
    ],
    max_epochs=3,
)
