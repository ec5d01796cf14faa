"""What the built-in data modules share: the checks of their split sizes and the loaders of their two splits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_dynamix._checks import require_int


def check_splits(num_samples: object, num_val_samples: object, batch_size: object, val_batch_size: object,
                 num_workers: object) -> None:  # fmt: skip
    """Refuse split sizes a data module cannot serve: a ``ValueError`` naming the argument and the value."""
    require_int("num_samples", num_samples, 1)
    require_int("num_val_samples", num_val_samples, 1)
    require_int("batch_size", batch_size, 1)
    require_int("val_batch_size", val_batch_size, 1)
    require_int("num_workers", num_workers, 0)


def split_loader(
    dataset: Dataset[Any],
    batch_size: int,
    num_workers: int,
    seed: int | None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader[Any]:
    """A split's DataLoader: reshuffled every epoch from ``seed`` (the training split), or in order (``seed=None``,
    validation), with ``num_workers`` workers kept across epochs."""
    shuffle = seed is not None
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        collate_fn=collate_fn,
        generator=torch.Generator().manual_seed(seed) if shuffle else None,
    )
