"""A trainer's lookups and pushes: the rows of a step asked for before it runs, its row gradients sent after.

A LightningModule that defines ``embedding_ids(batch) -> {table name: ids}`` has every table of a batch
looked up in one request per server (:func:`prefetch_rows`); its tables' forwards then use those rows.
With ``prefetch_depth`` the training DataLoader is read ahead (:class:`ReadAhead`, or a
:class:`~lightning_dynamix.data.HeterogeneousDataLoader`'s own ``read_ahead``), and a batch's rows are asked
for while the steps before it run; :func:`read_ahead_depth` says whether that can work. After the
optimizer step, :func:`push_rows` sends the step's row gradients to the servers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_dynamix.data import EmptyBatch, HeterogeneousDataLoader
from lightning_dynamix.data.loader import iterate_ahead
from lightning_dynamix.offload.remote import EMBEDDING_TYPES, EmbeddingClient, RemoteTable
from lightning_dynamix.strategies.layer_offload.tables import submodule

BatchRead = Callable[[Any, int], None]
"""``on_read(batch, ahead)``: a batch was read, to be trained ``ahead`` steps after the current one."""


class ReadAhead:
    """A training DataLoader read ``depth`` batches ahead: each batch, as it is read, is handed to ``on_read``,
    which asks the servers for its rows ``ahead`` steps before it is trained on."""

    def __init__(self, dataloader: Any, depth: int, on_read: BatchRead) -> None:
        self.dataloader, self.depth, self.on_read = dataloader, depth, on_read

    def __iter__(self) -> Iterator[Any]:
        return iterate_ahead(self.dataloader, self.depth, self.on_read)

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:  # sampler, dataset, batch_size, ... as Lightning reads them
        return getattr(self.dataloader, name)


def read_ahead_depth(prefetch_depth: int | None, dataloader: object, module: LightningModule | None) -> int:
    """How many batches of ``dataloader`` to read ahead: ``prefetch_depth``, checked, or (None) 1 where reading
    ahead can work and 0 where it cannot; 0 outside training.

    Raises:
        MisconfigurationException: for a ``prefetch_depth`` set where reading ahead cannot work.
    """
    trainer = module.trainer if module is not None else None
    if trainer is None or trainer.state.stage != RunningStage.TRAINING or prefetch_depth == 0:
        return 0
    reasons = read_ahead_refusals(module, trainer)
    # a HeterogeneousDataLoader reads ahead beneath its count of the batches handed out
    parts = (
        ()
        if isinstance(dataloader, HeterogeneousDataLoader)
        else (dataloader, getattr(dataloader, "batch_sampler", None))
    )
    for part in parts:
        if hasattr(part, "state_dict") and hasattr(part, "load_state_dict"):
            reasons.append(
                f"the training dataloader's {type(part).__name__} keeps a state of the batches it handed out,"
                " which would count a batch read ahead as trained"
            )
    if not reasons:
        return 1 if prefetch_depth is None else prefetch_depth
    if prefetch_depth is not None:
        refuse_read_ahead(prefetch_depth, reasons)
    return 0


def read_ahead_refusals(module: LightningModule, trainer: Any) -> list[str]:
    """Why the model or the Trainer cannot have batches read ahead (the dataloader aside)."""
    reasons = []
    if not hasattr(module, "embedding_ids"):
        reasons.append(f"{type(module).__name__} defines no `embedding_ids(batch)` naming the ids of a batch")
    if trainer.accumulate_grad_batches != 1:
        reasons.append(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} trains several batches per optimizer"
            " step, and reading ahead asks for a batch's rows by its optimizer step"
        )
    return reasons


def refuse_read_ahead(prefetch_depth: int | None, reasons: list[str]) -> None:
    """Raise for ``reasons`` why ``prefetch_depth`` cannot read ahead, if there are any.

    Raises:
        MisconfigurationException: naming them all, and what to set instead.
    """
    if reasons:
        raise MisconfigurationException(
            f"`prefetch_depth={prefetch_depth}` reads training batches ahead, and cannot here: "
            + "; ".join(reasons)
            + ". Set prefetch_depth=0 (or leave it unset) to look each step up when it starts."
        )


def prefetch_rows(
    client: EmbeddingClient, tables: Mapping[str, RemoteTable], module: LightningModule, batch: Any, ahead: int
) -> None:
    """Ask the servers for the rows of every table ``module.embedding_ids(batch)`` names, one request per server,
    for the step ``ahead`` steps after the current one (0: the current one, or evaluation).

    A module without ``embedding_ids``, a batch read ahead outside training and a rank that sits the step out
    look nothing up.

    Raises:
        TypeError: for ``embedding_ids`` that returns no mapping, or a value that is no tensor.
        ValueError: for a name that is no embedding module of ``module``.
    """
    hook = getattr(module, "embedding_ids", None)
    training = bool(tables) and next(iter(tables.values())).training
    if hook is None or (ahead and not training) or isinstance(batch, EmptyBatch):
        return  # a rank that sits a step out looks nothing up
    ids = hook(batch)
    if not isinstance(ids, Mapping):
        raise TypeError(
            f"{type(module).__name__}.embedding_ids(batch) must return a mapping of offloaded table names"
            f" to id tensors, got {type(ids).__name__}"
        )
    lookups = {}
    for name, value in ids.items():
        table = tables.get(name)
        if table is None:
            if isinstance(submodule(module, name), EMBEDDING_TYPES):
                continue  # a table `offload` left in the trainer: its lookup is local
            raise ValueError(
                f"{type(module).__name__}.embedding_ids(batch) names {name!r}, which is not an embedding"
                f" module of the model; the offloaded tables are {sorted(tables)}"
            )
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{type(module).__name__}.embedding_ids(batch)[{name!r}] must be a tensor of ids,"
                f" got {type(value).__name__}"
            )
        lookups[name] = (table.sharding, table.embedding_dim, table.dtype, value)
    if lookups:
        client.prefetch(lookups, training=training, ahead=ahead)


def push_rows(client: EmbeddingClient, weight: float, loss_scale: float | None, scale_after: float | None) -> None:
    """Send the step's row gradients to the servers, multiplied there by ``weight``.

    Args:
        client: this trainer's connection.
        weight: this trainer's factor on its row gradients (``1 / trainers`` for the mean DDP takes).
        loss_scale: the GradScaler's scale the step's backward passes used (fp16 mixed precision), which the
            rows' gradients carry; None without a GradScaler.
        scale_after: its scale after the optimizer step: lower where it found inf or NaN and skipped the step,
            which the tables then skip too.
    """
    if loss_scale is None:
        client.push(weight)
    elif scale_after is not None and scale_after < loss_scale:  # it skipped the step (its scale backed off)
        client.push(weight, drop=True)
    else:
        client.push(weight / loss_scale)
