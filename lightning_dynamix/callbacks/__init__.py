"""Lightning callbacks: the decision loop, a measurement-only monitor, and a heterogeneity emulator."""

from lightning_dynamix.callbacks.dynamix import DynamixCallback
from lightning_dynamix.callbacks.emulator import HeterogeneityEmulator
from lightning_dynamix.callbacks.measurement import ClusterMetricsMonitor, IntervalRecord

__all__ = ["ClusterMetricsMonitor", "DynamixCallback", "HeterogeneityEmulator", "IntervalRecord"]
