"""Lightning jobs saved on one number of ranks and resumed on another (3 -> 2 and 2 -> 3).

Usage: python regroup_job.py WORLD_SIZE OUT_DIR [RESUME_FROM_WORLD_SIZE]

For each configuration (SGD without DataLoader workers, Adam with 2 workers) a launch on
WORLD_SIZE ranks trains straight through ("full"), stops after a mid-epoch checkpoint ("mid1")
and after an end-of-epoch checkpoint ("end1"); with RESUME_FROM_WORLD_SIZE it first resumes the
checkpoints that launch wrote ("mid2", "end2"). Every rank saves the batches it trained on and
its final parameters. Sizes change at planned steps by global batch (each run splits the total
over its own ranks), before and after the checkpoints.
"""

import sys
from datetime import timedelta
from pathlib import Path

import torch
from common import Net, Recorder, VirtualCompute, quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from regroup_job_parts import ControllerProbe, TotalResizer

from lightning_dynamix import HeterogeneousDDPStrategy
from lightning_dynamix.callbacks import DynamixCallback

world, out = int(sys.argv[1]), Path(sys.argv[2])
resume_from = int(sys.argv[3]) if len(sys.argv) > 3 else None
CONFIGS = {"sgd-workers0": ("sgd", 0), "adam-workers2": ("adam", 2)}
MID_STEP = 5


def fit_controlled(name, ckpt_path=None, **trainer_kwargs):
    """A PID-controlled job whose rank 0 computes 4x slower (on a virtual clock, so that what pid learns is the same
    on every run): its controller must survive the change."""
    dynamix = DynamixCallback("pid", interval=2, warmup_steps=1, controller_kwargs={"smoothing": 0.0})
    probe = ControllerProbe(dynamix)
    trainer = quiet_trainer(
        devices=world,
        strategy=HeterogeneousDDPStrategy(seed=5, timeout=timedelta(seconds=90)),
        callbacks=[
            VirtualCompute(seconds_per_sample=1e-3, schedule=[[0, 0, 4.0]]),
            dynamix,
            probe,
            *trainer_kwargs.pop("callbacks", []),
        ],
        **trainer_kwargs,
    )
    trainer.fit(Net(optimizer="sgd"), ckpt_path=ckpt_path)
    if trainer.global_rank == 0:
        torch.save({"start": probe.seen, "end": dynamix.maker.state_dict()}, out / f"pid-{name}-w{world}.pt")


def fit(config, name, ckpt_path=None, **trainer_kwargs):
    optimizer, workers = CONFIGS[config]
    recorder = Recorder()
    trainer = quiet_trainer(
        devices=world,
        strategy=HeterogeneousDDPStrategy(seed=5, timeout=timedelta(seconds=90)),
        callbacks=[recorder, TotalResizer(), *trainer_kwargs.pop("callbacks", [])],
        **trainer_kwargs,
    )
    model = Net(optimizer=optimizer, num_workers=workers)
    trainer.fit(model, ckpt_path=ckpt_path)
    torch.save(
        {"steps": recorder.steps, "params": {k: v.detach().cpu() for k, v in model.net.state_dict().items()}},
        out / f"{config}-{name}-w{world}-rank{trainer.global_rank}.pt",
    )


if resume_from is not None:
    fit_controlled(
        f"mid2-from{resume_from}", ckpt_path=out / f"pid-mid-w{resume_from}.ckpt", max_steps=MID_STEP + 4, callbacks=[]
    )
if resume_from is None or world < resume_from:
    mid = ModelCheckpoint(dirpath=out, filename=f"pid-mid-w{world}", every_n_train_steps=MID_STEP)
    fit_controlled("mid1", max_steps=MID_STEP, callbacks=[mid], enable_checkpointing=True)

for config in CONFIGS:
    if resume_from is not None:
        fit(config, f"mid2-from{resume_from}", ckpt_path=out / f"{config}-mid-w{resume_from}.ckpt", max_epochs=2)
        fit(config, f"end2-from{resume_from}", ckpt_path=out / f"{config}-end-w{resume_from}.ckpt", max_epochs=2)
    if resume_from is None or world < resume_from:  # the launch that is resumed elsewhere
        fit(config, "full", max_epochs=2)
        mid = ModelCheckpoint(dirpath=out, filename=f"{config}-mid-w{world}", every_n_train_steps=MID_STEP)
        fit(config, "mid1", max_steps=MID_STEP, callbacks=[mid], enable_checkpointing=True)
        end = ModelCheckpoint(dirpath=out, filename=f"{config}-end-w{world}")
        fit(config, "end1", max_epochs=1, callbacks=[end], enable_checkpointing=True)
