"""Row-wise sharding of an embedding table over embedding servers, and routing a batch's ids to them.

Row ``i`` of a table with ``num_rows`` rows lives on server ``i % num_shards`` at local row
``i // num_shards``. Interleaving (rather than contiguous blocks) spreads the hottest ids over every
server when ids are numbered by frequency, as tokenised categorical data often is, and makes a
checkpoint re-shardable into any number of servers: the full table is the shards interleaved back
(:meth:`RowSharding.join`), and any other sharding splits it again (:meth:`RowSharding.split`).
"""

from __future__ import annotations

import functools
import itertools
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
        """The rows of ``unique`` from each server's answer (rows in ``shard_rows`` order), in the answers' dtype.

        A server that holds none of the rows answers with an empty tensor, which must have the table's
        dtype too: the rows are never cast, so a table keeps its own.

        Raises:
            ValueError: for answers of different dtypes, naming them.
        """
        first = shard_values[0]
        dtypes = {values.dtype for values in shard_values}
        if len(dtypes) > 1:
            names = ", ".join(sorted(map(dtype_name, dtypes)))
            raise ValueError(f"the servers' answers for one table have different dtypes: {names}")
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


@dataclass(frozen=True)
class TablesRoute:
    """Several tables' ids, deduplicated together and grouped by server: a step's lookup of every table.

    :func:`route_tables` gives every table a block of one id space (table ``t``'s row ``i`` is id
    ``base[t] + i``, each base a multiple of the number of servers, so an id's server is its row's),
    and deduplicates and groups the whole batch with a handful of tensor operations instead of a
    handful per table. The distinct ids come out ordered by table, then row: table ``t``'s rows are
    the ``sizes[t]`` entries from ``starts[t]`` on. ``unique`` and ``inverse`` are kept per table
    already (rows of its own table, positions among its own rows), so a table's share of them is a
    view, not a computation, on every step.

    Attributes:
        tables: the tables, in the order of their blocks.
        unique: the distinct rows of the batch, each as a row of its own table: table by table, ascending.
        inverse: for every id of the batch (the tables' ids flattened, one after another), its position
            among its own table's entries of ``unique``.
        sizes: per table, how many of ``unique`` are its rows.
        lengths: per table, how many ids of the batch are its.
        shard_positions: per server, the positions in ``unique`` of the ids it holds (ordered by table).
        shard_rows: per server, per table it holds rows of, the local rows to fetch.
        shard_counts: per server, per table (in ``tables`` order), how many of its positions are the table's.
    """

    tables: tuple[str, ...]
    unique: torch.Tensor
    inverse: torch.Tensor
    sizes: tuple[int, ...]
    lengths: tuple[int, ...]
    shard_positions: tuple[torch.Tensor, ...]
    shard_rows: tuple[dict[str, torch.Tensor], ...]
    shard_counts: tuple[tuple[int, ...], ...]

    @functools.cached_property
    def _starts(self) -> tuple[int, ...]:  # where each table's entries of ``unique`` begin
        return (0, *itertools.accumulate(self.sizes[:-1]))

    @functools.cached_property
    def _offsets(self) -> tuple[int, ...]:  # where each table's ids begin in ``inverse``
        return (0, *itertools.accumulate(self.lengths[:-1]))

    def table(self, index: int) -> Route:
        """Table ``tables[index]``'s own distinct ids and inverse (its server grouping left empty)."""
        start, offset = self._starts[index], self._offsets[index]
        unique = self.unique[start : start + self.sizes[index]]
        inverse = self.inverse[offset : offset + self.lengths[index]]
        return Route(unique, inverse, (), ())

    def assemble(
        self, answers: Sequence[dict[str, torch.Tensor]], dim: int, dtype: torch.dtype | None = None
    ) -> list[torch.Tensor]:
        """Per table, the rows of its distinct ids, from each server's answer (per table, rows in ``shard_rows`` order).

        The tables' rows are consecutive slices of one tensor, each its own tensor to autograd: so the
        tables routed together must share their row length ``dim`` and their ``dtype`` (None: that of the
        answers, of which there must then be one). Nothing is cast: a table of another dtype is an error.

        Raises:
            ValueError: for an answer whose dtype is not ``dtype`` (or not the others'), naming its table.
        """
        if dtype is None:
            given = [answers[server][table] for server in range(len(answers)) for table in self.shard_rows[server]]
            if not given:
                raise ValueError("no server answered any row: give the rows' `dtype`")
            dtype = given[0].dtype
        out = torch.empty((len(self.unique), dim), dtype=dtype)
        for server, positions in enumerate(self.shard_positions):
            if len(positions):
                parts = [answers[server][table] for table in self.shard_rows[server]]
                for table, part in zip(self.shard_rows[server], parts):
                    if part.dtype != dtype:
                        raise ValueError(
                            f"embedding {table!r}: server {server} answered {dtype_name(part.dtype)} rows, routed"
                            f" together with {dtype_name(dtype)} ones; route tables of different dtypes apart"
                        )
                out.index_copy_(0, positions, parts[0] if len(parts) == 1 else torch.cat(parts))
        return list(out.split(self.sizes))

    def split(
        self, unique_values: torch.Tensor, tables: set[str]
    ) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Per server, per table of ``tables``: the server's local rows of it and their entries of ``unique_values``.

        ``unique_values`` has one entry per id of ``unique`` (every table's rows, in order), as
        :meth:`assemble` gave them. Every server gets every table of ``tables``, with no rows where
        it holds none of the batch (its optimiser counts the step all the same); the tables not in
        ``tables`` are left out.
        """
        out = []
        no_rows = self.unique.new_empty((0,))
        for server, positions in enumerate(self.shard_positions):
            rows = self.shard_rows[server]
            values = unique_values.index_select(0, positions).split(self.shard_counts[server])
            out.append(
                {
                    table: (rows.get(table, no_rows), grads)
                    for table, grads in zip(self.tables, values)
                    if table in tables
                }
            )
        return out


def route_tables(ids: dict[str, torch.Tensor], shardings: dict[str, RowSharding]) -> TablesRoute:
    """Deduplicate several tables' ids at once (each any shape) and group them by server.

    Every table must be sharded over the same servers.

    Raises:
        ValueError: for an id outside its table's ``[0, num_rows)``, naming the table and the id.
    """
    tables = tuple(ids)
    shards = {shardings[table].num_shards for table in tables}
    if len(shards) != 1:
        raise ValueError(f"the tables are sharded over different numbers of servers: {sorted(shards)}")
    servers = shards.pop()
    flats = [ids[table].reshape(-1).long() for table in tables]
    lengths = tuple(flat.numel() for flat in flats)
    rows = torch.tensor([shardings[table].num_rows for table in tables])
    blocks = (rows + servers - 1) // servers * servers
    bases = blocks.cumsum(0) - blocks
    table_of_id = torch.repeat_interleave(torch.arange(len(tables)), torch.tensor(lengths))
    flat = torch.cat(flats)
    bad = (flat < 0) | (flat >= rows[table_of_id])
    if bool(bad.any()):
        first = int(torch.nonzero(bad)[0, 0])
        table = tables[int(table_of_id[first])]
        limit = shardings[table].num_rows
        raise ValueError(f"embedding {table!r}: id {int(flat[first])} is outside [0, {limit}) (its num_embeddings)")
    unique, inverse = torch.unique(flat + bases[table_of_id], sorted=True, return_inverse=True)
    table_of = torch.searchsorted(bases, unique, right=True) - 1
    sizes = torch.bincount(table_of, minlength=len(tables))
    starts = sizes.cumsum(0) - sizes
    own_rows = unique - bases[table_of]  # each id as a row of its own table
    local = own_rows // servers
    shard_of = unique % servers
    positions, shard_rows, shard_counts = [], [], []
    for server in range(servers):
        where = torch.nonzero(shard_of == server).reshape(-1) if servers > 1 else torch.arange(len(unique))
        counts = tuple(torch.bincount(table_of[where], minlength=len(tables)).tolist())
        positions.append(where)
        shard_counts.append(counts)
        shard_rows.append(
            {table: part for table, part, count in zip(tables, local[where].split(counts), counts) if count}
        )
    return TablesRoute(
        tables,
        own_rows,
        inverse - starts[table_of_id],  # positions among its own table's rows
        tuple(sizes.tolist()),
        lengths,
        tuple(positions),
        tuple(shard_rows),
        tuple(shard_counts),
    )


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as users write it in messages: ``float64``, not ``torch.float64``."""
    return str(dtype).removeprefix("torch.")
