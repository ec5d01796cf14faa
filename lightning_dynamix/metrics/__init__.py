"""What is observed on every rank: step timers, system and network signals, gradient noise, ClusterState.

Nothing here knows Lightning's Trainer: the callbacks and the cluster simulator both build these types.
"""

from typing import Any

from lightning_dynamix.metrics.clocks import (
    CudaEventClock,
    HostClock,
    TimeSource,
    WaitTimer,
    time_source_for,
)
from lightning_dynamix.metrics.state import GLOBAL_FEATURES, LOCAL_FEATURES, ClusterState, WorkerMetrics
from lightning_dynamix.metrics.system import SystemMonitor, SystemSample
from lightning_dynamix.metrics.timers import IntervalSummary, StepClock, StepRecord

__all__ = [
    "GLOBAL_FEATURES",
    "LOCAL_FEATURES",
    "ClusterState",
    "CudaEventClock",
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

_MOVED_TO_TESTING = ("FakeDevice", "FakeEventClock")


def __getattr__(name: str) -> Any:
    # imported when first asked for: it needs torchmetrics (which imports matplotlib), and the embedding
    # servers, which import the clocks, start without either
    if name == "GradientNoiseScale":
        from lightning_dynamix.metrics.noise_scale import GradientNoiseScale

        return GradientNoiseScale
    # the test doubles moved to lightning_dynamix.testing; this import keeps working, with a warning, for a release
    if name in _MOVED_TO_TESTING:
        import warnings

        from lightning_dynamix import testing

        warnings.warn(
            f"`from lightning_dynamix.metrics import {name}` is deprecated and will be removed in the next release:"
            f" import it from lightning_dynamix.testing (test doubles are not part of the runtime API)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(testing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
