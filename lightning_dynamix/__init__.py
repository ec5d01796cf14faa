"""lightning-dynamix: fast data-parallel training on heterogeneous clusters.

Importing the package registers its Lightning strategies, so ``Trainer(strategy="heterogeneous_ddp")``
and ``Trainer(strategy="layer_offload")`` work.
"""

from lightning_dynamix.callbacks import (
    ClusterMetricsMonitor,
    DynamixCallback,
    HeterogeneityEmulator,
    PreemptionCheckpoint,
)
from lightning_dynamix.control import (
    BatchController,
    Decision,
    GoodputController,
    PIDController,
    StaticController,
    make_controller,
)
from lightning_dynamix.data import EmptyBatch, HeterogeneousBatchSampler, HeterogeneousDataLoader
from lightning_dynamix.data.items import LabelTokens
from lightning_dynamix.distributed import SyncWindowWeighting, WeightedAllReduceState, weighted_allreduce_hook
from lightning_dynamix.metrics import ClusterState, GradientNoiseScale, WorkerMetrics
from lightning_dynamix.strategies import (
    HeterogeneousDDPStrategy,
    HeterogeneousFSDPStrategy,
    HeterogeneousLayerOffloadStrategy,
    LayerOffloadStrategy,
)

__version__ = "0.1.0"

__all__ = [
    "BatchController",
    "ClusterMetricsMonitor",
    "ClusterState",
    "Decision",
    "DynamixCallback",
    "EmptyBatch",
    "GoodputController",
    "GradientNoiseScale",
    "HeterogeneityEmulator",
    "HeterogeneousBatchSampler",
    "HeterogeneousDDPStrategy",
    "HeterogeneousDataLoader",
    "HeterogeneousFSDPStrategy",
    "HeterogeneousLayerOffloadStrategy",
    "LabelTokens",
    "LayerOffloadStrategy",
    "PIDController",
    "PreemptionCheckpoint",
    "StaticController",
    "SyncWindowWeighting",
    "WeightedAllReduceState",
    "WorkerMetrics",
    "__version__",
    "make_controller",
    "weighted_allreduce_hook",
]
