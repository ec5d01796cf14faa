"""Lightning strategies; importing this package registers their names with Lightning."""

from lightning_dynamix.strategies.fault_tolerant import FaultTolerantStrategy
from lightning_dynamix.strategies.heterogeneous_ddp import HeterogeneousDDPStrategy
from lightning_dynamix.strategies.heterogeneous_fsdp import HeterogeneousFSDPStrategy
from lightning_dynamix.strategies.layer_offload import HeterogeneousLayerOffloadStrategy, LayerOffloadStrategy
from lightning_dynamix.strategies.layer_sync import GlobalBatchNormSync
from lightning_dynamix.strategies.per_rank import PerRankBatchStrategy

__all__ = [
    "FaultTolerantStrategy",
    "GlobalBatchNormSync",
    "HeterogeneousDDPStrategy",
    "HeterogeneousFSDPStrategy",
    "HeterogeneousLayerOffloadStrategy",
    "LayerOffloadStrategy",
    "PerRankBatchStrategy",
]
