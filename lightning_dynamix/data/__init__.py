"""Data: per-rank batch sampling over one global schedule, and built-in synthetic workloads (classification, CTR)."""

from lightning_dynamix.data.chunks import ChunkLayout
from lightning_dynamix.data.ctr import (
    CRITEO_LIKE_TABLE_SIZES,
    CTRDataModule,
    CTRSample,
    CTRSamples,
    CTRSpec,
    SyntheticCTRDataset,
    collate_ctr,
)
from lightning_dynamix.data.items import ItemCounter, LabelTokens
from lightning_dynamix.data.loader import EmptyBatch, HeterogeneousDataLoader
from lightning_dynamix.data.sampler import EpochPermutation, HeterogeneousBatchSampler
from lightning_dynamix.data.schedule import EpochSchedule, final_step_sizes, validate_batch_sizes
from lightning_dynamix.data.streaming import StreamingView
from lightning_dynamix.data.synthetic import SyntheticClassificationDataset
from lightning_dynamix.data.workloads import (
    DEFAULT_TARGET_ACCURACY,
    ClassificationDataModule,
    ClassificationTask,
    GaussianMixtureClassificationDataset,
)

__all__ = [
    "CRITEO_LIKE_TABLE_SIZES",
    "DEFAULT_TARGET_ACCURACY",
    "CTRDataModule",
    "CTRSample",
    "CTRSamples",
    "CTRSpec",
    "ChunkLayout",
    "ClassificationDataModule",
    "ClassificationTask",
    "EmptyBatch",
    "EpochPermutation",
    "EpochSchedule",
    "GaussianMixtureClassificationDataset",
    "HeterogeneousBatchSampler",
    "HeterogeneousDataLoader",
    "ItemCounter",
    "LabelTokens",
    "StreamingView",
    "SyntheticCTRDataset",
    "SyntheticClassificationDataset",
    "collate_ctr",
    "final_step_sizes",
    "validate_batch_sizes",
]
