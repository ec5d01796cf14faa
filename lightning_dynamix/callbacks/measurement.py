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
import time
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_dynamix._checks import require_int
from lightning_dynamix.control.base import Decision
from lightning_dynamix.distributed import gather_floats
from lightning_dynamix.metrics import ClusterState, GradientNoiseScale, StepClock, SystemMonitor, WorkerMetrics
from lightning_dynamix.strategies import HeterogeneousDDPStrategy

NAN = float("nan")
_LOSS_HISTORY = 4  # intervals the loss slope is fitted over


@dataclass(frozen=True)
class IntervalRecord:
    """What happened at one decision point.

    Attributes:
        step: the optimizer step at which the state was gathered.
        time: seconds since training started.
        state: the gathered cluster state.
        decision: the decision taken there (``None`` for a monitor, which only logs).
    """

    step: int
    time: float
    state: ClusterState
    decision: Decision | None = None


def _heterogeneous_strategy(trainer: Trainer, owner: str) -> HeterogeneousDDPStrategy:
    strategy = trainer.strategy
    if not isinstance(strategy, HeterogeneousDDPStrategy):
        raise MisconfigurationException(
            f"{owner} measures and resizes per-rank batches through HeterogeneousDDPStrategy, but the Trainer"
            f" uses {type(strategy).__name__}, which cannot. Use Trainer(strategy='heterogeneous_ddp')"
            " (it also runs on a single device: devices=1)."
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
    ) -> None:
        self.interval = require_int("interval", interval, 1)
        self.warmup_steps = require_int("warmup_steps", warmup_steps, 0)
        self.measure_noise_scale = bool(gradient_noise_scale)
        self.noise_scale = GradientNoiseScale(ema_decay=noise_scale_ema) if self.measure_noise_scale else None
        self.log_per_rank = bool(log_per_rank)
        self.history: list[IntervalRecord] = []
        self._strategy: HeterogeneousDDPStrategy | None = None
        self._clock: StepClock | None = None
        self._system: SystemMonitor | None = None
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._loss_points: list[tuple[int, float]] = []
        self._last_global_step = -1
        self._started = 0.0

    # ------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._strategy = _heterogeneous_strategy(trainer, type(self).__name__)
        self._clock = self._strategy.enable_step_clock()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = pl_module.device
        self._system = SystemMonitor(device.index if device.type == "cuda" else None)
        if self.noise_scale is not None:
            self.noise_scale.to(device)
            self._strategy_or_fail().enable_gradient_norms(self._record_gradient_norms)
        self._last_global_step = trainer.global_step
        self._started = time.perf_counter()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._strategy is not None and self.noise_scale is not None:
            self._strategy.enable_gradient_norms(None)

    def _strategy_or_fail(self) -> HeterogeneousDDPStrategy:
        if self._strategy is None:
            raise RuntimeError(f"{type(self).__name__} is used before Trainer.fit set it up")
        return self._strategy

    def _record_gradient_norms(
        self, local_sq_norm: torch.Tensor, local_samples: int, global_sq_norm: torch.Tensor, global_samples: int
    ) -> None:
        assert self.noise_scale is not None
        self.noise_scale.update(local_sq_norm, local_samples, global_sq_norm, global_samples)

    # ------------------------------------------------------------------ per step
    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._clock is not None
        self._clock.step_end()
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            # summed on the loss's device: read back once per interval, not once per step
            if self._loss_sum is None:
                self._loss_sum = torch.zeros((), dtype=torch.float64, device=loss.device)
            self._loss_sum.add_(loss.detach().reshape(()))
            self._loss_count += 1
        step = trainer.global_step
        if step == self._last_global_step:
            return  # no optimizer step this batch (gradient accumulation)
        self._last_global_step = step
        if step <= self.warmup_steps:
            self._start_interval()
            return
        if (step - self.warmup_steps) % self.interval != 0:
            return
        state = self.gather_state(trainer, pl_module)
        decision = self.decide_and_apply(trainer, pl_module, state)
        record = IntervalRecord(step, time.perf_counter() - self._started, state, decision)
        self.history.append(record)
        self._log(trainer, record)
        self._start_interval()

    @property
    def bounds(self) -> tuple[int, int | None]:
        """``(min_batch_size, max_batch_size)`` the gathered state carries: the strategy's."""
        strategy = self._strategy_or_fail()
        return strategy.min_batch_size, strategy.max_batch_size

    def decide_and_apply(self, trainer: Trainer, pl_module: LightningModule, state: ClusterState) -> Decision | None:
        """Nothing to decide for a monitor; :class:`DynamixCallback` decides here."""
        return None

    def _start_interval(self) -> None:
        assert self._clock is not None
        self._clock.reset_interval()
        self._loss_sum, self._loss_count = None, 0
        if self.noise_scale is not None:
            self.noise_scale.reset()

    # ------------------------------------------------------------------ gathering
    def gather_state(self, trainer: Trainer, pl_module: LightningModule) -> ClusterState:
        """Every rank's interval into one :class:`ClusterState`: a collective, call it on all ranks."""
        strategy = self._strategy_or_fail()
        assert self._clock is not None
        assert self._system is not None
        summary = self._clock.summary()
        system = self._system.sample()
        sizes = strategy.current_batch_sizes or strategy.batch_sizes or ()
        batch_size = summary.batch_size if summary.steps else sizes[trainer.global_rank]
        loss = float(self._loss_sum) / self._loss_count if self._loss_sum is not None else NAN
        values = {
            "data_time": summary.data_time,
            "compute_time": summary.compute_time,
            "sync_wait": summary.sync_wait,
            "step_time": summary.step_time,
            "samples_per_s": summary.samples_per_s,
            "cpu_util": system.cpu_util,
            "mem_util": system.mem_util,
            "gpu_util": system.gpu_util,
            "gpu_mem_util": system.gpu_mem_util,
            "gpu_power_w": system.gpu_power_w,
            "gpu_temperature_c": system.gpu_temperature_c,
            "comm_time": summary.comm_time,
            "comm_bytes": summary.comm_bytes,
            "bandwidth": summary.bandwidth,
        }
        names = WorkerMetrics.float_fields()
        row = [float(batch_size), loss, *(values[name] for name in names)]
        rows = gather_floats(row, device=strategy.root_device)  # the interval's one all_gather
        workers = tuple(
            WorkerMetrics(rank, int(r[0]), **dict(zip(names, r[2:], strict=True))) for rank, r in enumerate(rows)
        )
        global_loss = _weighted_loss([(r[0], r[1]) for r in rows])
        if math.isfinite(global_loss):
            self._loss_points = [*self._loss_points, (trainer.global_step, global_loss)][-_LOSS_HISTORY:]
        noise_scale = NAN
        if self.noise_scale is not None:
            noise_scale = float(self.noise_scale.compute())  # declared-sum state: one more gather
        optimizers = trainer.optimizers
        lr = float(optimizers[0].param_groups[0]["lr"]) if optimizers else NAN
        low, high = self.bounds
        return ClusterState(
            workers=workers,
            step=trainer.global_step,
            epoch=trainer.current_epoch,
            loss=global_loss,
            loss_slope=_slope(self._loss_points),
            gradient_noise_scale=noise_scale,
            lr=lr,
            min_batch_size=low,
            max_batch_size=high,
        )

    # ------------------------------------------------------------------ logging
    def _log(self, trainer: Trainer, record: IntervalRecord) -> None:
        state = record.state
        metrics: dict[str, float] = {
            "dynamix/global_batch": float(state.global_batch),
            "dynamix/throughput": state.throughput,
            "dynamix/ideal_throughput": state.ideal_throughput,
            "dynamix/throughput_to_ideal": state.throughput / state.ideal_throughput,
            "dynamix/step_time": state.step_time,
            "dynamix/gradient_noise_scale": state.gradient_noise_scale,
            "dynamix/loss": state.loss,
            "dynamix/lr": state.lr,
            "dynamix/bandwidth": state.bandwidth,
        }
        if record.decision is not None:
            metrics["dynamix/lr_scale"] = record.decision.lr_scale
            for rank, size in enumerate(record.decision.batch_sizes):
                metrics[f"dynamix/rank_{rank}/next_batch_size"] = float(size)
        if self.log_per_rank:
            for w in state.workers:
                prefix = f"dynamix/rank_{w.rank}"
                metrics[f"{prefix}/batch_size"] = float(w.batch_size)
                metrics[f"{prefix}/data_time"] = w.data_time
                metrics[f"{prefix}/compute_time"] = w.compute_time
                metrics[f"{prefix}/sync_wait"] = w.sync_wait
                metrics[f"{prefix}/step_time"] = w.step_time
                metrics[f"{prefix}/samples_per_s"] = w.samples_per_s
                metrics[f"{prefix}/own_samples_per_s"] = w.own_samples_per_s
                metrics[f"{prefix}/comm_time"] = w.comm_time
                metrics[f"{prefix}/cpu_util"] = w.cpu_util
                metrics[f"{prefix}/mem_util"] = w.mem_util
                if math.isfinite(w.gpu_util):
                    metrics[f"{prefix}/gpu_util"] = w.gpu_util
                    metrics[f"{prefix}/gpu_mem_util"] = w.gpu_mem_util
                    metrics[f"{prefix}/gpu_power_w"] = w.gpu_power_w
                    metrics[f"{prefix}/gpu_temperature_c"] = w.gpu_temperature_c
        for logger in trainer.loggers:  # rank-zero-only inside the loggers
            logger.log_metrics(metrics, step=record.step)

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "loss_points": [list(p) for p in self._loss_points],
            "noise_scale": None if self.noise_scale is None else self.noise_scale.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loss_points = [(int(s), float(v)) for s, v in state_dict.get("loss_points", [])]
        saved = state_dict.get("noise_scale")
        if saved is not None and self.noise_scale is not None:
            self.noise_scale.load_state_dict(saved)


def _weighted_loss(pairs: list[tuple[float, float]]) -> float:
    """The global loss: ranks' interval means weighted by their batch sizes."""
    finite = [(b, v) for b, v in pairs if math.isfinite(v)]
    if len(finite) != len(pairs) or not finite:
        return NAN
    return sum(b * v for b, v in finite) / sum(b for b, _ in finite)


def _slope(points: list[tuple[int, float]]) -> float:
    """Least-squares change of the loss per optimizer step over ``points``."""
    if len(points) < 2:
        return NAN
    xs = [float(s) for s, _ in points]
    ys = [v for _, v in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var > 0 else NAN
