"""What is observed on every rank: step timers, system and network signals, gradient noise, ClusterState.

Nothing here knows Lightning's Trainer: the callbacks and the cluster simulator both build these types.
"""

from lightning_dynamix.metrics.clocks import (
    CudaEventClock,
    FakeDevice,
    FakeEventClock,
    HostClock,
    TimeSource,
    WaitTimer,
    time_source_for,
)
from lightning_dynamix.metrics.noise_scale import GradientNoiseScale
from lightning_dynamix.metrics.state import GLOBAL_FEATURES, LOCAL_FEATURES, ClusterState, WorkerMetrics
from lightning_dynamix.metrics.system import SystemMonitor, SystemSample
from lightning_dynamix.metrics.timers import IntervalSummary, StepClock, StepRecord

__all__ = [
    "GLOBAL_FEATURES",
    "LOCAL_FEATURES",
    "ClusterState",
    "CudaEventClock",
    "FakeDevice",
    "FakeEventClock",
    "GradientNoiseScale",
    "HostClock",
    "IntervalSummary",
    "StepClock",
    "StepRecord",
    "SystemMonitor",
    "SystemSample",
    "TimeSource",
    "WaitTimer",
    "WorkerMetrics",
    "time_source_for",
]
