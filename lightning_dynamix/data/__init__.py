"""Data: per-rank batch sampling over one global schedule, and built-in synthetic workloads."""

from lightning_dynamix.data.loader import HeterogeneousDataLoader
from lightning_dynamix.data.sampler import EpochPermutation, HeterogeneousBatchSampler
from lightning_dynamix.data.schedule import EpochSchedule, final_step_sizes, validate_batch_sizes
from lightning_dynamix.data.synthetic import SyntheticClassificationDataset
from lightning_dynamix.data.workloads import (
    DEFAULT_TARGET_ACCURACY,
    ClassificationDataModule,
    ClassificationTask,
    GaussianMixtureClassificationDataset,
)

__all__ = [
    "DEFAULT_TARGET_ACCURACY",
    "ClassificationDataModule",
    "ClassificationTask",
    "EpochPermutation",
    "EpochSchedule",
    "GaussianMixtureClassificationDataset",
    "HeterogeneousBatchSampler",
    "HeterogeneousDataLoader",
    "SyntheticClassificationDataset",
    "final_step_sizes",
    "validate_batch_sizes",
]
