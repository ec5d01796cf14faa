"""lightning-dynamix as a callback added to a Lightning ``Trainer``: per-rank batch sizes chosen by a controller.

    python examples/lightning/callback.py
    python examples/lightning/callback.py --controller goodput --lr-scaling sqrt --epochs 3

Lightning starts the second process itself (``devices=2``, gloo on the CPU). Rank 1 is made 3x
slower by ``HeterogeneityEmulator`` (it sleeps inside its step), so the controller has something
to balance; on a real heterogeneous cluster leave the emulator out. Every decision is printed;
the ``dynamix/...`` metrics go to a CSV log that ``dynamix report <output-dir>`` plots.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from lightning_dynamix import DynamixCallback, HeterogeneityEmulator
from lightning_dynamix.data.workloads import ClassificationDataModule, ClassificationTask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--controller", default="pid", help="static, pid or goodput (default pid)")
    parser.add_argument("--lr-scaling", default="none", help="none, linear, sqrt or adascale (default none)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128, help="initial samples per rank and step")
    parser.add_argument("--factor", type=float, default=3.0, help="how many times slower rank 1 is (1: not)")
    parser.add_argument("--output-dir", type=Path, default=Path("dynamix_runs/callback"))
    args = parser.parse_args()

    torch.set_num_threads(1)  # two processes share this machine's cores
    dynamix = DynamixCallback(controller=args.controller, interval=5, warmup_steps=5, lr_scaling=args.lr_scaling)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="heterogeneous_ddp",  # HeterogeneousDDPStrategy: the sizes the callback decides, exact gradients
        max_epochs=args.epochs,
        callbacks=[dynamix, HeterogeneityEmulator(factors=[1.0, args.factor])],
        logger=CSVLogger(args.output_dir, name="logs", version=args.controller),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # lr 0.1 suits the global batch of 256 samples
    trainer.fit(ClassificationTask(lr=0.1), ClassificationDataModule(batch_size=args.batch_size))

    if trainer.is_global_zero:
        print(f"{'step':>5}  {'sizes':>9}  {'compute time per rank (ms)':>27}  {'decision':>9}")
        for record in dynamix.history:
            sizes = ":".join(str(w.batch_size) for w in record.state.workers)
            compute = " ".join(f"{1000 * w.compute_time:6.1f}" for w in record.state.workers)
            decided = ":".join(map(str, record.decision.batch_sizes)) if record.decision else "-"
            print(f"{record.step:>5}  {sizes:>9}  {compute:>27}  {decided:>9}")
        accuracy = float(trainer.callback_metrics["val_acc"])
        print(f"validation accuracy {accuracy:.3f}; final sizes {list(trainer.strategy.batch_sizes)}")
        print(f"logs: {args.output_dir / 'logs'} (dynamix report {args.output_dir} plots them)")


if __name__ == "__main__":
    main()
