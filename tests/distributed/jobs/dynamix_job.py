"""DynamixCallback in real 2-process jobs: rebalancing an emulated slow rank, and resuming.

Usage: python dynamix_job.py balance OUT_DIR
       python dynamix_job.py resume OUT_DIR
       python dynamix_job.py ppo OUT_DIR POLICY_FILE
       python dynamix_job.py finetune OUT_DIR POLICY_FILE
Rank 0 writes what the callback saw and decided as JSON.
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_dynamix import HeterogeneousDDPStrategy
from lightning_dynamix.callbacks import DynamixCallback, HeterogeneityEmulator
from lightning_dynamix.data.synthetic import DemoClassifier

mode, out = sys.argv[1], Path(sys.argv[2])
torch.set_num_threads(1)  # two processes on the machine's cores: the emulated factor is relative to one thread
GNS = len(sys.argv) < 4


def history(callback):
    return [
        {
            "step": r.step,
            "sizes": list(r.state.batch_sizes),
            "compute": [w.compute_time for w in r.state.workers],
            "throughput_to_ideal": r.state.throughput / r.state.ideal_throughput,
            "noise_scale": r.state.gradient_noise_scale,
            "decision": list(r.decision.batch_sizes),
            "bandwidth": r.state.bandwidth,
        }
        for r in callback.history
    ]


class StartRecorder(Callback):
    """What the run starts from: sizes and controller state after a checkpoint was restored."""

    def __init__(self, dynamix):
        self.dynamix = dynamix
        self.seen = None

    def on_train_start(self, trainer, pl_module):
        self.seen = {
            "sizes": list(trainer.strategy.batch_sizes),
            "controller": self.dynamix.controller.state_dict(),
            "lr_scale": self.dynamix.lr_scale,
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
        }


def fit(max_steps, callbacks, ckpt_path=None, logger=False, sizes=(64, 64), **trainer_kwargs):
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=HeterogeneousDDPStrategy(batch_sizes=list(sizes), min_batch_size=4, timeout=timedelta(seconds=60)),
        max_steps=max_steps,
        callbacks=callbacks,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    # the training loss is logged with sync_dist=True: an all-reduce inside every step, where the fast rank
    # waits for the slow one (that wait must not be measured as the fast rank's compute)
    model = DemoClassifier(num_samples=8192, num_features=128, hidden=1024, num_classes=4, sync_dist=True)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


if mode == "balance":
    dynamix = DynamixCallback("pid", interval=5, warmup_steps=5, gradient_noise_scale=GNS)
    trainer = fit(
        60,
        [HeterogeneityEmulator([1.0, 3.0]), dynamix],
        logger=CSVLogger(out, name="balance"),
        enable_checkpointing=False,
        sizes=(128, 128),  # large enough that a split exists on which both ranks take equally long
    )
    if trainer.is_global_zero:
        (out / "balance.json").write_text(json.dumps({"history": history(dynamix), "log_dir": trainer.logger.log_dir}))
elif mode == "resume":
    # a fixed global batch of 96 (it starts at 128): the linear rule scales the learning rate by 0.75
    pid = {"global_batch_size": 96}
    first = DynamixCallback("pid", interval=5, warmup_steps=5, lr_scaling="linear", controller_kwargs=pid)
    checkpoint = ModelCheckpoint(dirpath=out, filename="step30", every_n_train_steps=30, save_top_k=-1)
    trainer = fit(30, [HeterogeneityEmulator([1.0, 3.0]), first, checkpoint], enable_checkpointing=True)
    before = {
        "sizes": list(trainer.strategy.batch_sizes),
        "controller": first.controller.state_dict(),
        "lr_scale": first.lr_scale,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
    }
    second = DynamixCallback("pid", interval=5, warmup_steps=5, lr_scaling="linear", controller_kwargs=pid)
    recorder = StartRecorder(second)
    trainer = fit(
        40,
        [HeterogeneityEmulator([1.0, 3.0]), second, recorder],
        ckpt_path=out / "step30.ckpt",
        enable_checkpointing=False,
    )
    if trainer.is_global_zero:
        result = {"before": before, "after": recorder.seen, "history": history(second)}
        (out / "resume.json").write_text(json.dumps(result))
elif mode == "ppo":
    # the policy file given on the command line, as DynamixCallback(controller="ppo") would load the shipped one;
    # rank 1 computes 3x slower on a virtual clock: what the policy sees, and so decides, is the same on every run
    from common import VirtualCompute

    from lightning_dynamix.control import PPOController

    dynamix = DynamixCallback(PPOController(sys.argv[3]), interval=5, warmup_steps=5)
    slow = VirtualCompute(seconds_per_sample=1e-3, schedule=[[0, 1, 3.0]])
    trainer = fit(60, [slow, dynamix], enable_checkpointing=False, sizes=(128, 128))
    if trainer.is_global_zero:
        (out / "ppo.json").write_text(json.dumps({"history": history(dynamix)}))
elif mode == "finetune":
    tuning = {"finetune_kwargs": {"n_steps": 4, "batch_size": 4}, "policy": sys.argv[3]}
    dynamix = DynamixCallback("ppo", interval=2, warmup_steps=2, finetune=True, controller_kwargs=tuning)
    checkpoint = ModelCheckpoint(dirpath=out, filename="last", every_n_train_steps=40, save_top_k=-1)
    trainer = fit(40, [HeterogeneityEmulator([1.0, 3.0]), dynamix, checkpoint], enable_checkpointing=True)
    if trainer.is_global_zero:
        (out / "finetune.json").write_text(json.dumps({"updates": dynamix.controller.finetuner.updates}))
else:
    raise SystemExit(f"unknown mode {mode}")
