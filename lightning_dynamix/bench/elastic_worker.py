"""One worker of ``dynamix bench elastic``, started by a torchrun agent (one process per node).

Usage: python -m lightning_dynamix.bench.elastic_worker OUT_DIR

``OUT_DIR/config.json`` says what to train and how to survive a change of nodes:
``"preemption"`` (PreemptionCheckpoint: every rank saves the step a notice arrives at) or
``"periodic"`` (Lightning's default: a ModelCheckpoint after every validation, the job restarts
from the last one). Every launch (each group torch elastic forms) resumes with
``ckpt_path="last"``. Global rank 0 appends its events to ``OUT_DIR/timeline`` as JSON lines:
``start``, ``step``, ``val`` and ``exit``, each with ``time.time()``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_dynamix.callbacks import DynamixCallback, HeterogeneityEmulator, PreemptionCheckpoint
from lightning_dynamix.data.workloads import ClassificationDataModule, ClassificationTask
from lightning_dynamix.elastic import machine_id
from lightning_dynamix.strategies import HeterogeneousDDPStrategy


class Timeline(Callback):
    """Global rank 0 appends what happened, when, to a file that outlives the launch."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, trainer: Trainer, event: str, **fields: Any) -> None:
        if trainer.global_rank != 0:
            return
        line = {"event": event, "t": time.time(), "world": trainer.world_size, "step": trainer.global_step, **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.write(trainer, "start", master=os.environ.get("MASTER_ADDR"))  # where the launch's ranks met

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.write(trainer, "step", sizes=list(getattr(trainer.strategy, "current_batch_sizes", [])))

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self.write(trainer, "val", accuracy=float(trainer.callback_metrics["val_acc"]))

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.write(trainer, "exit", exception=type(exception).__name__)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.write(trainer, "end")


def main(out: Path) -> None:
    config = json.loads((out / "config.json").read_text())
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.set_num_threads(1)  # the ranks share this machine's cores; the emulator's factors are per rank
    factors = [1.0] * world
    factors[rank] = config["slowdowns"][machine_id()]
    checkpoints = out / "checkpoints"
    if config["mode"] == "preemption":
        checkpoint: ModelCheckpoint = PreemptionCheckpoint(dirpath=checkpoints)
    else:  # Lightning's default cadence (after every validation), with the `last` file a restart needs
        checkpoint = ModelCheckpoint(dirpath=checkpoints, save_last=True)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=world,
        strategy=HeterogeneousDDPStrategy(seed=config["seed"], timeout=timedelta(seconds=config["timeout"])),
        max_epochs=config["epochs"],
        val_check_interval=1.0 / config["val_checks_per_epoch"],
        num_sanity_val_steps=0,
        callbacks=[
            HeterogeneityEmulator(factors),
            DynamixCallback("pid", interval=config["interval"], warmup_steps=config["interval"]),
            checkpoint,
            Timeline(out / "timeline"),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = ClassificationDataModule(
        num_samples=config["num_samples"], batch_size=config["batch_size"], seed=config["seed"]
    )
    model = ClassificationTask(hidden=config["hidden"], lr=config["lr"], seed=config["seed"])
    trainer.fit(model, datamodule=data, ckpt_path="last")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
