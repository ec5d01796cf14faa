"""Trains on a LitData dataset read from a local directory, with uneven, changing per-rank sizes and DataLoader
workers; every rank saves what it saw.

Usage: python streaming_job.py WORLD_SIZE DATA_DIR OUT_DIR LOADER [MODE]   (LOADER: torch or litdata, the DataLoader
class the module returns; HeterogeneousDDPStrategy rebuilds either over a view of the dataset. MODE: "full" (default)
trains two epochs; "save" stops at step 5 with a checkpoint there; "resume" resumes it and trains to the end)
"""

import sys
from datetime import timedelta
from pathlib import Path

import litdata
import torch
from common import Net, Recorder, Resizer, quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_dynamix import HeterogeneousDDPStrategy

world_size, data, out, loader = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
mode = sys.argv[5] if len(sys.argv) > 5 else "full"
MID_STEP = 5
initial = {2: [3, 7], 3: [3, 7, 5]}[world_size]
plan = {2: {(0, 3): [6, 2], (0, 6): [1, 9], (1, 2): [5, 5]}, 3: {(0, 3): [6, 2, 4], (1, 1): [4, 4, 4]}}[world_size]


class StreamingNet(Net):
    def train_dataloader(self):
        dataset = litdata.StreamingDataset(data)
        make = DataLoader if loader == "torch" else litdata.StreamingDataLoader
        return make(dataset, batch_size=4, num_workers=2)


recorder = Recorder()
callbacks = [recorder, Resizer(plan)]
if mode == "save":
    callbacks.append(ModelCheckpoint(dirpath=out, filename="mid", every_n_train_steps=MID_STEP))
trainer = quiet_trainer(
    devices=world_size,
    strategy=HeterogeneousDDPStrategy(batch_sizes=initial, seed=11, timeout=timedelta(seconds=90)),
    max_epochs=2,
    max_steps=MID_STEP if mode == "save" else -1,
    limit_val_batches=0,
    callbacks=callbacks,
    enable_checkpointing=mode == "save",
)
model = StreamingNet()
trainer.fit(model, ckpt_path=out / "mid.ckpt" if mode == "resume" else None)
sampler = trainer.train_dataloader.batch_sampler
torch.save(
    {
        "steps": recorder.steps,
        "params": {k: v.detach().cpu() for k, v in model.net.state_dict().items()},
        "chunks": sampler.layout.num_chunks if sampler.layout is not None else None,
    },
    out / f"{mode}-rank{trainer.global_rank}.pt",
)
