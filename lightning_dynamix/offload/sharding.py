"""Row-wise sharding of an embedding table over embedding servers, and routing a batch's ids to them.

Row ``i`` of a table with ``num_rows`` rows lives on server ``i % num_shards`` at local row
``i // num_shards``. Interleaving (rather than contiguous blocks) spreads the hottest ids over every
server when ids are numbered by frequency, as tokenised categorical data often is, and makes a
checkpoint re-shardable into any number of servers: the full table is the shards interleaved back
(:meth:`RowSharding.join`), and any other sharding splits it again (:meth:`RowSharding.split`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_dynamix._checks import require_int


@dataclass(frozen=True)
class RowSharding:
    """Rows ``0 .. num_rows - 1`` of one table interleaved over ``num_shards`` servers.

    Args:
        num_rows: rows of the table (its ``num_embeddings``).
        num_shards: servers holding it.
    """

    num_rows: int
    num_shards: int

    def __post_init__(self) -> None:
        require_int("num_rows", self.num_rows, 1)
        require_int("num_shards", self.num_shards, 1)

    def shard_rows(self, shard: int) -> int:
        """How many rows server ``shard`` holds."""
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"`shard` must be in [0, {self.num_shards}), got {shard!r}")
        return (self.num_rows - shard + self.num_shards - 1) // self.num_shards

    def locate(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(shard, local row)`` of every id."""
        return ids % self.num_shards, ids // self.num_shards

    def global_ids(self, shard: int, local: torch.Tensor) -> torch.Tensor:
        """The table rows of server ``shard``'s local rows ``local``."""
        return local * self.num_shards + shard

    def split(self, table: torch.Tensor) -> list[torch.Tensor]:
        """The shards of a full table (rows along dimension 0), one per server."""
        if table.shape[0] != self.num_rows:
            raise ValueError(f"the table has {table.shape[0]} rows, the sharding {self.num_rows}")
        return [table[shard :: self.num_shards].clone() for shard in range(self.num_shards)]

    def join(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full table from its shards (the inverse of :meth:`split`)."""
        if len(shards) != self.num_shards:
            raise ValueError(f"got {len(shards)} shards for a sharding over {self.num_shards}")
        for shard, rows in enumerate(shards):
            if rows.shape[0] != self.shard_rows(shard):
                raise ValueError(f"shard {shard} has {rows.shape[0]} rows, expected {self.shard_rows(shard)}")
        table = shards[0].new_empty((self.num_rows, *shards[0].shape[1:]))
        for shard, rows in enumerate(shards):
            table[shard :: self.num_shards] = rows
        return table


@dataclass(frozen=True)
class Route:
    """One batch's ids, deduplicated and grouped by server.

    Attributes:
        unique: the distinct ids of the batch, ascending.
        inverse: for every id of the batch (flattened), its position in ``unique``.
        shard_positions: per server, the positions in ``unique`` of the ids it holds.
        shard_rows: per server, the local rows to fetch (aligned with ``shard_positions``).
    """

    unique: torch.Tensor
    inverse: torch.Tensor
    shard_positions: tuple[torch.Tensor, ...]
    shard_rows: tuple[torch.Tensor, ...]

    def assemble(self, shard_values: Sequence[torch.Tensor]) -> torch.Tensor:
        """The rows of ``unique`` from each server's answer (rows in ``shard_rows`` order)."""
        first = shard_values[0]
        out = first.new_empty((len(self.unique), *first.shape[1:]))
        for positions, values in zip(self.shard_positions, shard_values):
            out[positions] = values
        return out

    def split(self, unique_values: torch.Tensor) -> list[torch.Tensor]:
        """Per server, the entries of ``unique_values`` (one per id of ``unique``) for the rows it holds.

        With the batch's embeddings built as ``assemble(...)[inverse]``, autograd sums the gradients
        of duplicate ids into the gradient of the assembled rows; this splits that per server.
        """
        return [unique_values[positions] for positions in self.shard_positions]


def route(ids: torch.Tensor, sharding: RowSharding, table: str = "table") -> Route:
    """Deduplicate ``ids`` (any shape) and group them by the server holding each.

    Raises:
        ValueError: for an id outside ``[0, num_rows)``, naming ``table`` and the id.
    """
    flat = ids.reshape(-1).long()
    if flat.numel():
        low, high = int(flat.min()), int(flat.max())
        if low < 0 or high >= sharding.num_rows:
            bad = low if low < 0 else high
            raise ValueError(f"embedding {table!r}: id {bad} is outside [0, {sharding.num_rows}) (its num_embeddings)")
    unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    shard_of, local = sharding.locate(unique)
    positions = tuple(torch.nonzero(shard_of == s).reshape(-1) for s in range(sharding.num_shards))
    return Route(unique, inverse, positions, tuple(local[p] for p in positions))
