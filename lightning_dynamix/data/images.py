"""A built-in image workload with BatchNorm: synthetic images and a small ResNet-style network; nothing is downloaded.

Most models trained on heterogeneous clusters have BatchNorm layers (ResNets above all), whose training
statistics come from each rank's own batch: with uneven per-rank batches they are what makes a rank of
one sample fail and an uneven split train another model than one process would. This workload puts
such a model under every benchmark that takes ``--architecture resnet``.

* :class:`SyntheticImageDataset`: ``channels x size x size`` images of ``num_classes`` classes, generated
  from a seed. Each class has a template, a sum of a few random oriented gratings in every channel; a
  sample is its class's template shifted by a random offset (circularly, up to ``max_shift`` pixels),
  scaled by a random contrast and buried in Gaussian noise. Telling the classes apart needs features
  that do not depend on where the pattern lies: convolutions learn them over several epochs.
* :class:`ImageClassificationDataModule`: disjoint training and validation splits of one generated set.
* :class:`ResNet`: a stem convolution and three stages of one basic residual block each (widths ``w``,
  ``2w``, ``4w``, the last two halving the resolution), every convolution followed by ``BatchNorm2d``,
  then global average pooling and a linear classifier (:class:`~lightning_dynamix.data.workloads.ClassificationTask`
  with ``architecture="resnet"``).

On one CPU thread, a forward and backward pass of 64 images of 3x16x16 through the default ResNet
(width 16) takes about 25 ms.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset
from typing_extensions import override

from lightning_dynamix._checks import require_int, require_number
from lightning_dynamix.data.splits import check_splits, split_loader

Batch = tuple[torch.Tensor, torch.Tensor]


class SyntheticImageDataset(Dataset[Batch]):
    """Images of shifted, noisy class templates (see the module's docstring); float32 ``(channels, size, size)``.

    Args:
        num_samples: images to generate.
        num_classes: classes (labels ``0 .. num_classes - 1``, drawn uniformly).
        channels: colour channels.
        size: height and width in pixels.
        gratings: oriented gratings summed into each class's template, per channel.
        max_shift: largest shift of a template in each direction, pixels.
        noise: standard deviation of the added Gaussian noise (the templates have unit standard deviation).
        seed: seed of the templates and the samples.
    """

    def __init__(
        self,
        num_samples: int,
        num_classes: int = 10,
        channels: int = 3,
        size: int = 16,
        gratings: int = 3,
        max_shift: int = 4,
        noise: float = 3.0,
        seed: int = 0,
    ) -> None:
        require_int("num_samples", num_samples, 1)
        require_int("num_classes", num_classes, 2)
        require_int("channels", channels, 1)
        require_int("size", size, 4)
        require_int("gratings", gratings, 1)
        require_int("max_shift", max_shift, 0)
        if max_shift >= size:
            raise ValueError(f"`max_shift` must be below `size` ({size}), got {max_shift}")
        require_number("noise", noise, 0.0)
        require_int("seed", seed, 0)
        generator = torch.Generator().manual_seed(seed)
        self.templates = _templates(num_classes, channels, size, gratings, generator)
        self.labels = torch.randint(num_classes, (num_samples,), generator=generator)
        shifts = torch.randint(-max_shift, max_shift + 1, (num_samples, 2), generator=generator)
        contrast = 0.6 + 0.8 * torch.rand(num_samples, generator=generator)
        images = torch.empty(num_samples, channels, size, size)
        for i in range(num_samples):
            template = self.templates[self.labels[i]]
            images[i] = torch.roll(template, shifts=(int(shifts[i, 0]), int(shifts[i, 1])), dims=(1, 2)) * contrast[i]
        images += noise * torch.randn(images.shape, generator=generator)
        self.images = images
        self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Batch:
        return self.images[index], self.labels[index]


def _templates(num_classes: int, channels: int, size: int, gratings: int, generator: torch.Generator) -> torch.Tensor:
    """``(num_classes, channels, size, size)``: sums of periodic oriented gratings, each normalised to unit std."""
    coords = torch.arange(size, dtype=torch.float32)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")
    templates = torch.zeros(num_classes, channels, size, size)
    for k in range(num_classes):
        for c in range(channels):
            for _ in range(gratings):
                # integer frequencies: the pattern is periodic over the image, so a circular shift keeps it whole
                fx, fy = (int(v) for v in torch.randint(-3, 4, (2,), generator=generator))
                if fx == 0 and fy == 0:
                    fx = 1
                phase = float(torch.rand((), generator=generator)) * 2 * math.pi
                templates[k, c] += torch.cos(2 * math.pi * (fx * rows + fy * cols) / size + phase)
        templates[k] /= templates[k].std()
    return templates


class ImageClassificationDataModule(LightningDataModule):
    """Training and validation splits of one :class:`SyntheticImageDataset` (the first ``num_samples`` train).

    Every process generates the same set from ``seed``. The training DataLoader shuffles with a plain
    sampler, which ``HeterogeneousDDPStrategy`` replaces with a per-rank batch sampler.

    Args:
        num_samples: training images.
        num_val_samples: validation images.
        batch_size: images per training batch (per rank; the strategy may override it).
        val_batch_size: images per validation batch.
        num_workers: DataLoader worker processes.
        seed: seed of the images and the training shuffle.
        **dataset_kwargs: :class:`SyntheticImageDataset`'s other arguments (``num_classes``, ``size``, ``noise``...).
    """

    def __init__(
        self,
        num_samples: int = 8192,
        num_val_samples: int = 2048,
        batch_size: int = 64,
        val_batch_size: int = 512,
        num_workers: int = 0,
        seed: int = 0,
        **dataset_kwargs: object,
    ) -> None:
        super().__init__()
        check_splits(num_samples, num_val_samples, batch_size, val_batch_size, num_workers)
        require_int("seed", seed, 0)
        self.save_hyperparameters()
        self.dataset_kwargs = dataset_kwargs
        self.dataset: SyntheticImageDataset | None = None

    @override
    def setup(self, stage: str) -> None:
        if self.dataset is None:
            h = self.hparams
            total = h.num_samples + h.num_val_samples
            self.dataset = SyntheticImageDataset(total, seed=h.seed, **self.dataset_kwargs)  # type: ignore[arg-type]

    def _generated(self) -> SyntheticImageDataset:
        if self.dataset is None:
            self.setup("fit")
        assert self.dataset is not None
        return self.dataset

    @override
    def train_dataloader(self) -> DataLoader[Batch]:
        h = self.hparams
        return split_loader(Subset(self._generated(), range(h.num_samples)), h.batch_size, h.num_workers, h.seed)

    @override
    def val_dataloader(self) -> DataLoader[Batch]:
        h = self.hparams
        validation = Subset(self._generated(), range(h.num_samples, h.num_samples + h.num_val_samples))
        return split_loader(validation, h.val_batch_size, h.num_workers, seed=None)


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a shortcut (a strided 1x1 convolution where the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet for ``(channels, size, size)`` images: a stem, three stages of widths ``width x (1, 2, 4)``."""

    def __init__(self, num_classes: int = 10, channels: int = 3, width: int = 16) -> None:
        super().__init__()
        require_int("num_classes", num_classes, 2)
        require_int("channels", channels, 1)
        require_int("width", width, 1)
        self.stem = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.stages = nn.Sequential(
            ResidualBlock(width, width, 1), ResidualBlock(width, 2 * width, 2), ResidualBlock(2 * width, 4 * width, 2)
        )
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean(dim=(2, 3)))
