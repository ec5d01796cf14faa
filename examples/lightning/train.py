"""A LightningModule and DataModule, untouched, trained with the strategy chosen in a YAML config.

    python examples/lightning/train.py fit --config examples/lightning/class_path.yaml
    python examples/lightning/train.py fit --config examples/lightning/registered_name.yaml
    python examples/lightning/train.py fit --config examples/lightning/dynamix.yaml

Lightning starts the other processes itself (``devices: 2`` in the config).
"""

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, random_split

import lightning_dynamix  # noqa: F401  registers the "heterogeneous_ddp" strategy name
from lightning_dynamix.data import SyntheticClassificationDataset


class Classifier(LightningModule):
    def __init__(
        self, num_features: int = 32, num_classes: int = 4, hidden: int = 64, depth: int = 1, lr: float = 0.05
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        for width in [num_features] + [hidden] * (depth - 1):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(hidden, num_classes))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class SyntheticData(LightningDataModule):
    def __init__(self, num_samples: int = 4096, num_features: int = 32, num_classes: int = 4, batch_size: int = 32):
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        h = self.hparams
        data = SyntheticClassificationDataset(h.num_samples, h.num_features, h.num_classes, seed=0)
        self.train_set, self.val_set = random_split(data, [0.9, 0.1], generator=torch.Generator().manual_seed(0))

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


if __name__ == "__main__":
    torch.set_num_threads(1)  # the processes of `devices: 2` share this machine's cores
    cli = LightningCLI(Classifier, SyntheticData)
    if cli.trainer.is_global_zero:
        strategy = cli.trainer.strategy
        print(f"trained with {type(strategy).__name__}, per-rank batch sizes {strategy.batch_sizes}")
