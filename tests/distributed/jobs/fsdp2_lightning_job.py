"""Trains with HeterogeneousFSDPStrategy (fully_shard in configure_model) on uneven, changing sizes, 0 included.

Usage: python fsdp2_lightning_job.py WORLD_SIZE OUT_DIR

Each scenario (a network, an optimizer, an accumulation) trains two epochs in float64 while a callback changes the
per-rank sizes mid-epoch (inside accumulation windows too), giving a rank 0 samples at some steps; every rank saves
what it saw and the full parameters. tests/distributed/test_fsdp2.py compares them with one process.
"""

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from common import NUM_CLASSES, NUM_FEATURES, Net, Recorder, Resizer, batch_norm_network, make_network, quiet_trainer
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_dynamix import HeterogeneousFSDPStrategy
from lightning_dynamix.distributed.batch_norm import convert_batch_norm

# name: (network, optimizer, accumulate_grad_batches)
SCENARIOS = {
    "mlp-sgd": ("mlp", "sgd", 1),
    "batch-norm-sgd": ("batch-norm", "sgd", 1),
    "transformer-adam-acc2": ("transformer", "adam", 2),
}


class TokenClassifier(nn.Module):
    """A transformer block over a sample's 4 features read as 2 tokens of 2: projection, encoder layer, pooled head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(NUM_FEATURES // 2, 8)
        self.block = nn.TransformerEncoderLayer(8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.view(x.shape[0], 2, NUM_FEATURES // 2))
        return self.head(self.block(tokens).mean(dim=1))


def network(name: str, seed: int = 0) -> nn.Module:
    """The scenario's network, the same in the job and in the one-process reference."""
    if name == "mlp":
        return make_network(seed)
    if name == "batch-norm":
        return batch_norm_network(seed)
    torch.manual_seed(seed)
    return TokenClassifier().double()


def shard(net: nn.Module, mesh) -> nn.Module:
    """``net`` with BatchNorm over the global batch, ``fully_shard`` on each linear layer or block and on the root."""
    net = convert_batch_norm(net)  # a no-op without BatchNorm
    for layer in net.children():
        if isinstance(layer, nn.Linear | nn.TransformerEncoderLayer):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


class ShardedNet(Net):
    def __init__(self, architecture: str, optimizer: str) -> None:
        super().__init__(optimizer=optimizer)
        self.net = network(architecture)

    def configure_model(self) -> None:
        self.net = shard(self.net, self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        logits = self.net(x)
        self.log("probe_loss", F.cross_entropy(logits, y), sync_dist=True, on_step=True, on_epoch=False)
        return F.cross_entropy(logits, y)


if __name__ == "__main__":
    world_size, out = int(sys.argv[1]), Path(sys.argv[2])
    if world_size == 2:
        initial = [3, 7]
        plan = {(0, 2): [0, 8], (0, 5): [1, 9], (1, 1): [5, 0], (1, 4): [2, 3]}
    else:
        initial = [3, 7, 5]
        plan = {(0, 2): [6, 0, 4], (0, 5): [0, 9, 1], (1, 1): [4, 4, 4], (1, 4): [2, 0, 1]}
    for name, (architecture, optimizer, accumulate) in SCENARIOS.items():
        recorder = Recorder()
        strategy = HeterogeneousFSDPStrategy(
            batch_sizes=initial, min_batch_size=0, seed=11, timeout=timedelta(seconds=60)
        )
        trainer = quiet_trainer(
            devices=world_size,
            strategy=strategy,
            max_epochs=2,
            accumulate_grad_batches=accumulate,
            precision="32-true",  # ModelParallelStrategy refuses "64-true": the network and the data are float64
            callbacks=[recorder, Resizer(plan)],
        )
        model = ShardedNet(architecture, optimizer)
        trainer.fit(model)
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.net.state_dict().items()}
        torch.save(
            {
                "steps": recorder.steps,
                "probes": recorder.probes,
                "state": {k: v.detach().cpu() for k, v in state.items()},
            },
            out / f"{name}-rank{trainer.global_rank}.pt",
        )
