"""Trains with ranks that sit steps out (batch size 0) and come back; every rank saves what it saw.

Usage: python sit_out_job.py OUT_DIR  (three ranks)
"""

import sys
from datetime import timedelta
from pathlib import Path

import torch
from common import Net, Recorder, Resizer, quiet_trainer
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dynamix import HeterogeneousDDPStrategy
from lightning_dynamix.callbacks import HeterogeneityEmulator

out = Path(sys.argv[1])
# (epoch, batch_idx) after which the sizes change: rank 0 leaves, two ranks leave, all come back, rank 0 leaves again
# the first rank out comes at step 3: a rank leaves the step only once DDP has rebuilt its gradient buckets, after
# its first synchronised step, and the first step (a trial of the initial sizes, see memory_recovery) is not one
PLAN = {(0, 2): [0, 9, 6], (0, 4): [4, 0, 0], (0, 7): [5, 5, 5], (1, 2): [0, 7, 1], (1, 5): [6, 0, 4]}
# name: (optimizer, accumulate_grad_batches)
SCENARIOS = {"sgd-acc1": ("sgd", 1), "adam-acc1": ("adam", 1), "sgd-acc2": ("sgd", 2), "adam-acc3": ("adam", 3)}


class Sleeps(Callback):
    """What the emulator slept in each training step of this rank."""

    def __init__(self, emulator: HeterogeneityEmulator) -> None:
        self.emulator = emulator
        self.slept: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.slept.append(self.emulator.slept)


class Norms(Callback):
    """How many gradient-norm reports the strategy made in each training step of this rank."""

    def __init__(self) -> None:
        self.reports: list[int] = []
        self._count = 0

    def setup(self, trainer, pl_module, stage):
        trainer.strategy.enable_gradient_norms(self.sink)

    def sink(self, local_sq_norm, local_samples, global_sq_norm, global_samples):
        self._count += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.reports.append(self._count)
        self._count = 0


def fit(name, optimizer, accumulate=1, ckpt_path=None, callbacks=(), **trainer_kwargs):
    recorder = Recorder()
    emulator = HeterogeneityEmulator([2.0, 2.0, 2.0])  # every rank twice as slow at its compute
    sleeps = Sleeps(emulator)
    norms = Norms()
    strategy = HeterogeneousDDPStrategy(batch_sizes=[3, 7, 5], min_batch_size=0, seed=5, timeout=timedelta(seconds=90))
    trainer = quiet_trainer(
        devices=3,
        strategy=strategy,
        accumulate_grad_batches=accumulate,
        callbacks=[recorder, Resizer(PLAN), emulator, sleeps, norms, *callbacks],
        **trainer_kwargs,
    )
    model = Net(optimizer=optimizer)
    trainer.fit(model, ckpt_path=ckpt_path)
    torch.save(
        {
            "steps": recorder.steps,
            "probes": recorder.probes,
            "weights": recorder.weights,
            "validated": recorder.validated,
            "slept": sleeps.slept,
            "norm_reports": norms.reports,
            "params": {k: v.detach().cpu() for k, v in model.net.state_dict().items()},
        },
        out / f"{name}-rank{trainer.global_rank}.pt",
    )


for name, (optimizer, accumulate) in SCENARIOS.items():
    fit(name, optimizer, accumulate, max_epochs=2)
# a checkpoint at step 4 of epoch 0, while rank 0 sits out, and the run resumed from it
mid = ModelCheckpoint(dirpath=out / "mid", filename="mid", every_n_train_steps=4, save_top_k=-1)
fit("mid1", "adam", max_steps=4, callbacks=[mid], enable_checkpointing=True)
fit("mid2", "adam", ckpt_path=out / "mid" / "mid.ckpt", max_epochs=2)

# a rank whose optimizer never stepped (it sat out from the start) receives rank 0's state, layout and all
import torch.distributed as dist  # noqa: E402

from lightning_dynamix.distributed import broadcast_training_state  # noqa: E402

rank = dist.get_rank()
torch.manual_seed(rank)  # different parameters on every rank
module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
if rank == 0:
    for _ in range(2):
        module(torch.randn(8, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
broadcast_training_state(module, [optimizer], src=0)
module(torch.ones(8, 4)).square().sum().backward()  # the same batch everywhere: the same step from here
optimizer.step()
torch.save({"module": module.state_dict(), "optimizer": optimizer.state_dict()}, out / f"broadcast-rank{rank}.pt")
