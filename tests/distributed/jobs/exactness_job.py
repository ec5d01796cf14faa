"""Trains several scenarios with uneven, changing per-rank sizes; every rank saves what it saw.

Usage: python exactness_job.py WORLD_SIZE OUT_DIR
"""

import sys
from datetime import timedelta
from pathlib import Path

import torch
from common import Net, Recorder, Resizer, quiet_trainer

from lightning_dynamix import HeterogeneousDDPStrategy

world_size, out = int(sys.argv[1]), Path(sys.argv[2])
if world_size == 2:
    initial = [3, 7]
    plan = {(0, 3): [6, 2], (0, 6): [1, 9], (1, 2): [5, 5], (1, 5): [2, 3]}
else:
    initial = [3, 7, 5]
    plan = {(0, 3): [6, 2, 4], (0, 6): [1, 9, 1], (1, 1): [4, 4, 4], (1, 4): [2, 5, 1]}

# name: (optimizer, accumulate_grad_batches, loss reduction, manual optimisation)
SCENARIOS = {
    "sgd-acc1": ("sgd", 1, "mean", False),
    "sgd-acc2": ("sgd", 2, "mean", False),
    "adam-acc1": ("adam", 1, "mean", False),
    "adam-acc2": ("adam", 2, "mean", False),
    "sgd-sum-acc2": ("sgd-small", 2, "sum", False),
    "sgd-manual": ("sgd", 1, "mean", True),
}

for name, (optimizer, accumulate, reduction, manual) in SCENARIOS.items():
    recorder = Recorder()
    strategy = HeterogeneousDDPStrategy(
        batch_sizes=initial, loss_reduction=reduction, seed=11, timeout=timedelta(seconds=90)
    )
    trainer = quiet_trainer(
        devices=world_size,
        strategy=strategy,
        max_epochs=2,
        accumulate_grad_batches=accumulate,
        callbacks=[recorder, Resizer(plan)],
    )
    model = Net(optimizer=optimizer, reduction=reduction, manual=manual)
    trainer.fit(model)
    torch.save(
        {
            "steps": recorder.steps,
            "probes": recorder.probes,
            "params": {k: v.detach().cpu() for k, v in model.net.state_dict().items()},
            "val_loss": float(trainer.callback_metrics["val_loss"]),
        },
        out / f"{name}-rank{trainer.global_rank}.pt",
    )
