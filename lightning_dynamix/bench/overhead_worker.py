"""One process of ``dynamix bench overhead --fault-tolerant``: the benchmark's MLP trained by one strategy.

Usage: python -m lightning_dynamix.bench.overhead_worker OUT_FILE VARIANT STEPS WARMUP BATCH FEATURES HIDDEN WORLD

``VARIANT`` is ``heterogeneous_ddp`` (a node of one process of ``HeterogeneousDDPStrategy``, its rank and
the master's address in the environment) or ``torchft`` (a replica of ``FaultTolerantStrategy`` meeting at
``TORCHFT_LIGHTHOUSE``, named by ``REPLICA_GROUP_ID``). Both train ``WORLD`` ranks' worth of batches of
``BATCH`` each. ``OUT_FILE`` gets this process's median step after the warm-up, seconds, as JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
from lightning.pytorch import Trainer

from lightning_dynamix.bench.timing import StepTimer
from lightning_dynamix.data.synthetic import DemoClassifier
from lightning_dynamix.strategies import FaultTolerantStrategy, HeterogeneousDDPStrategy


def main(argv: list[str]) -> None:
    out, variant = Path(argv[0]), argv[1]
    steps, warmup, batch, features, hidden, world = (int(a) for a in argv[2:8])
    torch.set_num_threads(1)
    if variant == "torchft":
        strategy: object = FaultTolerantStrategy(batch * world, batch_size=batch, timeout=30.0)
        nodes = 1
    else:
        strategy, nodes = HeterogeneousDDPStrategy(batch_sizes=[batch] * world), world
    timer = StepTimer(warmup=warmup)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=nodes,
        strategy=strategy,
        max_steps=warmup + steps,
        logger=False,
        callbacks=[timer],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = DemoClassifier(
        num_samples=8192, num_features=features, num_classes=10, hidden=hidden, batch_size=batch, sync_dist=False
    )
    trainer.fit(model)
    out.write_text(json.dumps({"median_step_seconds": statistics.median(timer.step_seconds)}))


if __name__ == "__main__":
    main(sys.argv[1:])
