"""Measure every rank at batch boundaries and gather the cluster's state, with logging only.

:class:`ClusterMetricsMonitor` times every rank's steps (data, compute, synchronisation wait,
all-reduce time and bandwidth), samples its system (CPU, memory, GPU), tracks the loss and,
optionally, the gradient noise scale; every ``interval`` optimizer steps it gathers all ranks
into one :class:`~lightning_dynamix.metrics.ClusterState` (one all_gather) and logs it through
the Trainer's loggers: per-rank batch sizes, times and throughput, and the job's throughput
against the ideal ``sum_r s_r``. :class:`~lightning_dynamix.callbacks.DynamixCallback` does the
same and also decides new batch sizes.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_dynamix.control.base import Decision
from lightning_dynamix.decisions import IntervalMeter, IntervalRecord, interval_metrics
from lightning_dynamix.metrics import ClusterState
from lightning_dynamix.strategies import LayerOffloadStrategy, PerRankBatchStrategy

__all__ = ["ClusterMetricsMonitor", "IntervalRecord"]


def _heterogeneous_strategy(trainer: Trainer, owner: str) -> PerRankBatchStrategy:
    strategy = trainer.strategy
    if not isinstance(strategy, PerRankBatchStrategy):
        instead = (
            "HeterogeneousLayerOffloadStrategy (strategy='heterogeneous_layer_offload'), which offloads the tables"
            " the same way"
            if isinstance(strategy, LayerOffloadStrategy)
            else "Trainer(strategy='heterogeneous_ddp') (it also runs on a single device: devices=1), or"
            " strategy='heterogeneous_fsdp' for a model sharded with fully_shard"
        )
        raise MisconfigurationException(
            f"{owner} measures and resizes per-rank batches through HeterogeneousDDPStrategy or"
            f" HeterogeneousFSDPStrategy, but the Trainer uses {type(strategy).__name__}, which cannot. Use {instead}."
        )
    return strategy


class ClusterMetricsMonitor(Callback):
    """Logs every rank's measurements every ``interval`` optimizer steps; decides nothing.

    Args:
        interval: optimizer steps between two gathers of the cluster state (>= 1).
        warmup_steps: optimizer steps measured by nobody at the start (start-up is slow).
        gradient_noise_scale: also estimate the gradient noise scale (two reads of the gradients per
            synchronisation; needs at least two ranks, NaN otherwise).
        noise_scale_ema: decay of the noise scale's moving average over intervals, in [0, 1).
        log_per_rank: log each rank's batch size, times and throughput, not only the job's.
        memory_margin: on a GPU, the share of its memory kept free when the largest batch it holds is derived
            from the peak bytes per sample measured (gathered as ``max_batch_size``, which every decision
            respects); ``None``: not measured.

    The measurements are logged with the Trainer's loggers at the step they were gathered, under
    ``dynamix/...`` names; :attr:`history` keeps every gathered state on every rank.
    """

    def __init__(
        self,
        interval: int = 10,
        warmup_steps: int = 5,
        gradient_noise_scale: bool = True,
        noise_scale_ema: float = 0.9,
        log_per_rank: bool = True,
        memory_margin: float | None = 0.1,
    ) -> None:
        self.meter = IntervalMeter(interval, warmup_steps, bool(gradient_noise_scale), noise_scale_ema, memory_margin)
        self.interval = self.meter.interval
        self.warmup_steps = self.meter.warmup_steps
        self.measure_noise_scale = bool(gradient_noise_scale)
        self.noise_scale = self.meter.noise_scale
        self.log_per_rank = bool(log_per_rank)
        self._strategy: PerRankBatchStrategy | None = None

    @property
    def history(self) -> list[IntervalRecord]:
        """Every gathered state and decision, on every rank."""
        return self.meter.history

    # ------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._strategy = _heterogeneous_strategy(trainer, type(self).__name__)
        self._strategy.enable_step_clock()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = self._strategy_or_fail()
        assert strategy.step_clock is not None
        self.meter.start(strategy.step_clock, pl_module.device, trainer.global_step)
        if self.noise_scale is not None:
            strategy.enable_gradient_norms(self.meter.record_gradient_norms)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._strategy is not None and self.noise_scale is not None:
            self._strategy.enable_gradient_norms(None)

    def _strategy_or_fail(self) -> PerRankBatchStrategy:
        if self._strategy is None:
            raise RuntimeError(f"{type(self).__name__} is used before Trainer.fit set it up")
        return self._strategy

    # ------------------------------------------------------------------ per step
    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not self.meter.end_batch(loss, trainer.global_step):
            return
        state = self.gather_state(trainer, pl_module)
        decision = self.decide_and_apply(trainer, pl_module, state)
        record = IntervalRecord(trainer.global_step, self.meter.elapsed(), state, decision)
        self.history.append(record)
        self._log(trainer, record)
        self.meter.start_interval()

    @property
    def bounds(self) -> tuple[int, int | None]:
        """``(min_batch_size, max_batch_size)`` the gathered state carries: the strategy's."""
        strategy = self._strategy_or_fail()
        return strategy.min_batch_size, strategy.max_batch_size

    @property
    def least_batch_size(self) -> int:
        """The smallest size a rank that trains may be given: the strategy's (2 for a model with BatchNorm)."""
        return self._strategy_or_fail().least_batch_size

    def decide_and_apply(self, trainer: Trainer, pl_module: LightningModule, state: ClusterState) -> Decision | None:
        """Nothing to decide for a monitor; :class:`DynamixCallback` decides here."""
        return None

    # ------------------------------------------------------------------ gathering
    def gather_state(self, trainer: Trainer, pl_module: LightningModule) -> ClusterState:
        """Every rank's interval into one :class:`ClusterState`: a collective, call it on all ranks."""
        strategy = self._strategy_or_fail()
        optimizers = trainer.optimizers
        return self.meter.gather(
            rank=trainer.global_rank,
            step=trainer.global_step,
            epoch=trainer.current_epoch,
            lr=float(optimizers[0].param_groups[0]["lr"]) if optimizers else math.nan,
            sizes=strategy.current_batch_sizes or strategy.batch_sizes or (),
            bounds=self.bounds,
            device=strategy.root_device,
            least_batch_size=self.least_batch_size,
            batch_size_cap=(strategy.current_batch_size_caps or [None] * trainer.world_size)[trainer.global_rank],
        )

    # ------------------------------------------------------------------ logging
    def _log(self, trainer: Trainer, record: IntervalRecord) -> None:
        metrics = interval_metrics(record, self.log_per_rank)
        for logger in trainer.loggers:  # rank-zero-only inside the loggers
            logger.log_metrics(metrics, step=record.step)

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        return self.meter.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.meter.load_state_dict(state_dict)
