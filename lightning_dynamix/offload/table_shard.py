"""One embedding server's part of one table: its rows, the optimiser's state for them, and re-sharding.

A :class:`TableShard` answers lookups of its local rows and applies the sparse optimiser to the
rows a batch touched. Its :meth:`~TableShard.state_dict` is what a checkpoint holds for it; the
states of all shards of a table re-shard into any other number of servers
(:func:`reshard_states`), rows and per-row optimiser state alike, so a job can resume on more or
fewer embedding servers without losing anything trained.

Every shard of a table takes part in every update of it (with no rows when the batch touched none
of its rows), so the optimiser's update count, which Adagrad's learning-rate decay reads, is the
same on every shard, as it is for the whole table in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_dynamix.offload.sharding import RowSharding
from lightning_dynamix.offload.sparse_optim import SparseRowOptimizer


class TableShard:
    """Rows ``shard, shard + n, shard + 2n, ...`` of table ``name`` and their optimiser state.

    Args:
        name: the table (the embedding module's name), for messages and checkpoints.
        sharding: how the table is split over the servers.
        shard: which part this is.
        weight: this shard's rows (``sharding.shard_rows(shard)`` rows); trained in place.
        optimizer: the sparse optimiser applied on updates.
    """

    def __init__(
        self, name: str, sharding: RowSharding, shard: int, weight: torch.Tensor, optimizer: SparseRowOptimizer
    ) -> None:
        expected = sharding.shard_rows(shard)
        if weight.dim() != 2 or weight.shape[0] != expected:
            raise ValueError(
                f"table {name!r} shard {shard}: `weight` must have {expected} rows and 2 dimensions,"
                f" got shape {tuple(weight.shape)}"
            )
        self.name, self.sharding, self.shard = name, sharding, shard
        self.weight = weight
        self.optimizer = optimizer
        self.state = optimizer.init_state(weight)

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """The current values of local ``rows``."""
        return self.weight.index_select(0, rows)  # faster than weight[rows] on a CPU (docs/internals.md)

    def update(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """One optimiser update of local ``rows`` (distinct; may be empty) from their summed gradients."""
        with torch.no_grad():
            self.optimizer.step(self.weight, self.state, rows, grads)

    def state_dict(self) -> dict[str, Any]:
        """Rows and optimiser state, with where they belong (for a checkpoint)."""
        return {
            "name": self.name,
            "num_rows": self.sharding.num_rows,
            "num_shards": self.sharding.num_shards,
            "shard": self.shard,
            "optimizer": self.optimizer.name,
            "weight": self.weight.detach().clone(),
            "state": _copied(self.state),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore rows and optimiser state saved by a shard of the same table, sharding and optimiser.

        The rows and the optimiser's floating-point state keep this shard's dtype (the table's): saved in
        another, they are cast to it, as ``nn.Module.load_state_dict`` and ``torch.optim.Optimizer.load_state_dict``
        cast a parameter and its state.
        """
        mine = (self.name, self.sharding.num_rows, self.sharding.num_shards, self.shard, self.optimizer.name)
        theirs = tuple(state_dict[k] for k in ("name", "num_rows", "num_shards", "shard", "optimizer"))
        if mine != theirs:
            raise ValueError(
                f"cannot load the state of (table, rows, shards, shard, optimizer) = {theirs} into {mine};"
                " re-shard it first with reshard_states()"
            )
        self.weight.copy_(state_dict["weight"])
        self.state = _copied(state_dict["state"], self.weight.dtype)


def _copied(state: dict[str, Any], dtype: torch.dtype | None = None) -> dict[str, Any]:
    """A copy of optimiser state; with ``dtype``, its floating-point tensors in that dtype."""
    copied = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            cast = dtype is not None and value.is_floating_point()
            value = value.to(dtype, copy=True) if cast else value.clone()
        copied[key] = value
    return copied


def reshard_states(states: Sequence[dict[str, Any]], num_shards: int, row_keys: Sequence[str]) -> list[dict[str, Any]]:
    """The states of every shard of one table, re-split over ``num_shards`` servers.

    Args:
        states: one :meth:`TableShard.state_dict` per shard of the table, in any order.
        num_shards: servers of the new sharding.
        row_keys: the optimiser state entries that are per row
            (:meth:`SparseRowOptimizer.row_state_keys`); the others must agree on every shard.

    Raises:
        ValueError: when the states are not exactly the shards of one table.
    """
    if not states:
        raise ValueError("`states` is empty: give the state of every shard of the table")
    first = states[0]
    old = RowSharding(first["num_rows"], first["num_shards"])
    by_shard = {s["shard"]: s for s in states}
    if sorted(by_shard) != list(range(old.num_shards)) or len(states) != old.num_shards:
        raise ValueError(
            f"table {first['name']!r} was split over {old.num_shards} shards; got the states of shards"
            f" {sorted(s['shard'] for s in states)}"
        )
    ordered = [by_shard[s] for s in range(old.num_shards)]
    for s in ordered:
        for key in set(first["state"]) - set(row_keys):
            if s["state"][key] != first["state"][key]:
                raise ValueError(f"table {first['name']!r}: shards disagree on {key!r} ({s['state'][key]!r})")
    new = RowSharding(old.num_rows, num_shards)
    weights = new.split(old.join([s["weight"] for s in ordered]))
    rows = {key: new.split(old.join([s["state"][key] for s in ordered])) for key in row_keys}
    return [
        {
            **first,
            "num_shards": num_shards,
            "shard": shard,
            "weight": weights[shard],
            "state": {**first["state"], **{key: rows[key][shard] for key in row_keys}},
        }
        for shard in range(num_shards)
    ]
