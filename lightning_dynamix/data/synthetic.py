"""Synthetic workloads generated on the spot from a seed: nothing is downloaded.

* :class:`SyntheticClassificationDataset`: labelled samples, generated from a seed.
* :class:`DemoClassifier`: the MLP trained on them by ``dynamix bench overhead|hook`` and the tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_dynamix._checks import require_int
from lightning_dynamix._layers import mlp


class SyntheticClassificationDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Gaussian features labelled by a hidden random two-layer network.

    The labels follow a fixed "teacher" network, so a student model can learn them and its
    accuracy means something; ``label_noise`` of the labels are replaced by random classes.
    The same arguments always give the same data.

    Args:
        num_samples: number of samples.
        num_features: length of each feature vector.
        num_classes: number of classes.
        label_noise: fraction of labels replaced by a uniformly random class, in [0, 1).
        seed: seed of the features, the teacher and the noise.
        dtype: floating dtype of the features.
    """

    def __init__(
        self,
        num_samples: int = 4096,
        num_features: int = 32,
        num_classes: int = 4,
        label_noise: float = 0.05,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        require_int("num_samples", num_samples, 1)
        require_int("num_features", num_features, 1)
        require_int("num_classes", num_classes, 2)
        if not 0.0 <= label_noise < 1.0:
            raise ValueError(f"`label_noise` must lie in [0, 1), got {label_noise!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"`dtype` must be a floating dtype, got {dtype}")
        generator = torch.Generator().manual_seed(seed)
        features = torch.randn(num_samples, num_features, generator=generator, dtype=torch.float64)
        hidden = max(16, 2 * num_features)
        w1 = torch.randn(num_features, hidden, generator=generator, dtype=torch.float64) / num_features**0.5
        w2 = torch.randn(hidden, num_classes, generator=generator, dtype=torch.float64) / hidden**0.5
        labels = (torch.tanh(features @ w1) @ w2).argmax(dim=1)
        noisy = torch.rand(num_samples, generator=generator) < label_noise
        labels[noisy] = torch.randint(num_classes, (int(noisy.sum()),), generator=generator)
        self.features = features.to(dtype)
        self.labels = labels
        self.num_features = num_features
        self.num_classes = num_classes

    def __len__(self) -> int:
        return self.features.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features[index], self.labels[index]


def make_mlp(num_features: int, hidden: int, num_classes: int) -> nn.Sequential:
    """The demo's network: two hidden ReLU layers of width ``hidden``."""
    return mlp([num_features, hidden, hidden, num_classes])


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
