"""Lightning callbacks: the decision loop, a measurement-only monitor, an emulator, preemption checkpoints."""

from lightning_dynamix.callbacks.dynamix import DynamixCallback
from lightning_dynamix.callbacks.emulator import HeterogeneityEmulator
from lightning_dynamix.callbacks.measurement import ClusterMetricsMonitor, IntervalRecord
from lightning_dynamix.callbacks.preemption import PreemptionCheckpoint
from lightning_dynamix.elastic import Preempted

__all__ = [
    "ClusterMetricsMonitor",
    "DynamixCallback",
    "HeterogeneityEmulator",
    "IntervalRecord",
    "Preempted",
    "PreemptionCheckpoint",
]
