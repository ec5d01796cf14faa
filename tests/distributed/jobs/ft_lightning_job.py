"""One replica of a fault-tolerant Lightning job (FaultTolerantStrategy), to max_steps.

Usage: python ft_lightning_job.py LIGHTHOUSE REPLICA_ID OUT_DIR BATCH_SIZE STEP_SECONDS [JOIN_FILE]

Writes OUT_DIR/REPLICA_ID.jsonl, one line per training batch (the plan it committed: every batch is, the trainer's
epoch and global step, the steps it saw fail so far), and OUT_DIR/REPLICA_ID.pt with its final
parameters. STEP_SECONDS sleeps in each training step; once OUT_DIR/REPLICA_ID.die exists it SIGKILLs itself there
instead, inside its next step (common.inside_a_step). With JOIN_FILE it starts once that
file exists.

With LITDATA_DIR in the environment the training data is the LitData dataset there (write_litdata.py), read by a
DataLoader over its StreamingDataset. With SECONDS_PER_SAMPLE in the environment, DynamixCallback("pid") decides
what the replica asks for (every 2 steps), timing the replica on a virtual clock that only its own samples move,
that many seconds each.
"""

import os
import sys
from pathlib import Path

import torch
from common import Net, inside_a_step, quiet_trainer, replica_made, wait_to_join, write_plan
from lightning.pytorch import Callback

from lightning_dynamix.callbacks import DynamixCallback
from lightning_dynamix.metrics.clocks import HostClock
from lightning_dynamix.strategies import FaultTolerantStrategy

NUM_SAMPLES, GLOBAL_BATCH, STEPS = 120, 12, 24

lighthouse, replica_id, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
batch_size, pause = int(sys.argv[4]), float(sys.argv[5])
seconds_per_sample = float(os.environ.get("SECONDS_PER_SAMPLE", "0"))
now = [0.0]  # the virtual clock, with SECONDS_PER_SAMPLE
join_file = Path(sys.argv[6]) if len(sys.argv) > 6 else None


class Slow(Net):
    def train_dataloader(self):
        if "LITDATA_DIR" not in os.environ:
            return super().train_dataloader()
        import litdata
        from torch.utils.data import DataLoader

        return DataLoader(litdata.StreamingDataset(os.environ["LITDATA_DIR"]), batch_size=4)

    def training_step(self, batch, batch_idx):
        now[0] += seconds_per_sample * len(batch[0])
        inside_a_step(out, replica_id, self.trainer.global_step, pause)
        return super().training_step(batch, batch_idx)


class Log(Callback):
    def __init__(self):
        self.file = (out / f"{replica_id}.jsonl").open("a")

    def on_train_start(self, trainer, pl_module):
        replica_made(out, replica_id)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        strategy = trainer.strategy
        extra = {"global_step": trainer.global_step, "current_epoch": trainer.current_epoch}
        if strategy.balancer is not None:
            extra["decisions"] = [[r.step, list(r.decision.batch_sizes)] for r in dynamix.history]
        write_plan(self.file, strategy.committed_plan, strategy.replica, True, **extra)


wait_to_join(join_file)
strategy = FaultTolerantStrategy(
    GLOBAL_BATCH, lighthouse=lighthouse, replica_id=replica_id, batch_size=batch_size, seed=3, timeout=5.0
)
model = Slow(num_samples=NUM_SAMPLES)
callbacks = [Log()]
if seconds_per_sample > 0:
    strategy.time_source = HostClock(lambda: now[0])
    dynamix = DynamixCallback("pid", interval=2, warmup_steps=1, controller_kwargs={"smoothing": 0.0})
    callbacks.append(dynamix)
trainer = quiet_trainer(strategy=strategy, devices=1, max_steps=STEPS, callbacks=callbacks, limit_val_batches=0)
trainer.fit(model)
torch.save({k: v.clone() for k, v in model.net.state_dict().items()}, out / f"{replica_id}.pt")
