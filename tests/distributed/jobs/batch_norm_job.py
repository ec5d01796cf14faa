"""Trains a model with BatchNorm1d and BatchNorm2d on uneven, changing per-rank sizes; every rank saves what it saw.

Usage: python batch_norm_job.py OUT_DIR  (three ranks)

With ``sync_batchnorm=True`` the statistics are the global batch's, so every rank's parameters and running
statistics must equal one process on the concatenated global batches (the test checks it). Sizes go to 0 on
one rank, then two, and to a single sample on a rank (the global statistics need no more).
"""

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from common import IndexedDataset, Resizer, batch_norm_network, make_optimizer, quiet_trainer
from lightning.pytorch import Callback, LightningModule
from torch.utils.data import DataLoader

from lightning_dynamix import EmptyBatch, HeterogeneousDDPStrategy

out = Path(sys.argv[1])
NUM_SAMPLES = 150
PLAN = {(0, 1): [0, 9, 6], (0, 4): [1, 8, 0], (0, 7): [5, 5, 5], (1, 2): [0, 7, 0], (1, 5): [6, 1, 4]}


class BatchNormNet(LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.net = batch_norm_network(0)

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return make_optimizer(self.optimizer, self.parameters())

    def train_dataloader(self):
        return DataLoader(IndexedDataset(NUM_SAMPLES), batch_size=5)


class Steps(Callback):
    def __init__(self) -> None:
        self.steps: list[tuple[int, int, list[int]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        indices = [] if isinstance(batch, EmptyBatch) else batch[0].tolist()
        self.steps.append((trainer.current_epoch, batch_idx, indices))


def fit(name: str, optimizer: str, **strategy_kwargs) -> None:
    steps = Steps()
    strategy = HeterogeneousDDPStrategy(
        batch_sizes=[3, 7, 5], min_batch_size=0, seed=5, timeout=timedelta(seconds=60), **strategy_kwargs
    )
    trainer = quiet_trainer(
        devices=3, strategy=strategy, sync_batchnorm=True, callbacks=[steps, Resizer(PLAN)], max_epochs=2
    )
    model = BatchNormNet(optimizer)
    trainer.fit(model)
    torch.save(
        {
            "steps": steps.steps,
            "state": {k: v.detach().cpu().clone() for k, v in model.net.state_dict().items()},
            "layers": [type(m).__name__ for m in model.net],
        },
        out / f"{name}-rank{trainer.global_rank}.pt",
    )


fit("sgd", "sgd")
fit("adam", "adam")
# DDP's find_unused_parameters keeps every rank in the all-reduce: a rank without samples joins it with a zero
# gradient (it does not leave the step), and still misses the running statistics' update
fit("sgd-joined", "sgd", find_unused_parameters=True)
