"""Per-rank step times for the demo and the benchmarks."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override


@dataclass(frozen=True)
class RankTiming:
    """One rank's measured steps.

    Attributes:
        rank: global rank.
        steps: steps measured (after the warm-up).
        samples: training samples this rank processed in those steps.
        seconds: wall time of those steps (data loading, compute and synchronisation).
        median_step_seconds: median wall time of one step.
    """

    rank: int
    steps: int
    samples: int
    seconds: float
    median_step_seconds: float

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")


class StepTimer(Callback):
    """Measures every training step's wall time, from one batch end to the next, after ``warmup`` steps.

    ``timings`` holds every rank's :class:`RankTiming` on every rank after ``fit`` (one all_gather
    at the end of training).
    """

    def __init__(self, warmup: int = 5) -> None:
        self.warmup = warmup
        self.step_seconds: list[float] = []
        self.samples = 0
        self._last: float | None = None
        self._seen = 0
        self.timings: list[RankTiming] = []

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        self._seen += 1
        if self._last is not None and self._seen > self.warmup:
            self.step_seconds.append(now - self._last)
            self.samples += len(batch[0])
        self._last = now

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        median = statistics.median(self.step_seconds) if self.step_seconds else float("nan")
        local = torch.tensor(
            [len(self.step_seconds), self.samples, sum(self.step_seconds), median],
            dtype=torch.float64,
            device=pl_module.device,
        )
        rows = [local]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, local)
        self.timings = [
            RankTiming(rank, int(row[0]), int(row[1]), float(row[2]), float(row[3]))
            for rank, row in enumerate(r.tolist() for r in rows)
        ]


def timed_trainer(
    strategy: Any, steps: int, callbacks: list[Any], accelerator: str = "cpu", **trainer_kwargs: Any
) -> Trainer:
    """A Trainer for a measurement: one device, ``steps`` training steps, and nothing else (no logger,
    checkpoint, validation or progress bar); ``trainer_kwargs`` adds to it (``num_nodes``, ``precision``)."""
    return Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        **trainer_kwargs,
    )
