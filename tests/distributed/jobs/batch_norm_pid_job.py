"""A BatchNorm model, pid and a rank emulated 40 times slower (its share would be under one sample): pid must
never give a rank 1 sample.

Usage: python batch_norm_pid_job.py OUT_DIR  (two ranks)
"""

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from common import quiet_trainer
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynamix import DynamixCallback, HeterogeneityEmulator, HeterogeneousDDPStrategy

out = Path(sys.argv[1])


class Classifier(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(
            torch.randn(1000, 8, generator=generator), torch.randint(0, 2, (1000,), generator=generator)
        )
        return DataLoader(data, batch_size=16)


dynamix = DynamixCallback("pid", interval=3, warmup_steps=2)
strategy = HeterogeneousDDPStrategy(batch_sizes=[16, 16], timeout=timedelta(seconds=60))
trainer = quiet_trainer(
    devices=2,
    strategy=strategy,
    precision="32-true",
    callbacks=[HeterogeneityEmulator(factors=[1.0, 40.0]), dynamix],
    max_epochs=1,
)
trainer.fit(Classifier())
torch.save(
    {
        "sizes": [list(r.state.batch_sizes) for r in dynamix.history],
        "decided": [list(r.decision.batch_sizes) for r in dynamix.history if r.decision is not None],
        "global_step": trainer.global_step,
        "num_training_batches": trainer.num_training_batches,
        "min_batch_size": strategy.min_batch_size,
    },
    out / f"pid-rank{trainer.global_rank}.pt",
)
