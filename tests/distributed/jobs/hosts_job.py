"""One rank of a job whose ranks are hosts in network namespaces, launched by torchrun (one agent a host).

Trains float64 with uneven, changing sizes and saves what the rank saw and its parameters.
Usage: torchrun ... hosts_job.py OUT_DIR
"""

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
from common import Net, Recorder, Resizer, quiet_trainer

from lightning_dynamix import HeterogeneousDDPStrategy

out = Path(sys.argv[1])
strategy = HeterogeneousDDPStrategy(batch_sizes=[3, 7], seed=11, timeout=timedelta(seconds=60))
recorder = Recorder()
trainer = quiet_trainer(
    devices=1,
    num_nodes=2,
    strategy=strategy,
    max_epochs=1,
    limit_val_batches=0,
    callbacks=[recorder, Resizer({(0, 3): [6, 2], (0, 6): [1, 9]})],
)
model = Net(optimizer="sgd")
trainer.fit(model)
# where the group met: the address this rank's gloo bound to, never 127.0.0.1
torch.save(
    {
        "steps": recorder.steps,
        "params": {k: v.detach().cpu() for k, v in model.net.state_dict().items()},
        "master": os.environ["MASTER_ADDR"],
        "interface": os.environ.get("GLOO_SOCKET_IFNAME"),
    },
    out / f"rank{trainer.global_rank}.pt",
)
