"""Rebalance a heterogeneous cluster: measure every rank, decide new batch sizes, apply them.

Add :class:`DynamixCallback` to a ``Trainer`` that uses ``HeterogeneousDDPStrategy``. Every
``interval`` optimizer steps it gathers the :class:`~lightning_dynamix.metrics.ClusterState`
(one all_gather), rank 0 asks the controller for a :class:`~lightning_dynamix.control.Decision`,
the decision is broadcast, and every rank applies it through the strategy from the same step:
new per-rank batch sizes (the gradients stay the exact global-batch mean) and, with a
learning-rate scaling rule, a new learning rate for the new global batch.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_dynamix._checks import require_optional_int
from lightning_dynamix.callbacks.measurement import ClusterMetricsMonitor
from lightning_dynamix.control import CONTROLLERS, BatchController, Decision, lr_scale, make_controller
from lightning_dynamix.control.lr_scaling import validate_lr_scaling
from lightning_dynamix.distributed import broadcast_floats
from lightning_dynamix.metrics import ClusterState

log = logging.getLogger(__name__)

# controllers that read the gradient noise scale: measured by default with them
_NOISE_SCALE_CONTROLLERS = ("goodput",)
_OK, _ERROR = 1.0, -1.0


class DynamixCallback(ClusterMetricsMonitor):
    """Decides every rank's batch size from measurements, every ``interval`` optimizer steps.

    Args:
        controller: a controller name (``"static"``, ``"pid"``, ``"goodput"``) or an object with
            ``decide(state) -> Decision``, ``state_dict()`` and ``load_state_dict()``.
        interval: optimizer steps between two decisions (>= 1).
        warmup_steps: optimizer steps before the first measured interval (start-up is slow).
        min_batch_size: the smallest size any rank may be given; default: the strategy's.
        max_batch_size: the largest size any rank may be given; default: the strategy's. Both must
            lie within the strategy's own bounds.
        lr_scaling: how the learning rate follows the global batch: ``"none"``, ``"linear"``,
            ``"sqrt"`` or ``"adascale"`` (relative to the global batch at the start of training;
            applied by multiplying every parameter group's learning rate by the change of scale).
            This rule decides, whatever scale a controller's decision carries.
        controller_kwargs: arguments for a controller given by name.
        gradient_noise_scale: estimate the gradient noise scale; default: when the controller or
            the scaling rule uses it (``"goodput"``, ``"adascale"``).
        noise_scale_ema: decay of the noise scale's moving average over intervals, in [0, 1).
        log_per_rank: log each rank's batch size, times and throughput.

    Raises:
        ValueError: for an unknown controller name or scaling rule, an interval < 1, bounds that
            contradict each other, or ``controller_kwargs`` with a controller object.
        MisconfigurationException: at set-up, with a strategy other than ``HeterogeneousDDPStrategy``
            or bounds outside the strategy's.

    A measurement that is not finite on some rank (a rank that reported no step in the interval)
    never reaches the controller: the current sizes are kept and a warning is logged once.
    """

    def __init__(
        self,
        controller: str | BatchController = "pid",
        interval: int = 10,
        warmup_steps: int = 5,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        lr_scaling: str = "none",
        controller_kwargs: dict[str, Any] | None = None,
        gradient_noise_scale: bool | None = None,
        noise_scale_ema: float = 0.9,
        log_per_rank: bool = True,
    ) -> None:
        require_optional_int("min_batch_size", min_batch_size, 1)
        require_optional_int("max_batch_size", max_batch_size, min_batch_size or 1, "min_batch_size")
        self.lr_scaling = validate_lr_scaling(lr_scaling)
        if isinstance(controller, str):
            if controller not in CONTROLLERS:
                raise ValueError(
                    f"`controller` must be one of {sorted(CONTROLLERS)} or a BatchController object, got {controller!r}"
                )
            kwargs = dict(controller_kwargs or {})
            if controller in ("pid", "goodput"):  # the static controller takes no arguments
                bounds = {"min_batch_size": min_batch_size, "max_batch_size": max_batch_size}
                kwargs.update({k: v for k, v in bounds.items() if v is not None and k not in kwargs})
                kwargs.setdefault("lr_scaling", lr_scaling)
            self.controller: BatchController = make_controller(controller, **kwargs)
            self.controller_name = controller
        elif isinstance(controller, BatchController):
            if controller_kwargs:
                raise ValueError(
                    "`controller_kwargs` configure a controller given by name; this controller is an object"
                    f" ({type(controller).__name__}): configure it directly. Got {controller_kwargs!r}."
                )
            self.controller = controller
            self.controller_name = type(controller).__name__
        else:
            raise ValueError(
                f"`controller` must be one of {sorted(CONTROLLERS)} or an object with decide(state),"
                f" state_dict() and load_state_dict(), got {controller!r}"
            )
        if gradient_noise_scale is None:
            gradient_noise_scale = (
                self.controller_name in _NOISE_SCALE_CONTROLLERS
                or self.lr_scaling == "adascale"
                or bool(getattr(self.controller, "needs_gradient_noise_scale", False))
            )
        super().__init__(
            interval=interval,
            warmup_steps=warmup_steps,
            gradient_noise_scale=gradient_noise_scale,
            noise_scale_ema=noise_scale_ema,
            log_per_rank=log_per_rank,
        )
        self.min_batch_size = min_batch_size
        self.max_batch_size = max_batch_size
        self.lr_scale = 1.0
        self.base_global_batch: int | None = None
        self._warned_not_finite = False

    # ------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        strategy = self._strategy_or_fail()
        low, high = strategy.min_batch_size, strategy.max_batch_size
        if self.min_batch_size is not None and self.min_batch_size < low:
            raise MisconfigurationException(
                f"DynamixCallback(min_batch_size={self.min_batch_size}) is below the strategy's"
                f" min_batch_size={low}; the strategy could not apply such a size. Use min_batch_size >= {low}."
            )
        if self.max_batch_size is not None and high is not None and self.max_batch_size > high:
            raise MisconfigurationException(
                f"DynamixCallback(max_batch_size={self.max_batch_size}) is above the strategy's"
                f" max_batch_size={high}; the strategy could not apply such a size. Use max_batch_size <= {high}."
            )
        if self.min_batch_size is not None and high is not None and self.min_batch_size > high:
            raise MisconfigurationException(
                f"DynamixCallback(min_batch_size={self.min_batch_size}) is above the strategy's"
                f" max_batch_size={high}: no size satisfies both."
            )

    @property
    @override
    def bounds(self) -> tuple[int, int | None]:
        """The effective ``(min_batch_size, max_batch_size)``: the callback's, else the strategy's."""
        strategy = self._strategy_or_fail()
        low = self.min_batch_size if self.min_batch_size is not None else strategy.min_batch_size
        high = self.max_batch_size if self.max_batch_size is not None else strategy.max_batch_size
        return low, high

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self.base_global_batch is None:
            self.base_global_batch = sum(self._strategy_or_fail().batch_sizes or ())

    # ------------------------------------------------------------------ deciding
    @override
    def decide_and_apply(self, trainer: Trainer, pl_module: LightningModule, state: ClusterState) -> Decision:
        strategy = self._strategy_or_fail()
        current = list(strategy.batch_sizes or state.batch_sizes)
        world = len(current)
        payload = [_OK, self.lr_scale, -1.0, *map(float, current)]
        message = ""
        if trainer.is_global_zero:
            try:
                decision = self._decide(state, current)
                payload = [_OK, decision.lr_scale, float(-1 if decision.from_step is None else decision.from_step)]
                payload += [float(b) for b in decision.batch_sizes]
            except Exception as err:  # every rank must leave the broadcast, then all fail alike
                message = f"{type(err).__name__}: {err}"
                payload = [_ERROR, 1.0, -1.0, *map(float, current)]
        payload = broadcast_floats(payload, device=strategy.root_device)
        if payload[0] == _ERROR:
            raise RuntimeError(
                f"DynamixCallback's controller {self.controller_name} failed on rank 0 at step {state.step}"
                + (f": {message}" if message else "; see rank 0's error.")
            )
        from_step = None if payload[2] < 0 else int(payload[2])
        decision = Decision(tuple(int(b) for b in payload[3 : 3 + world]), lr_scale=payload[1], from_step=from_step)
        if list(decision.batch_sizes) != current:
            strategy.set_batch_sizes(decision.batch_sizes, decision.from_step)
        if decision.lr_scale != self.lr_scale:
            ratio = decision.lr_scale / self.lr_scale
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] *= ratio
            self.lr_scale = decision.lr_scale
        return decision

    def _decide(self, state: ClusterState, current: list[int]) -> Decision:
        """Rank 0: the controller's decision, checked, with the learning-rate rule applied."""
        needed = ("compute_time", "step_time", "data_time")
        if not state.is_finite(needed):
            if not self._warned_not_finite:
                bad = [w.rank for w in state.workers if not all(math.isfinite(getattr(w, n)) for n in needed)]
                log.warning(
                    "DynamixCallback: ranks %s reported no complete step in the interval ending at step %d"
                    " (not finite measurements); keeping the current batch sizes %s. This warning is shown once;"
                    " a longer `interval` gives every rank time to report.",
                    bad,
                    state.step,
                    current,
                )
                self._warned_not_finite = True
            return Decision(tuple(current), lr_scale=self.lr_scale)
        decision = self.controller.decide(state)
        low, high = state.min_batch_size, state.max_batch_size
        sizes = list(decision.batch_sizes)
        if len(sizes) != len(current) or any(b < low or (high is not None and b > high) for b in sizes):
            raise ValueError(
                f"the controller decided batch sizes {sizes} for {len(current)} ranks; every size must lie in"
                f" [{low}, {high if high is not None else 'no limit'}]"
            )
        # the callback's rule decides the learning rate, whatever rule a controller object carries
        if self.base_global_batch is None:
            self.base_global_batch = sum(current)
        scale = lr_scale(self.lr_scaling, sum(sizes), self.base_global_batch, state.gradient_noise_scale)
        return Decision(tuple(sizes), lr_scale=scale, from_step=decision.from_step)

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        # the batch sizes themselves are in the training DataLoader's state (the sampler's schedule)
        state = super().state_dict()
        state.update(
            controller=self.controller.state_dict(),
            lr_scale=self.lr_scale,
            base_global_batch=self.base_global_batch,
            warned_not_finite=self._warned_not_finite,
        )
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.controller.load_state_dict(state_dict["controller"])
        self.lr_scale = float(state_dict["lr_scale"])
        self.base_global_batch = state_dict["base_global_batch"]
        self._warned_not_finite = bool(state_dict.get("warned_not_finite", False))
