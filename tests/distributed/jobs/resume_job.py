"""Trains once straight through and twice interrupted by a checkpoint (mid-epoch, end of epoch).

Usage: python resume_job.py NUM_WORKERS OUT_DIR
Every rank saves the batches it trained on in each run and the final parameters.
"""

import sys
from datetime import timedelta
from pathlib import Path

import torch
from common import Net, Recorder, Resizer, quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dynamix import HeterogeneousDDPStrategy

num_workers, out = int(sys.argv[1]), Path(sys.argv[2])
# (0, 2) is decided before the mid-epoch checkpoint but, with workers prefetching, applies after it;
# (0, -1) is decided at the last batch of epoch 0 and applies from epoch 1
PLAN = {(0, 2): [6, 2], (0, 7): [2, 9], (0, -1): [4, 5], (1, 3): [7, 1]}


def fit(name, ckpt_path=None, **trainer_kwargs):
    recorder = Recorder()
    callbacks = [recorder, Resizer(PLAN), *trainer_kwargs.pop("callbacks", [])]
    trainer = quiet_trainer(
        devices=2,
        strategy=HeterogeneousDDPStrategy(batch_sizes=[3, 7], seed=5, timeout=timedelta(seconds=90)),
        callbacks=callbacks,
        **trainer_kwargs,
    )
    model = Net(optimizer="adam", num_workers=num_workers)
    trainer.fit(model, ckpt_path=ckpt_path)
    torch.save(
        {"steps": recorder.steps, "params": {k: v.detach().cpu() for k, v in model.net.state_dict().items()}},
        out / f"{name}-rank{trainer.global_rank}.pt",
    )


fit("full", max_epochs=2)
mid = ModelCheckpoint(dirpath=out / "mid", filename="mid", every_n_train_steps=5, save_top_k=-1)
fit("mid1", max_steps=5, callbacks=[mid], enable_checkpointing=True)
fit("mid2", ckpt_path=out / "mid" / "mid.ckpt", max_epochs=2)
end = ModelCheckpoint(dirpath=out / "end", filename="end")
fit("end1", max_epochs=1, callbacks=[end], enable_checkpointing=True)
fit("end2", ckpt_path=out / "end" / "end.ckpt", max_epochs=2)
