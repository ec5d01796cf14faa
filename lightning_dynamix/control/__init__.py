"""Controllers: turn one interval's :class:`~lightning_dynamix.metrics.state.ClusterState` into a :class:`Decision`.

* :class:`StaticController` keeps the sizes: the baseline.
* :class:`PIDController` equalises every rank's own step time at a fixed global batch (Tyagi &
  Sharma / OmniLearn, as a PID loop with a dead band).
* :class:`GoodputController` picks the global batch that maximises throughput x statistical
  efficiency (Pollux) and splits it so that every rank finishes together.
* :class:`PPOController` runs a policy trained with PPO in the cluster simulator (DYNAMIX);
  ``"ppo"`` loads the policy that ships with the package. :mod:`~lightning_dynamix.control.ppo` holds it
  with all it runs: the policy network, policy files and online fine-tuning.

:func:`make_controller` builds one by name (``"static"``, ``"pid"``, ``"goodput"``, ``"ppo"``), for configs and the
command line; :mod:`~lightning_dynamix.control.lr_scaling` holds the learning-rate rules.
"""

from __future__ import annotations

from typing import Any

from lightning_dynamix.control.allocation import (
    own_busy_time,
    per_rank_bounds,
    resolve_bounds,
    round_to_total,
    split_in_proportion,
)
from lightning_dynamix.control.base import BatchController, Decision
from lightning_dynamix.control.goodput import GoodputController, statistical_efficiency
from lightning_dynamix.control.lr_scaling import LR_SCALING_RULES, adascale_gain, lr_scale, validate_lr_scaling
from lightning_dynamix.control.pid import PIDController
from lightning_dynamix.control.ppo import PPOController
from lightning_dynamix.control.static import StaticController
from lightning_dynamix.control.step_times import equal_time_split, fit_step_time

CONTROLLERS: dict[str, type[Any]] = {
    "static": StaticController,
    "pid": PIDController,
    "goodput": GoodputController,
    "ppo": PPOController,
}


def make_controller(name: str, **kwargs: Any) -> BatchController:
    """Build the controller registered under ``name`` in :data:`CONTROLLERS` with ``kwargs``.

    Raises:
        ValueError: for an unknown name (naming ``name``, the value and the valid names), or any
            bad keyword argument of the controller.
    """
    if not isinstance(name, str) or name not in CONTROLLERS:
        raise ValueError(f"`name` must be one of {sorted(CONTROLLERS)} (the controller), got {name!r}.")
    cls = CONTROLLERS[name]
    try:
        return cls(**kwargs)
    except TypeError as error:
        raise ValueError(f"bad arguments {sorted(kwargs)} for controller {name!r}: {error}") from None


__all__ = [
    "CONTROLLERS",
    "LR_SCALING_RULES",
    "BatchController",
    "Decision",
    "GoodputController",
    "PIDController",
    "PPOController",
    "StaticController",
    "adascale_gain",
    "equal_time_split",
    "fit_step_time",
    "lr_scale",
    "make_controller",
    "own_busy_time",
    "per_rank_bounds",
    "resolve_bounds",
    "round_to_total",
    "split_in_proportion",
    "statistical_efficiency",
    "validate_lr_scaling",
]
