"""One worker of a torch elastic job (torchrun, one process per node): Lightning with PreemptionCheckpoint.

Usage: torchrun --nnodes MIN:MAX --nproc_per_node 1 ... elastic_job.py OUT_DIR

Every launch (each re-formed group) runs ``trainer.fit(ckpt_path="last")``: the first finds no
checkpoint and starts, the next ones resume the preemption checkpoint the previous one saved, on
however many nodes the rendezvous gathered. Each rank writes its progress to ``OUT_DIR/progress``
(one JSON line per batch) and, when its launch ends, what it trained to
``launch-w<world>-from<step>-rank<rank>.pt``.

While a file ``OUT_DIR/hold-w<world>`` exists, every rank of a launch of that size waits after each
batch until the file goes or this process gets its notice: the test driver thereby preempts a node
and adds one at steps it knows, wherever the launches' start-up times put them.
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from common import Net, Recorder, quiet_trainer
from lightning.pytorch import Callback

from lightning_dynamix import HeterogeneousDDPStrategy, PreemptionCheckpoint
from lightning_dynamix.elastic import machine_id

out = Path(sys.argv[1])
HOLD_TIMEOUT = 180.0


class Driven(Callback):
    """Reports each batch to the driver and holds while the driver says so."""

    def __init__(self, preemption: PreemptionCheckpoint) -> None:
        self.preemption = preemption
        self.start = 0

    def report(self, trainer, event: str) -> None:
        line = {
            "event": event,
            "world": trainer.world_size,
            "rank": trainer.global_rank,
            "start": self.start,
            "step": trainer.global_step,
            "machine": machine_id(),
        }
        with open(out / "progress", "a") as f:  # one short append per line: lines never interleave
            f.write(json.dumps(line) + "\n")

    def on_train_start(self, trainer, pl_module):
        self.start = trainer.global_step
        self.report(trainer, "start")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        hold = out / f"hold-w{trainer.world_size}"
        if not hold.exists():
            return
        self.report(trainer, "held")
        deadline = time.monotonic() + HOLD_TIMEOUT
        while hold.exists() and not self.preemption.notice.received:
            if time.monotonic() > deadline:
                raise TimeoutError(f"held for {HOLD_TIMEOUT} s at step {trainer.global_step}: the driver is gone")
            time.sleep(0.05)


class Outcome(Callback):
    def __init__(self, recorder: Recorder, preemption: PreemptionCheckpoint, driven: Driven) -> None:
        self.recorder, self.preemption, self.driven = recorder, preemption, driven

    def save(self, trainer, pl_module, exception=None):
        torch.save(
            {
                "steps": self.recorder.steps,
                "params": {k: v.detach().cpu() for k, v in pl_module.net.state_dict().items()},
                "exception": type(exception).__name__ if exception is not None else None,
                "global_step": trainer.global_step,
                "saved_step": self.preemption.saved_step,
                "machine": machine_id(),
                "batch_sizes": list(trainer.strategy.batch_sizes),
            },
            out / f"launch-w{trainer.world_size}-from{self.driven.start}-rank{trainer.global_rank}.pt",
        )

    def on_exception(self, trainer, pl_module, exception):
        self.save(trainer, pl_module, exception)

    def on_train_end(self, trainer, pl_module):
        self.save(trainer, pl_module)


world = int(os.environ["WORLD_SIZE"])
recorder = Recorder()
preemption = PreemptionCheckpoint(dirpath=out / "checkpoints")
driven = Driven(preemption)
trainer = quiet_trainer(
    devices=1,
    num_nodes=world,
    max_epochs=2,
    strategy=HeterogeneousDDPStrategy(seed=5, timeout=timedelta(seconds=60)),
    callbacks=[recorder, driven, preemption, Outcome(recorder, preemption, driven)],
    enable_checkpointing=True,
)
trainer.fit(Net(optimizer="adam", num_workers=0), ckpt_path="last")
