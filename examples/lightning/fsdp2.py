"""A model sharded with FSDP2 (``fully_shard``) under Lightning, with per-rank batch sizes chosen by a controller.

    python examples/lightning/fsdp2.py
    python examples/lightning/fsdp2.py --controller static --epochs 1

Lightning starts the second process itself (``devices=2``, gloo on the CPU). The LightningModule shards its
network in ``configure_model`` over the strategy's data-parallel mesh: each transformer encoder layer and linear
layer, then the root. Rank 1 is made 3x slower by ``HeterogeneityEmulator`` (on a real cluster leave it out); the
strategy times FSDP's all-gathers and reduce-scatters as waiting, so the controller sees each rank's own compute
and moves samples to the fast one. Every decision is printed.
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import Trainer
from torch import nn

from lightning_dynamix import DynamixCallback, HeterogeneityEmulator, HeterogeneousFSDPStrategy
from lightning_dynamix.data.workloads import ClassificationDataModule, ClassificationTask
from lightning_dynamix.distributed.sharded import shard_blocks


class ShardedTransformer(ClassificationTask):
    """The classification task's transformer, sharded by layers."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]  # every rank: each trains its own batch size
        shard_blocks(self.network, mesh, (nn.TransformerEncoderLayer, nn.Linear))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--controller", default="pid", help="static, pid or goodput (default pid)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="initial samples per rank and step")
    parser.add_argument("--factor", type=float, default=3.0, help="how many times slower rank 1 is (1: not)")
    args = parser.parse_args()

    torch.set_num_threads(1)  # two processes share this machine's cores
    dynamix = DynamixCallback(controller=args.controller, interval=5, warmup_steps=5, gradient_noise_scale=False)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=HeterogeneousFSDPStrategy(),  # or strategy="heterogeneous_fsdp"
        max_epochs=args.epochs,
        callbacks=[dynamix, HeterogeneityEmulator(factors=[1.0, args.factor])],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    task = ShardedTransformer(architecture="transformer", hidden=64, depth=2, lr=3e-3, optimizer="adam")
    trainer.fit(task, ClassificationDataModule(num_samples=4096, batch_size=args.batch_size))

    if trainer.is_global_zero:
        print(f"{'step':>5}  {'sizes':>9}  {'compute time per rank (ms)':>27}  {'decision':>9}")
        for record in dynamix.history:
            sizes = ":".join(str(w.batch_size) for w in record.state.workers)
            compute = " ".join(f"{1000 * w.compute_time:6.1f}" for w in record.state.workers)
            decided = ":".join(map(str, record.decision.batch_sizes)) if record.decision else "-"
            print(f"{record.step:>5}  {sizes:>9}  {compute:>27}  {decided:>9}")
        accuracy = float(trainer.callback_metrics["val_acc"])
        print(f"validation accuracy {accuracy:.3f}; final sizes {list(trainer.strategy.batch_sizes)}")


if __name__ == "__main__":
    main()
