"""The training job behind ``dynamix demo`` and ``dynamix bench``: an MLP on synthetic data."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader

from lightning_dynamix.data import SyntheticClassificationDataset


def make_mlp(num_features: int, hidden: int, num_classes: int) -> nn.Sequential:
    """The demo's network: two hidden ReLU layers of width ``hidden``."""
    return nn.Sequential(
        nn.Linear(num_features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


class DemoClassifier(LightningModule):
    """A multi-layer perceptron classifier trained with SGD on :class:`SyntheticClassificationDataset`.

    Args:
        num_samples: training samples.
        num_features: input features per sample.
        num_classes: classes.
        hidden: width of the two hidden layers.
        batch_size: the DataLoader's batch size (the strategy may override it per rank).
        lr: SGD learning rate (momentum 0.9).
        num_workers: DataLoader worker processes.
        seed: seed of the data and the initial weights.
        sync_dist: average the logged training loss over ranks at every step (one all-reduce).
    """

    def __init__(
        self,
        num_samples: int = 8192,
        num_features: int = 32,
        num_classes: int = 4,
        hidden: int = 128,
        batch_size: int = 32,
        lr: float = 0.05,
        num_workers: int = 0,
        seed: int = 0,
        sync_dist: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.network = make_mlp(num_features, hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=self.hparams.sync_dist, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        dataset = SyntheticClassificationDataset(h.num_samples, h.num_features, h.num_classes, seed=h.seed)
        return DataLoader(
            dataset, batch_size=h.batch_size, num_workers=h.num_workers, persistent_workers=h.num_workers > 0
        )
