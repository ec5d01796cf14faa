"""pid under HeterogeneousFSDPStrategy on virtual clocks where a slow rank makes the other wait inside the step.

Usage: python fsdp2_wait_job.py OUT_DIR MODE

Every rank's step clock reads a virtual time, and every FSDP all-gather and reduce-scatter moves every rank's
virtual time to the latest of them (an all-reduce of the times inside the collective), as a real collective holds
the ranks until the last arrives: the fast rank's wait lies inside its forward and backward. MODE ``compute``: rank
1 computes 3x slower (``VirtualCompute``); ``capped``: the same, rank 0's machine capped at 10 samples; ``wake``:
both compute alike, but rank 1 takes 0.5 ms to run again after each collective completes (a co-tenant holds its
core), so it arrives late at the next one. Rank 0 saves the decisions.
"""

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from common import VirtualCompute, quiet_trainer
from fsdp2_lightning_job import ShardedNet
from lightning.pytorch import Callback

from lightning_dynamix import DynamixCallback, HeterogeneousFSDPStrategy, _compat
from lightning_dynamix.distributed.sharded import fsdp_modules


class HeldUntilTheLast:
    """An FSDP comm that, after the collective, moves this rank's virtual time to the latest rank's."""

    def __init__(self, inner, compute: VirtualCompute, wake: float) -> None:
        self.inner, self.compute, self.wake = inner, compute, wake

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, *args, **kwargs):
        work = self.inner(*args, **kwargs)
        latest = torch.tensor([self.compute.now], dtype=torch.float64)
        dist.all_reduce(latest, op=dist.ReduceOp.MAX)
        self.compute.now = float(latest) + self.wake
        return work


class SharedWaits(Callback):
    """Puts :class:`HeldUntilTheLast` in every FSDP module's collectives (before the strategy times them)."""

    def __init__(self, compute: VirtualCompute, wake: float) -> None:
        self.compute, self.wake = compute, wake

    def on_train_start(self, trainer, pl_module):
        wake = self.wake if trainer.global_rank == 1 else 0.0
        for module in fsdp_modules(trainer.strategy.model):
            for group in _compat.fsdp_param_groups(module):
                all_gather, reduce_scatter = _compat.fsdp_comms(group)
                held = [HeldUntilTheLast(comm, self.compute, wake) for comm in (all_gather, reduce_scatter)]
                _compat.set_fsdp_comms(group, *held)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # one time line: what a rank lost late in the step, the others lose waiting for it before the next
        latest = torch.tensor([self.compute.now], dtype=torch.float64)
        dist.all_reduce(latest, op=dist.ReduceOp.MAX)
        self.compute.now = float(latest)


out, mode = Path(sys.argv[1]), sys.argv[2]
compute = VirtualCompute(seconds_per_sample=1e-3, schedule=[] if mode == "wake" else [[0, 1, 3.0]])
wake = 5e-4 if mode == "wake" else 0.0  # rank 1's
dynamix = DynamixCallback("pid", interval=2, warmup_steps=1, gradient_noise_scale=False)
trainer = quiet_trainer(
    devices=2,
    strategy=HeterogeneousFSDPStrategy(
        batch_sizes=[8, 8],
        seed=3,
        timeout=timedelta(seconds=60),
        batch_size_caps=[10, None] if mode == "capped" else None,
    ),
    precision="32-true",
    max_steps=24,
    callbacks=[compute, SharedWaits(compute, wake), dynamix],
)
trainer.fit(ShardedNet("mlp", "sgd"))
if trainer.global_rank == 0:
    records = [
        {
            "sizes": list(r.state.batch_sizes),
            "compute": [w.compute_time for w in r.state.workers],
            "wait": [w.sync_wait for w in r.state.workers],
            "decided": list(r.decision.batch_sizes) if r.decision else None,
        }
        for r in dynamix.history
    ]
    torch.save(records, out / f"decisions-{mode}.pt")
