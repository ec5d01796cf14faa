"""Synthetic workloads generated on the spot from a seed: nothing is downloaded."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from lightning_dynamix._checks import require_int


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
