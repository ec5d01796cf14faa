"""A plain PyTorch training loop under Accelerate with per-rank batch sizes chosen by a controller.

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate/train.py
    torchrun --standalone --nproc_per_node 2 examples/accelerate/train.py

On a machine without GPUs both start two gloo processes on the CPU. ``--slow-rank 1 --factor 3``
makes rank 1 three times slower (it sleeps inside its step), so the controller has something to
balance. Metrics go to TensorBoard under ``--output-dir``; ``dynamix report <output-dir>`` plots
them. The state is saved with ``accelerator.save_state`` at the end of every epoch and
``--resume`` continues from the last one.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Subset

from lightning_dynamix.data.workloads import GaussianMixtureClassificationDataset
from lightning_dynamix.integrations.accelerate import DynamixAccelerate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128, help="initial samples per rank and step")
    parser.add_argument("--controller", default="pid", help="static, pid or goodput")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--slow-rank", type=int, default=1, help="rank to slow down (-1: none)")
    parser.add_argument("--factor", type=float, default=3.0, help="how many times slower that rank is")
    parser.add_argument("--output-dir", type=Path, default=Path("dynamix_runs/accelerate"))
    parser.add_argument("--resume", action="store_true", help="continue from the last saved state")
    parser.add_argument(
        "--gradient-accumulation-steps", type=int, default=1, help="batches per optimizer step (default 1)"
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        log_with="tensorboard",
        project_dir=str(args.output_dir),
        gradient_accumulation_steps=args.gradient_accumulation_steps,
    )
    accelerator.init_trackers("train")
    dynamix = DynamixAccelerate(accelerator, controller=args.controller, interval=5, warmup_steps=5)

    data = GaussianMixtureClassificationDataset(num_samples=16384 + 4096, seed=0)
    train, val = Subset(data, range(16384)), Subset(data, range(16384, len(data)))
    torch.manual_seed(0)
    network = nn.Sequential(nn.Linear(32, 768), nn.ReLU(), nn.Linear(768, 768), nn.ReLU(), nn.Linear(768, 10))
    optimizer = torch.optim.SGD(network.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer, loader, val_loader = dynamix.prepare(
        network,
        optimizer,
        DataLoader(train, batch_size=args.batch_size, shuffle=True),  # the first DataLoader trains
        DataLoader(val, batch_size=1024),  # sharded by Accelerate as usual
    )
    checkpoint = args.output_dir / "checkpoint"
    first_epoch = 0
    if args.resume and checkpoint.exists():
        accelerator.load_state(str(checkpoint))
        first_epoch = loader.epoch  # the epoch after the last one saved

    for epoch in range(first_epoch, args.epochs):
        loader.set_epoch(epoch)
        model.train()
        for x, y in loader:
            with accelerator.accumulate(model):  # synchronises every --gradient-accumulation-steps batches
                began = time.perf_counter()
                loss = F.cross_entropy(model(x), y)
                if accelerator.process_index == args.slow_rank:  # forward and backward take about 3x the forward
                    time.sleep((args.factor - 1) * 3 * (time.perf_counter() - began))
                dynamix.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            dynamix.step(loss)
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in val_loader:
                hits = accelerator.gather_for_metrics((model(x).argmax(1) == y).float())
                correct += hits.sum().item()
                total += hits.numel()
        accelerator.log({"val_acc": correct / total}, step=dynamix.global_step)
        accelerator.print(
            f"epoch {epoch}: validation accuracy {correct / total:.3f}, batch sizes {list(dynamix.batch_sizes)}"
        )
        accelerator.save_state(str(checkpoint))
    accelerator.end_training()


if __name__ == "__main__":
    main()
