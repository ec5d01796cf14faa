"""The trainer's side of layer offload: remote embedding modules and their connection to the servers.

:class:`RemoteEmbedding` and :class:`RemoteEmbeddingBag` take the place of a LightningModule's
``nn.Embedding`` / ``nn.EmbeddingBag`` and behave like them in ``forward``: the batch's ids are
deduplicated and routed row-wise to the servers (:func:`~lightning_dynamix.offload.route`), the
distinct rows come back as one leaf tensor in the table's own dtype, and the module's own functional form
(``F.embedding`` / ``F.embedding_bag``) runs on those rows, so padding, bag modes, per-sample
weights and ``scale_grad_by_freq`` mean what they always did. After the backward pass the leaf's
gradient holds exactly the summed gradient of every distinct row; :meth:`EmbeddingClient.push`
sends it to the servers at the optimiser step.

All communication is ``torch.distributed.rpc``. A server that dies or stops answering raises
:class:`EmbeddingServerError` on the trainers, naming the server and what was asked of it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dynamix import _compat
from lightning_dynamix.metrics.clocks import Mark, WaitTimer
from lightning_dynamix.offload import embedding_server as remote
from lightning_dynamix.offload.embedding_server import TableSpec, server_name
from lightning_dynamix.offload.sharding import Route, RowSharding, TablesRoute, route, route_tables

EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)


class EmbeddingServerError(RuntimeError):
    """An embedding server failed, or did not answer within the timeout."""


@dataclass
class _Lookup:
    table: str
    route: Route
    rows: Tensor  # the leaf the batch's embeddings are computed from


_Layout = tuple[int, torch.dtype]  # a table's rows: their length and dtype


@dataclass
class _Prefetch:
    """Tables' rows asked for one step (or for evaluation), arriving as ``rows``, ``{table: rows}``.

    The tables are routed together, one :class:`TablesRoute` per row layout, a row length and a dtype
    (``groups``): the tables of a group are assembled into one tensor, so two tables of one length and
    different dtypes are never mixed. ``leaves`` are the rows handed to the tables' forwards where
    autograd is on, whose gradients :meth:`push` sends.
    """

    ids: dict[str, Tensor]  # the ids each table's forward is expected to pass, until it does
    groups: dict[_Layout, TablesRoute]  # by row layout
    group_of: dict[str, tuple[_Layout, int]]  # table: (its row layout, its index in the group)
    answers: dict[int, torch.futures.Future]  # by server
    rows: torch.futures.Future
    leaves: dict[str, Tensor]
    arrived: dict[str, Tensor] | None = None  # ``rows``' value, once the first table's forward waited for it


class EmbeddingClient:
    """One trainer rank's connection to the embedding servers of a job.

    Args:
        trainer_rank: this trainer's rank among the trainers.
        num_servers: embedding servers of the job.
        timeout_s: how long any answer may take, in seconds.
    """

    def __init__(self, trainer_rank: int, num_servers: int, timeout_s: float) -> None:
        self.trainer_rank = trainer_rank
        self.num_servers = num_servers
        self.timeout_s = timeout_s
        self.step = 0  # the training step lookups are for; advanced by every push
        self._recorded: list[_Lookup] = []
        self._trained: list[_Prefetch] = []  # prefetches whose rows this step trains
        self._pushes: list[tuple[int, torch.futures.Future]] = []
        self._prefetched: dict[int | None, _Prefetch] = {}  # by the step they are for (None: evaluation)
        self.lookup_requests = 0  # lookup requests sent to the servers, one per server per lookup or prefetch
        self.prefetch_misses = 0  # lookups whose ids differed from the ids prefetched for their table
        self.prefetches_ahead = 0  # prefetches for a later step than the current one (pipelined lookups)
        self.closed = False
        self.waited: WaitTimer | None = None
        """Told of every time a lookup waited for the servers' answer, in marks of its ``now()`` (a heterogeneous
        strategy's step clock counts it as a wait, not the trainer's compute)."""

    def close(self) -> None:
        """The servers are stopping: any later use is an error that says so."""
        self.closed = True

    def _call(self, server: int, function: Any, *args: Any) -> torch.futures.Future:
        if self.closed:
            raise EmbeddingServerError(
                "the embedding servers of this table have stopped with the Trainer run that started them;"
                " its trained tables are in that run's checkpoints (or were copied back into the model's own"
                " embedding modules at its end)"
            )
        try:
            return rpc.rpc_async(server_name(server), function, args=args, timeout=self.timeout_s)
        except RuntimeError as error:
            raise self._error(server, function, error) from error

    def _wait(self, server: int, function: Any, future: torch.futures.Future) -> Any:
        try:
            return _checked(future.wait())
        except RuntimeError as error:
            raise self._error(server, function, error) from error

    def _error(self, server: int, function: Any, error: BaseException) -> EmbeddingServerError:
        what = function.__name__.removeprefix("remote_")
        cause = _cause(error)
        return EmbeddingServerError(
            f"embedding server {server} ({server_name(server)}) failed or did not answer within"
            f" {self.timeout_s:.0f} s ({what} from trainer {self.trainer_rank}, step {self.step}): {cause}."
            " A run cannot go on without one of its servers: restart it from its last checkpoint."
        )

    def _all(self, function: Any, *args: Any) -> list[Any]:
        futures = [self._call(server, function, *args) for server in range(self.num_servers)]
        return [self._wait(server, function, future) for server, future in enumerate(futures)]

    # set-up and whole tables ------------------------------------------------------------------------

    def create_table(self, spec: TableSpec, weight: Tensor | None) -> None:
        """Give every server its shard of a table: of ``weight``, or (None) initialised there."""
        sharding = RowSharding(spec.num_rows, self.num_servers)
        shards = None if weight is None else sharding.split(weight.detach().cpu())
        futures = [
            self._call(server, remote.remote_create_table, spec, None if shards is None else shards[server])
            for server in range(self.num_servers)
        ]
        for server, future in enumerate(futures):
            self._wait(server, remote.remote_create_table, future)

    def table(self, name: str, num_rows: int) -> Tensor:
        """The whole current table ``name``, gathered from its servers (on the CPU)."""
        return RowSharding(num_rows, self.num_servers).join(self._all(remote.remote_rows, name))

    def save(self, directory: Path) -> list[str]:
        """Every server writes its shards under ``directory``; the file names, in server order."""
        names = [f"server-{server}-of-{self.num_servers}.pt" for server in range(self.num_servers)]
        futures = [self._call(server, remote.remote_save, str(directory / name)) for server, name in enumerate(names)]
        for server, future in enumerate(futures):
            self._wait(server, remote.remote_save, future)
        return names

    def load(self, paths: Sequence[Path]) -> None:
        """Every server restores its shards from the files of a checkpoint's servers (any number)."""
        self._all(remote.remote_load, [str(path) for path in paths])
        self.step = 0

    # the step protocol -------------------------------------------------------------------------------

    def prefetch(
        self, lookups: dict[str, tuple[RowSharding, int, torch.dtype, Tensor]], training: bool, ahead: int = 0
    ) -> None:
        """Look up several tables' ids at once: one request per server instead of one per table and server.

        ``lookups`` maps a table to its sharding, row length, dtype and the ids the model will pass it. The
        rows are kept until the table's own lookup (:meth:`fetch`) asks for the same ids, which then
        sends nothing; a lookup with other ids is sent as usual, so a wrong prefetch costs time only.
        The requests go out at once and the answer is awaited only by that lookup, so a prefetch for a
        step ``ahead`` steps after the current one (a batch read ahead) overlaps the steps before it.
        """
        step = self.step + ahead if training else None
        self.prefetches_ahead += bool(ahead and training)
        by_layout: dict[_Layout, list[str]] = {}  # tables assembled into one tensor share its length and dtype
        for table, (_, dim, dtype, _) in lookups.items():
            by_layout.setdefault((dim, dtype), []).append(table)
        groups = {
            layout: route_tables(
                {table: lookups[table][3].detach().cpu() for table in tables},
                {table: lookups[table][0] for table in tables},
            )
            for layout, tables in by_layout.items()
        }
        futures = {}
        for server in range(self.num_servers):
            request = {table: rows for group in groups.values() for table, rows in group.shard_rows[server].items()}
            if request:
                futures[server] = self._call(server, remote.remote_lookup_many, step, request)
                self.lookup_requests += 1

        def assemble(_: torch.futures.Future) -> dict[str, Tensor]:
            # run as the answers arrive; a failed one is raised, naming its server, by _take_prefetched
            answers = [_checked(futures[s].value()) if s in futures else {} for s in range(self.num_servers)]
            rows = {}
            for (dim, dtype), group in groups.items():
                rows.update(zip(group.tables, group.assemble(answers, dim, dtype)))
            return rows

        rows = torch.futures.collect_all(list(futures.values())).then(assemble)
        ids = {table: ids for table, (_, _, _, ids) in lookups.items()}
        group_of = {
            table: (layout, index) for layout, tables in by_layout.items() for index, table in enumerate(tables)
        }
        self._prefetched[step] = _Prefetch(ids, groups, group_of, futures, rows, {})

    def has_prefetch(self, training: bool) -> bool:
        """Whether rows were prefetched for the current step (or, ``training=False``, for evaluation)."""
        return (self.step if training else None) in self._prefetched

    def _take_prefetched(self, table: str, ids: Tensor, training: bool) -> tuple[Tensor, Route] | None:
        step = self.step if training else None
        entry = self._prefetched.get(step)
        if entry is None or table not in entry.ids:
            return None
        expected = entry.ids.pop(table)
        if not entry.ids:
            del self._prefetched[step]
        if expected.device != ids.device:
            expected = expected.to(ids.device, non_blocking=True)
        if expected.shape != ids.shape or not torch.equal(expected, ids):
            self.prefetch_misses += 1
            return None
        if entry.arrived is None:  # the first table of the step waits, once, for every server
            started = self._now()
            for server, answer in entry.answers.items():
                self._wait(server, remote.remote_lookup_many, answer)  # a server's failure, named
            entry.arrived = entry.rows.wait()
            self._tell_waited(started)
        rows = entry.arrived[table].to(ids.device)
        if training and torch.is_grad_enabled():
            rows.requires_grad_(True)
            if not entry.leaves:
                self._trained.append(entry)
            entry.leaves[table] = rows
        layout, index = entry.group_of[table]
        return rows, entry.groups[layout].table(index)

    def fetch(
        self, table: str, sharding: RowSharding, dim: int, dtype: torch.dtype, ids: Tensor, training: bool
    ) -> tuple[Tensor, Route]:
        """The distinct rows of ``ids`` (on ``ids``' device, in the table's ``dtype``) and the route that maps
        ids to them.

        In training the rows are those step :attr:`step` must see, and, where autograd is on, a
        leaf whose gradient :meth:`push` sends; otherwise the servers' current rows. Rows
        :meth:`prefetch` brought for these ids are used without a request.
        """
        prefetched = self._take_prefetched(table, ids, training)
        if prefetched is not None:
            return prefetched
        step = self.step if training else None
        plan = route(ids.detach().cpu(), sharding, table)
        futures = {
            server: self._call(server, remote.remote_lookup, table, step, rows)
            for server, rows in enumerate(plan.shard_rows)
            if len(rows)
        }
        self.lookup_requests += len(futures)
        started = self._now()
        values = [
            self._wait(server, remote.remote_lookup, futures[server])
            if server in futures
            else torch.empty((0, dim), dtype=dtype)  # a server with none of the rows: the table's dtype all the same
            for server in range(self.num_servers)
        ]
        self._tell_waited(started)
        rows = plan.assemble(values).to(ids.device)
        if training and torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._recorded.append(_Lookup(table, plan, rows))
        return rows, plan

    def rows_finite(self) -> Tensor:
        """Whether every row gradient of this step so far is finite (none yet counts as finite): a 0-d bool
        tensor on the rows' device, computed without waiting for it (one wait per step, by whoever reads it)."""
        leaves = [lookup.rows for lookup in self._recorded]
        leaves += [leaf for entry in self._trained for leaf in entry.leaves.values()]
        grads = [leaf.grad for leaf in leaves if leaf.grad is not None]
        if not grads:
            return torch.tensor(True)
        found = torch.zeros((), device=grads[0].device)
        # the GradScaler's own check, one pass over all the tensors, not an isfinite per table (docs/internals.md)
        _compat.non_finite_check(grads, found)
        return found == 0

    def _now(self) -> Mark:
        return self.waited.now() if self.waited is not None else None

    def _tell_waited(self, started: Mark) -> None:
        if self.waited is not None:
            self.waited.collective(started, self.waited.now())

    def push(self, weight: float, drop: bool = False) -> None:
        """Send this step's row gradients to the servers (without waiting), to be multiplied by ``weight``
        there (``1 / trainers`` for the mean DDP takes of the dense gradients). Every step is pushed,
        one without rows too (a trainer that sat it out, or ``drop``: a step the optimizer skipped, whose
        rows are dropped): the servers apply an update once every trainer pushed it."""
        self._check_pushes()
        if drop:
            self._recorded.clear()
            self._trained.clear()
        for step in [s for s in self._prefetched if s is None or s <= self.step]:
            del self._prefetched[step]  # rows prefetched for this step (or evaluation) and never looked up
        per_server: list[dict[str, tuple[list[Tensor], list[Tensor]]]] = [{} for _ in range(self.num_servers)]

        def add(server: int, table: str, rows: Tensor, grads: Tensor) -> None:
            table_rows, table_grads = per_server[server].setdefault(table, ([], []))
            table_rows.append(rows)
            table_grads.append(grads)

        for lookup in self._recorded:
            for server, grads in enumerate(lookup.route.split(_grad(lookup.rows))):
                add(server, lookup.table, lookup.route.shard_rows[server], grads)
        for entry in self._trained:
            for (dim, dtype), group in entry.groups.items():
                taken = {table for table in group.tables if table in entry.leaves}
                if not taken:
                    continue
                grads = torch.cat(
                    [
                        _grad(entry.leaves[table]) if table in taken else torch.zeros((size, dim), dtype=dtype)
                        for table, size in zip(group.tables, group.sizes)
                    ]
                )
                for server, tables in enumerate(group.split(grads, taken)):
                    for table, (rows, values) in tables.items():
                        add(server, table, rows, values)
        self._recorded.clear()
        self._trained.clear()
        for server, tables in enumerate(per_server):
            payload = {name: (torch.cat(rows), torch.cat(values)) for name, (rows, values) in tables.items()}
            future = self._call(server, remote.remote_push, self.trainer_rank, self.step, payload, weight)
            self._pushes.append((server, future))
        self.step += 1

    def _check_pushes(self, wait: bool = False) -> None:
        pending = []
        for server, future in self._pushes:
            if wait or future.done():
                self._wait(server, remote.remote_push, future)
            else:
                pending.append((server, future))
        self._pushes = pending

    def flush(self) -> None:
        """Return once every server has applied every update up to the last step pushed by any trainer."""
        self._recorded.clear()  # rows looked up but never trained (a step that was skipped)
        self._trained.clear()
        self._prefetched.clear()
        self._check_pushes(wait=True)
        self._all(remote.remote_flush, self.step - 1)

    def finish(self) -> None:
        """Tell every server this trainer is done with it."""
        self._all(remote.remote_finish, self.trainer_rank)


_RAISED = re.compile(r"^(?:[A-Za-z_][\w]*\.)*(\w*(?:Error|Exception|Failed|Interrupt)): (.*)$")


def _cause(error: BaseException) -> str:
    """What went wrong, in one line: an error raised on a server reaches the trainer as its type, "On WorkerInfo(...):"
    and the server's traceback, whose last ``Type: message`` line is the error itself."""
    raised = [m for line in str(error).splitlines() if (m := _RAISED.match(line.strip()))]
    if raised:
        kind, message = raised[-1].groups()
        return f"{kind}: {message}"
    first = str(error).splitlines()
    return first[0] if first else type(error).__name__


def _checked(value: Any) -> Any:
    """A server's answer, its error raised: an answer that waited on the server (``async_execution``) and ended in an
    error reaches the trainer as the exception object, not raised (torch RPC delivers it so)."""
    if isinstance(value, BaseException):
        raise RuntimeError(f"{type(value).__name__}: {value}") from value
    return value


def _grad(rows: Tensor) -> Tensor:
    """The gradient of looked-up rows, on the CPU (zeros where the loss did not reach them)."""
    return (rows.grad if rows.grad is not None else torch.zeros_like(rows)).detach().cpu()


class RemoteTable(nn.Module):
    """What :class:`RemoteEmbedding` and :class:`RemoteEmbeddingBag` share: a table's name, shape, dtype, sharding."""

    def __init__(self, client: EmbeddingClient, table: str, module: nn.Embedding | nn.EmbeddingBag) -> None:
        super().__init__()
        if module.max_norm is not None:
            raise ValueError(
                f"embedding {table!r} has max_norm={module.max_norm}, which renormalises rows in place"
                " during the forward pass; a remote table cannot do that: leave it out of `offload`"
            )
        self.client = client
        self.table = table
        self.num_embeddings = module.num_embeddings
        self.embedding_dim = module.embedding_dim
        self.dtype = module.weight.dtype  # the rows' on the servers and here, whatever the default dtype
        self.padding_idx = module.padding_idx
        self.scale_grad_by_freq = module.scale_grad_by_freq
        self.sharding = RowSharding(module.num_embeddings, client.num_servers)

    def _rows(self, ids: Tensor) -> tuple[Tensor, Tensor, int | None]:
        rows, plan = self.client.fetch(self.table, self.sharding, self.embedding_dim, self.dtype, ids, self.training)
        inverse = plan.inverse.to(ids.device).reshape(ids.shape)
        padding = None
        if self.padding_idx is not None:
            where = torch.nonzero(plan.unique == self.padding_idx)
            padding = int(where[0, 0]) if len(where) else None
        return rows, inverse, padding

    def extra_repr(self) -> str:
        return (
            f"{self.table!r}, {self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype},"
            f" servers={self.client.num_servers}"
        )


class RemoteEmbedding(RemoteTable):
    """An ``nn.Embedding`` whose rows live on the embedding servers."""

    def forward(self, input: Tensor) -> Tensor:
        rows, inverse, padding = self._rows(input)
        return F.embedding(inverse, rows, padding_idx=padding, scale_grad_by_freq=self.scale_grad_by_freq)


class RemoteEmbeddingBag(RemoteTable):
    """An ``nn.EmbeddingBag`` whose rows live on the embedding servers."""

    def __init__(self, client: EmbeddingClient, table: str, module: nn.EmbeddingBag) -> None:
        super().__init__(client, table, module)
        self.mode = module.mode
        self.include_last_offset = module.include_last_offset

    def forward(self, input: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None) -> Tensor:
        rows, inverse, padding = self._rows(input)
        return F.embedding_bag(
            inverse,
            rows,
            offsets,
            scale_grad_by_freq=self.scale_grad_by_freq,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
            padding_idx=padding,
        )


def remote_module(client: EmbeddingClient, table: str, module: nn.Module) -> RemoteTable:
    """The remote stand-in for embedding module ``module`` (named ``table``)."""
    if isinstance(module, nn.EmbeddingBag):
        return RemoteEmbeddingBag(client, table, module)
    if isinstance(module, nn.Embedding):
        return RemoteEmbedding(client, table, module)
    raise TypeError(f"{table!r} is a {type(module).__name__}, not an nn.Embedding or nn.EmbeddingBag")
