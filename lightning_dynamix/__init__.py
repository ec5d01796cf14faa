"""lightning-dynamix: fast data-parallel training on heterogeneous clusters.

Importing the package registers its Lightning strategies, so ``Trainer(strategy="heterogeneous_ddp")``
works.
"""

from lightning_dynamix.data import HeterogeneousBatchSampler, HeterogeneousDataLoader
from lightning_dynamix.distributed import SyncWindowWeighting, WeightedAllReduceState, weighted_allreduce_hook
from lightning_dynamix.strategies import HeterogeneousDDPStrategy

__version__ = "0.1.0"

__all__ = [
    "HeterogeneousBatchSampler",
    "HeterogeneousDDPStrategy",
    "HeterogeneousDataLoader",
    "SyncWindowWeighting",
    "WeightedAllReduceState",
    "__version__",
    "weighted_allreduce_hook",
]
