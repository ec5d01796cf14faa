"""Trains a model of embedding tables of several dtypes with the layer-offload strategies, one scenario per fit.

    python offload_dtype_job.py TRAINERS OUT SCENARIO [SCENARIO ...]

The job sets ``torch.set_default_dtype(torch.float64)`` as it starts, as a model checked for exactness
does: its dense layers and the tables built without a dtype are float64, while the embedding servers
the strategy starts keep torch's float32 default. Every fit trains :data:`EPOCHS` epochs of
:data:`STEPS_PER_EPOCH` steps of 16 samples, unshuffled: 1 trainer with ``LayerOffloadStrategy``, 2
trainers with ``HeterogeneousLayerOffloadStrategy(batch_sizes=[5, 11])``, so every step trains the same
16 samples. Rank 0 writes the trained model (the tables come back from the servers at the end) to
``OUT/<scenario>.pt``.

Scenarios:

* ``mixed-SERVERS-LOOKUP``: :class:`MixedTables` (tables of float64, float32, bfloat16 and float16, four
  of one row length) with SGD; ``LOOKUP`` is ``ahead`` (:class:`MixedTablesLookedUpAhead`: every table
  looked up at once, the batch read ahead) or ``fetch`` (each table's forward looks its rows up).
* ``report``: the defect report's model, :class:`TwoTables` (two float64 tables, no ``embedding_ids``),
  ``sparse_optimizer="sgd"``, 2 servers.
* ``resume-OLD-NEW``: :class:`MixedTablesLookedUpAhead` with Adagrad, one epoch on OLD servers with a
  checkpoint (kept under ``OUT/<scenario>/``), then a second Trainer resumes it on NEW servers.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_dynamix.data import CTRSpec, SyntheticCTRDataset
from lightning_dynamix.strategies import HeterogeneousLayerOffloadStrategy, LayerOffloadStrategy

BATCH, STEPS_PER_EPOCH, EPOCHS = 16, 4, 2
SIZES = [5, 11]  # the two trainers' batch sizes: the defect report's
LR = {"sgd": 0.5, "adagrad": 0.1}
# name: (rows, row length, dtype; None: the default dtype, float64 in the job). Four tables of one row
# length and four dtypes: those looked up together must not be assembled into one tensor.
TABLES = {
    "wide64": (31, 4, None),
    "wide32": (23, 4, torch.float32),
    "bf16": (17, 4, torch.bfloat16),
    "fp16": (13, 4, torch.float16),
    "narrow64": (7, 3, None),
}
MAIN = ("wide64", "wide32", "narrow64")  # the tables of the click logit; the others have a term each
NUM_DENSE = 3
TIMEOUT = timedelta(seconds=60)  # the strategy's: a server that stops answering fails the fit within it


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` for a while (the tests build the job's models under it)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def make_dataset(samples: int, tables: tuple[int, ...], seed: int = 3) -> SyntheticCTRDataset:
    return SyntheticCTRDataset(samples, CTRSpec(num_dense=NUM_DENSE, table_sizes=tables, seed=seed))


class MixedTables(LightningModule):
    """A CTR model whose tables have different dtypes.

    The click logit reads the float64 and float32 tables; each low-precision table has a term of its own
    (its rows projected on a fixed vector, against the label), so its rounding does not reach the others:
    those are compared with one process to 1e-6, the low-precision ones to their own precision.
    """

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tables = nn.ModuleDict(
            {name: nn.Embedding(rows, dim, dtype=dtype) for name, (rows, dim, dtype) in TABLES.items()}
        )
        width = NUM_DENSE + sum(TABLES[name][1] for name in MAIN)
        self.head = nn.Linear(width, 1)
        self.register_buffer("probe", torch.linspace(-1.0, 1.0, 4))
        self.optimizer_name = optimizer

    def loss(self, batch) -> torch.Tensor:
        dense, sparse, labels = batch
        dtype = self.head.weight.dtype
        rows = {name: self.tables[name](sparse[:, index]) for index, name in enumerate(TABLES)}
        features = torch.cat([dense.to(dtype), *(rows[name].to(dtype) for name in MAIN)], 1)
        labels = labels.to(dtype)
        loss = F.binary_cross_entropy_with_logits(self.head(features).squeeze(1), labels)
        for name in TABLES:
            if name not in MAIN:
                loss = loss + ((rows[name].to(dtype) @ self.probe - labels) ** 2).mean()
        return loss

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=LR["sgd"])
        # eps above float16's smallest number: torch's dense Adagrad divides a row never touched by it
        return torch.optim.Adagrad(self.parameters(), lr=LR["adagrad"], eps=1e-4)

    def train_dataloader(self) -> DataLoader:
        samples = BATCH * STEPS_PER_EPOCH
        return DataLoader(make_dataset(samples, tuple(rows for rows, _, _ in TABLES.values())), batch_size=BATCH)


class MixedTablesLookedUpAhead(MixedTables):
    """:class:`MixedTables` naming its batch's ids: every table is looked up at once, the batch read ahead."""

    def embedding_ids(self, batch) -> dict[str, torch.Tensor]:
        _, sparse, _ = batch
        return {f"tables.{name}": sparse[:, index] for index, name in enumerate(TABLES)}


class TwoTables(LightningModule):
    """The defect report's model: two tables of the default dtype (float64 in the job), a logistic head."""

    TABLE_SIZES = (6, 40)
    DATA_SEED = 9  # at the first step, rank 0's 5 samples hold none of server 0's rows of the first table

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Embedding(self.TABLE_SIZES[0], 4)
        self.second = nn.Embedding(self.TABLE_SIZES[1], 4)
        self.head = nn.Linear(NUM_DENSE + 8, 1)

    def loss(self, batch) -> torch.Tensor:
        dense, sparse, labels = batch
        dtype = self.head.weight.dtype
        features = torch.cat([dense.to(dtype), self.first(sparse[:, 0]), self.second(sparse[:, 1])], 1)
        return F.binary_cross_entropy_with_logits(self.head(features).squeeze(1), labels.to(dtype))

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR["sgd"])

    def train_dataloader(self) -> DataLoader:
        dataset = make_dataset(BATCH * STEPS_PER_EPOCH, self.TABLE_SIZES, self.DATA_SEED)
        return DataLoader(dataset, batch_size=BATCH)


def fit(model: LightningModule, trainers: int, servers: int, epochs: int, out: Path, **kwargs) -> Trainer:
    callbacks = kwargs.pop("callbacks", [])
    ckpt_path = kwargs.pop("ckpt_path", None)
    if trainers == 1:
        strategy = LayerOffloadStrategy(num_embedding_servers=servers, timeout=TIMEOUT, **kwargs)
    else:  # the global batch of 16, split as the report's; unshuffled, the same samples as one process's batches
        strategy = HeterogeneousLayerOffloadStrategy(
            batch_sizes=SIZES, num_embedding_servers=servers, shuffle=False, timeout=TIMEOUT, **kwargs
        )
    trainer = Trainer(
        accelerator="cpu",
        devices=trainers,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        default_root_dir=out,
        use_distributed_sampler=False,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def main() -> None:
    torch.set_default_dtype(torch.float64)
    trainers, out = int(sys.argv[1]), Path(sys.argv[2])
    for scenario in sys.argv[3:]:
        kind, *args = scenario.split("-")
        if kind == "mixed":
            servers, lookup = int(args[0]), args[1]
            model = MixedTablesLookedUpAhead() if lookup == "ahead" else MixedTables()
            trainer = fit(model, trainers, servers, EPOCHS, out)
        elif kind == "report":
            model = TwoTables()
            trainer = fit(model, trainers, 2, EPOCHS, out, sparse_optimizer="sgd")
        elif kind == "resume":
            old, new = map(int, args)
            checkpoints = out / scenario
            model = MixedTablesLookedUpAhead("adagrad")
            fit(model, trainers, old, 1, out, callbacks=[ModelCheckpoint(checkpoints)])
            (ckpt,) = checkpoints.glob("*.ckpt")
            model = MixedTablesLookedUpAhead("adagrad")
            trainer = fit(model, trainers, new, EPOCHS, out, ckpt_path=ckpt)
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
        if trainer.global_rank == 0:
            assert trainer.global_step == STEPS_PER_EPOCH * EPOCHS, trainer.global_step
            torch.save(model.state_dict(), out / f"{scenario}.pt")


if __name__ == "__main__":
    main()
