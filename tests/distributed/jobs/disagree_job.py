"""Ranks call set_batch_sizes with different sizes: every rank must fail with a clear error.

Usage: python disagree_job.py
"""

from datetime import timedelta

from common import Net, quiet_trainer
from lightning.pytorch import Callback

from lightning_dynamix import HeterogeneousDDPStrategy


class DisagreeingResize(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 2:
            trainer.strategy.set_batch_sizes([4, 4] if trainer.global_rank == 0 else [2, 6])


trainer = quiet_trainer(
    devices=2,
    strategy=HeterogeneousDDPStrategy(batch_sizes=[3, 7], timeout=timedelta(seconds=60)),
    max_epochs=1,
    callbacks=[DisagreeingResize()],
)
try:
    trainer.fit(Net())
except ValueError as error:
    print(f"rank {trainer.global_rank} raised: {error}", flush=True)
    raise
