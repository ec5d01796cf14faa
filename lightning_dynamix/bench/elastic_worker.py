"""One worker of ``dynamix bench elastic``, started by a torchrun agent (one process per node).

Usage: python -m lightning_dynamix.bench.elastic_worker OUT_DIR [NODE]

``OUT_DIR/config.json`` says what to train and how to survive a change of nodes:
``"preemption"`` (PreemptionCheckpoint: every rank saves the step a notice arrives at) or
``"periodic"`` (Lightning's default: a ModelCheckpoint after every validation, the job restarts
from the last one). Every launch (each group torch elastic forms) resumes with
``ckpt_path="last"``. Global rank 0 appends its events to ``OUT_DIR/timeline`` as JSON lines:
``start``, ``step``, ``val`` and ``exit``, each with ``time.time()``.

``"torchft"``: no torch elastic. The bench starts one process per node itself (``NODE`` its name), each a
replica of a :class:`~lightning_dynamix.strategies.FaultTolerantStrategy` job meeting at the lighthouse in
``TORCHFT_LIGHTHOUSE``, asking first for a batch in proportion to its speed, then for what pid decides (as in
the other scenarios; a replica that joins asks for a probe until measured). Every replica appends its ``start``
and committed ``step`` events (the step's participants as ``world``) to the timeline; the first node also
its ``val`` events.
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
from lightning_dynamix.strategies import FaultTolerantStrategy, HeterogeneousDDPStrategy


class Timeline(Callback):
    """Global rank 0 appends what happened, when, to a file that outlives the launch.

    Under FaultTolerantStrategy every replica writes (``node`` names it) and ``world`` is the participants of
    the step it committed; ``val`` events only where ``validations`` is set.
    """

    def __init__(self, path: Path, node: str | None = None, validations: bool = True) -> None:
        self.path = path
        self.node = node
        self.validations = validations

    def write(self, trainer: Trainer, event: str, **fields: Any) -> None:
        if trainer.global_rank != 0 or (event == "val" and not self.validations):
            return
        world = trainer.world_size
        plan = getattr(trainer.strategy, "committed_plan", None)
        if plan is not None:
            world = plan.participants
            fields["failed"] = trainer.strategy.replica.failed  # steps not committed so far
            if event == "step":
                fields["sizes"] = list(plan.batch_sizes)
        line = {"event": event, "t": time.time(), "world": world, "step": trainer.global_step, **fields}
        if self.node is not None:
            line["node"] = self.node
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


class SlowCompute(Callback):
    """A node ``factor`` times slower: after its backward pass (before the gradients are summed) it sleeps
    ``factor - 1`` times what the step took so far. HeterogeneityEmulator does this through
    HeterogeneousDDPStrategy, which a torchft replica does not run."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self._start = 0.0

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        time.sleep((self.factor - 1.0) * (time.perf_counter() - self._start))


def _task(config: dict[str, Any]) -> tuple[ClassificationTask, ClassificationDataModule]:
    """The model and the data every scenario trains."""
    data = ClassificationDataModule(
        num_samples=config["num_samples"], batch_size=config["batch_size"], seed=config["seed"]
    )
    return ClassificationTask(hidden=config["hidden"], lr=config["lr"], seed=config["seed"]), data


def fault_tolerant(out: Path, config: dict[str, Any], node: str) -> None:
    """One replica of the torchft scenario (module docstring)."""
    torch.set_num_threads(1)
    speeds = config["speeds"]
    nodes = sorted(speeds)
    global_batch = config["batch_size"] * len(nodes)
    first = node == nodes[0]
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=FaultTolerantStrategy(
            global_batch,
            replica_id=node,
            batch_size=max(1, round(global_batch * speeds[node] / sum(speeds.values()))),
            seed=config["seed"],
            timeout=config["ft_timeout"],
        ),
        max_epochs=config["epochs"],
        val_check_interval=1.0 / config["val_checks_per_epoch"],
        limit_val_batches=1.0 if first else 0,
        num_sanity_val_steps=0,
        callbacks=[
            SlowCompute(config["slowdowns"][node]),
            DynamixCallback("pid", interval=config["interval"], warmup_steps=config["interval"]),
            Timeline(out / "timeline", node, first),
        ],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(*_task(config))


def main(out: Path, node: str | None = None) -> None:
    config = json.loads((out / "config.json").read_text())
    if config["mode"] == "torchft":
        assert node is not None, "a torchft replica is started with its node's name"
        fault_tolerant(out, config, node)
        return
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
    model, data = _task(config)
    trainer.fit(model, data, ckpt_path="last")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
