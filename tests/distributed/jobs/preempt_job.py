"""A SIGTERM to one rank of a 3-rank Lightning job: every rank saves the same step, and 2 ranks resume it.

Usage: python preempt_job.py WORLD_SIZE OUT_DIR PHASE

PHASE ``train`` (3 ranks): trains two epochs straight through ("full"), then again with
PreemptionCheckpoint while a callback sends SIGTERM to rank 2's own process after batch 6; every
rank records the steps it trained and where it stopped. PHASE ``resume`` (2 ranks):
``trainer.fit(ckpt_path="last")`` to the end of epoch 1.
"""

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
from common import Net, Recorder, quiet_trainer
from lightning.pytorch import Callback

from lightning_dynamix import HeterogeneousDDPStrategy, PreemptionCheckpoint

world, out, phase = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
VICTIM, AT_BATCH = 2, 6


class Notice(Callback):
    """The spot notice: a real SIGTERM, to one rank's own process, in the middle of an epoch."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == VICTIM and batch_idx == AT_BATCH:
            os.kill(os.getpid(), signal.SIGTERM)


class Outcome(Callback):
    def __init__(self, name, recorder, preemption):
        self.name, self.recorder, self.preemption = name, recorder, preemption

    def save(self, trainer, pl_module, exception=None):
        params = {k: v.detach().cpu() for k, v in pl_module.net.state_dict().items()}
        torch.save(
            {
                "steps": self.recorder.steps,
                "params": params,
                "exception": type(exception).__name__ if exception is not None else None,
                "global_step": trainer.global_step,
                "saved_step": getattr(self.preemption, "saved_step", None),
            },
            out / f"{self.name}-w{world}-rank{trainer.global_rank}.pt",
        )

    def on_exception(self, trainer, pl_module, exception):
        self.save(trainer, pl_module, exception)

    def on_train_end(self, trainer, pl_module):
        self.save(trainer, pl_module)


def fit(name, callbacks, ckpt_path=None):
    recorder = Recorder()
    preemption = next((c for c in callbacks if isinstance(c, PreemptionCheckpoint)), None)
    trainer = quiet_trainer(
        devices=world,
        max_epochs=2,
        strategy=HeterogeneousDDPStrategy(seed=5, timeout=timedelta(seconds=90)),
        callbacks=[recorder, *callbacks, Outcome(name, recorder, preemption)],
        enable_checkpointing=preemption is not None,
    )
    trainer.fit(Net(optimizer="adam", num_workers=0), ckpt_path=ckpt_path)


if phase == "train":
    fit("full", [])
    fit("preempted", [PreemptionCheckpoint(dirpath=out / "checkpoints"), Notice()])
else:
    fit("resumed", [PreemptionCheckpoint(dirpath=out / "checkpoints")], ckpt_path="last")
