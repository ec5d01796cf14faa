"""Rebalance a heterogeneous cluster: measure every rank, decide new batch sizes, apply them.

Add :class:`DynamixCallback` to a ``Trainer`` that uses ``HeterogeneousDDPStrategy``. Every
``interval`` optimizer steps it gathers the :class:`~lightning_dynamix.metrics.ClusterState`
(one all_gather), rank 0 asks the controller for a :class:`~lightning_dynamix.control.Decision`,
the decision is broadcast, and every rank applies it through the strategy from the same step:
new per-rank batch sizes (the gradients stay the exact global-batch mean) and, with a
learning-rate scaling rule, a new learning rate for the new global batch.

Under ``FaultTolerantStrategy`` (torchft) each process is a replica of its own: the callback hands its
controller to the strategy (:class:`~lightning_dynamix.decisions.ReplicaBalancer`), where
every replica decides on the same measurements, carried with each step's sizes, keyed by machine; the
global batch stays the strategy's ``global_batch_size`` and the decision splits it.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_dynamix._checks import require_optional_int
from lightning_dynamix.callbacks.measurement import ClusterMetricsMonitor
from lightning_dynamix.control import BatchController, Decision
from lightning_dynamix.control.lr_scaling import validate_lr_scaling
from lightning_dynamix.decisions import (
    DecisionMaker,
    ReplicaBalancer,
    build_controller,
    check_world_size,
    wants_noise_scale,
)
from lightning_dynamix.elastic import gather_machine_ids
from lightning_dynamix.metrics import ClusterState
from lightning_dynamix.strategies.fault_tolerant import FaultTolerantStrategy


class DynamixCallback(ClusterMetricsMonitor):
    """Decides every rank's batch size from measurements, every ``interval`` optimizer steps.

    Args:
        controller: a controller name (``"static"``, ``"pid"``, ``"goodput"``, ``"ppo"``: the policy
            that ships with the package) or an object with
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
            the scaling rule uses it (``"goodput"``, ``"ppo"``, ``"adascale"``).
        noise_scale_ema: decay of the noise scale's moving average over intervals, in [0, 1).
        log_per_rank: log each rank's batch size, times and throughput.
        finetune: with ``controller="ppo"``, keep training the policy on this job's own decisions
            (PPO updates on rank 0); the updated policy is saved with the checkpoints.
        memory_margin: on a GPU, the share of its memory kept free when the largest batch it holds is derived
            from the peak bytes per sample measured; every decision keeps each rank within it (and within the
            strategy's ``batch_size_caps``). ``None``: not measured.

    Raises:
        ValueError: for an unknown controller name or scaling rule, an interval < 1, bounds that
            contradict each other, or ``controller_kwargs`` with a controller object.
        MisconfigurationException: at set-up, with a strategy other than ``HeterogeneousDDPStrategy``,
            bounds outside the strategy's, or more ranks than the controller can decide for (a
            policy trained for fewer).

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
        finetune: bool = False,
        memory_margin: float | None = 0.1,
    ) -> None:
        require_optional_int("min_batch_size", min_batch_size, 0)
        require_optional_int("max_batch_size", max_batch_size, max(min_batch_size or 1, 1), "min_batch_size")
        self.lr_scaling = validate_lr_scaling(lr_scaling)
        self.controller, self.controller_name = build_controller(
            controller, controller_kwargs, min_batch_size, max_batch_size, self.lr_scaling, finetune
        )
        if gradient_noise_scale is None:
            gradient_noise_scale = wants_noise_scale(self.controller, self.lr_scaling)
        super().__init__(
            interval=interval,
            warmup_steps=warmup_steps,
            gradient_noise_scale=gradient_noise_scale,
            noise_scale_ema=noise_scale_ema,
            log_per_rank=log_per_rank,
            memory_margin=memory_margin,
        )
        self.min_batch_size = min_batch_size
        self.max_batch_size = max_batch_size
        self.maker = DecisionMaker(self.controller, self.controller_name, self.lr_scaling, "DynamixCallback")
        self._machine_ids: list[str] | None = None
        self._fault_tolerant: FaultTolerantStrategy | None = None
        self._logged = 0  # records of the fault-tolerant replica's decisions already logged

    @property
    def lr_scale(self) -> float:
        """The learning-rate scale in force, relative to the learning rate at the start of training."""
        return self.maker.lr_scale

    @property
    def base_global_batch(self) -> int | None:
        """The global batch at the start of training: what the learning-rate rule is relative to."""
        return self.maker.base_global_batch

    # ------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and isinstance(trainer.strategy, FaultTolerantStrategy):
            self._setup_fault_tolerant(trainer.strategy)
            return
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        strategy = self._strategy_or_fail()
        # which machine every rank is: a resumed job keeps what it learnt about the machines that stay
        self._machine_ids = gather_machine_ids(trainer.local_rank)
        self.maker.join(self._machine_ids)
        strategy.resume_weights = self.maker.resume_weights
        try:
            check_world_size(self.controller, trainer.world_size)
        except ValueError as error:
            raise MisconfigurationException(str(error)) from None
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

    def _setup_fault_tolerant(self, strategy: FaultTolerantStrategy) -> None:
        if self.lr_scaling != "none":
            raise MisconfigurationException(
                f"DynamixCallback(lr_scaling={self.lr_scaling!r}) under FaultTolerantStrategy: the global batch is"
                " fixed there (the strategy's global_batch_size), so the learning rate has nothing to follow;"
                " use lr_scaling='none'."
            )
        strategy.balancer = ReplicaBalancer(
            self.maker,
            interval=self.interval,
            warmup_steps=self.warmup_steps,
            min_batch_size=max(1, self.min_batch_size or 1),
            max_batch_size=self.max_batch_size,
            history=self.history,
        )
        self._fault_tolerant = strategy

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
        if self._fault_tolerant is not None:
            return
        super().on_train_start(trainer, pl_module)
        if self.maker.base_global_batch is None:
            self.maker.base_global_batch = sum(self._strategy_or_fail().batch_sizes or ())

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._fault_tolerant is None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        for record in self.history[self._logged :]:  # the replica's decisions since (made inside its steps)
            self._log(trainer, record)
        self._logged = len(self.history)

    # ------------------------------------------------------------------ deciding
    @override
    def decide_and_apply(self, trainer: Trainer, pl_module: LightningModule, state: ClusterState) -> Decision:
        strategy = self._strategy_or_fail()
        current = list(strategy.batch_sizes or state.batch_sizes)
        decision = self.maker.decide(state, current, trainer.is_global_zero, strategy.root_device)
        if list(decision.batch_sizes) != current:
            strategy.set_batch_sizes(decision.batch_sizes, decision.from_step)
        self.maker.apply_lr_scale(decision, trainer.optimizers)
        return decision

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        # the batch sizes themselves are in the training DataLoader's state (the sampler's schedule)
        return {**super().state_dict(), **self.maker.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.maker.load_state_dict(state_dict)
        if self._machine_ids is not None:  # restored after setup: carry the controller over to this group
            self.maker.join(self._machine_ids)
