"""HeterogeneousFSDPStrategy jobs saved with torch distributed checkpoint on one number of ranks, resumed on another.

Usage: python fsdp2_regroup_job.py WORLD_SIZE OUT_DIR [RESUME_FROM_WORLD_SIZE]

Without RESUME_FROM_WORLD_SIZE the launch trains Adam on the transformer block straight through ("full") and stops
after a mid-epoch checkpoint ("mid1"; a folder of shards), and a pid-controlled job whose rank 0 computes 4x slower
(a virtual clock) stops after one too. With it, the launch resumes both checkpoints ("mid2"). Sizes change at
planned steps by global batch (each run splits the total over its own ranks). Every rank saves the batches it
trained on and the full parameters.
"""

import sys
from datetime import timedelta
from pathlib import Path

import torch
from common import Recorder, VirtualCompute, quiet_trainer
from fsdp2_lightning_job import ShardedNet
from lightning.pytorch.callbacks import ModelCheckpoint
from regroup_job_parts import ControllerProbe, TotalResizer

from lightning_dynamix import DynamixCallback, HeterogeneousFSDPStrategy

world, out = int(sys.argv[1]), Path(sys.argv[2])
resume_from = int(sys.argv[3]) if len(sys.argv) > 3 else None
MID_STEP = 5


def trainer_for(callbacks, **kwargs):
    return quiet_trainer(
        devices=world,
        strategy=HeterogeneousFSDPStrategy(seed=5, timeout=timedelta(seconds=60)),
        precision="32-true",  # the network and the data are float64
        callbacks=callbacks,
        **kwargs,
    )


def fit(name, ckpt_path=None, **trainer_kwargs):
    recorder = Recorder()
    trainer = trainer_for([recorder, TotalResizer(), *trainer_kwargs.pop("callbacks", [])], **trainer_kwargs)
    model = ShardedNet("transformer", "adam")
    trainer.fit(model, ckpt_path=ckpt_path)
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.net.state_dict().items()}
    torch.save(
        {"steps": recorder.steps, "params": {k: v.detach().cpu() for k, v in state.items()}},
        out / f"{name}-w{world}-rank{trainer.global_rank}.pt",
    )


def fit_controlled(name, ckpt_path=None, **trainer_kwargs):
    dynamix = DynamixCallback("pid", interval=2, warmup_steps=1, controller_kwargs={"smoothing": 0.0})
    probe = ControllerProbe(dynamix)
    callbacks = [VirtualCompute(seconds_per_sample=1e-3, schedule=[[0, 0, 4.0]]), dynamix, probe]
    trainer = trainer_for(callbacks + trainer_kwargs.pop("callbacks", []), **trainer_kwargs)
    trainer.fit(ShardedNet("mlp", "sgd"), ckpt_path=ckpt_path)
    if trainer.global_rank == 0:
        torch.save({"start": probe.seen, "end": dynamix.maker.state_dict()}, out / f"pid-{name}-w{world}.pt")


if resume_from is None:
    fit("full", max_epochs=2)
    fit(
        "mid1",
        max_steps=MID_STEP,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=out, filename=f"mid-w{world}", every_n_train_steps=MID_STEP)],
    )
    fit_controlled(
        "mid1",
        max_steps=MID_STEP,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=out, filename=f"pid-mid-w{world}", every_n_train_steps=MID_STEP)],
    )
else:
    fit(f"mid2-from{resume_from}", ckpt_path=out / f"mid-w{resume_from}.ckpt", max_epochs=2)
    fit_controlled(f"mid2-from{resume_from}", ckpt_path=out / f"pid-mid-w{resume_from}.ckpt", max_steps=MID_STEP + 4)
