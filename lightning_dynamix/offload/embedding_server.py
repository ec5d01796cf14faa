"""An embedding server: its shards of the offloaded tables, and the step protocol with the trainers.

Every trainer rank, at training step ``k``, looks up the rows its batch needs, computes, and then
pushes the gradients of those rows (one push per server per step, covering every table it looked
up), even a step with no rows (a trainer that sat the step out), with the weight of its gradients. A
server applies update ``k`` once every trainer has pushed step ``k``: each trainer's gradients are
multiplied by its weight and summed, duplicate rows too, and the sparse optimiser applied once per
table. The weights are those of the dense gradients' all-reduce: ``1 / trainers`` (DDP's mean), or,
with per-rank batch sizes, the correction of a synchronisation window whose sizes changed (the
trainer's share of the global batch is already in its gradients).

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/offload/embedding_server.py``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import psutil
import torch
import torch.distributed.rpc
from torch.distributed.rendezvous import register_rendezvous_handler
from torch.futures import Future

from lightning_dynamix._checks import require_int
from lightning_dynamix.offload.sharding import RowSharding, dtype_name
from lightning_dynamix.offload.sparse_optim import SparseRowOptimizer
from lightning_dynamix.offload.table_shard import TableShard, reshard_states

# what one trainer pushes to one server for one step: per table, the local rows and their gradients
Push = dict[str, tuple[torch.Tensor, torch.Tensor]]

PUSH_REORDER_WINDOW = 64
"""How many steps ahead of its last push in order a trainer's push may arrive (and wait for the ones before)."""


class EmbeddingServerFailed(RuntimeError):
    """The server refused a request of the step protocol earlier; it answers every later one with that error."""


@dataclass(frozen=True)
class TableSpec:
    """What a server needs to create its shard of a table.

    Attributes:
        name: the embedding module's name in the LightningModule.
        num_rows: rows of the whole table.
        dim: values per row.
        optimizer: the sparse optimiser of the table.
        init_seed: when the trainers send no initial rows (a table built on the meta device), the
            seed of the server's own ``N(0, 1)`` initialisation; ``padding_idx`` is then zeroed.
        padding_idx: the row kept at zero by such an initialisation, or None.
        dtype: the dtype of the table's rows (a floating-point one), which its shards, their optimiser
            state, the rows a lookup answers and the gradients pushed for it all have; the strategy gives
            each table its embedding module's. A server never takes it from its own default dtype.
    """

    name: str
    num_rows: int
    dim: int
    optimizer: SparseRowOptimizer
    init_seed: int = 0
    padding_idx: int | None = None
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(
                f"table {self.name!r}: `dtype` must be a floating-point torch.dtype (torch.float32, torch.float64,"
                f" torch.bfloat16, torch.float16, ...), got {self.dtype!r}"
            )


class EmbeddingServer:
    """One server's shards, applying each step's update once every trainer has pushed it.

    Args:
        server_rank: which server this is (``0 .. num_servers - 1``).
        num_servers: servers the tables are sharded over.
        num_trainers: trainer ranks that push every step.
        staleness: updates a lookup may miss (0: synchronous).
    """

    def __init__(self, server_rank: int, num_servers: int, num_trainers: int, staleness: int = 0) -> None:
        self.num_servers = require_int("num_servers", num_servers, 1)
        if not 0 <= require_int("server_rank", server_rank, 0) < num_servers:
            raise ValueError(f"`server_rank` must be in [0, {num_servers}), got {server_rank}")
        self.server_rank = server_rank
        self.num_trainers = require_int("num_trainers", num_trainers, 1)
        self.staleness = require_int("staleness", staleness, 0)
        self.tables: dict[str, TableShard] = {}
        self.failure: str | None = None
        """The error that failed the server's step protocol (see the module's docstring); ``None`` while it serves."""
        self._lock = threading.Lock()
        self.last_request = time.monotonic()  # for a server process to notice trainers that died
        self._reset_steps()

    def _reset_steps(self) -> None:
        self.applied = -1  # the last update applied
        self._pushes: dict[int, dict[int, tuple[Push, float]]] = {}  # step -> trainer -> (push, its weight)
        self._pushed = [-1] * self.num_trainers  # the last step each trainer pushed
        # update -> table -> (its rows, ascending; their values before it), while a lookup may need them
        self._overwritten: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        # lookups waiting for an update: (step, answer, {table: rows}, the table of a one-table lookup)
        self._lookups: list[tuple[int, Future, dict[str, torch.Tensor], str | None]] = []
        self._flushes: list[tuple[int, Future]] = []

    # set-up -------------------------------------------------------------------------------------

    def create_table(self, spec: TableSpec, weight: torch.Tensor | None) -> None:
        """Create this server's shard of a table from its initial rows, or initialise them here.

        Raises:
            ValueError: for initial rows of another dtype than ``spec.dtype``.
        """
        sharding = RowSharding(spec.num_rows, self.num_servers)
        if weight is None:
            generator = torch.Generator().manual_seed(spec.init_seed * 1_000_003 + self.server_rank)
            rows = sharding.shard_rows(self.server_rank)
            weight = torch.randn(rows, spec.dim, generator=generator, dtype=spec.dtype)
            if spec.padding_idx is not None and spec.padding_idx % self.num_servers == self.server_rank:
                weight[spec.padding_idx // self.num_servers] = 0
        elif weight.dtype != spec.dtype:
            raise ValueError(
                f"table {spec.name!r} is {dtype_name(spec.dtype)} (its spec's `dtype`), and the initial rows"
                f" given for it are {dtype_name(weight.dtype)}"
            )
        with self._lock:
            self.last_request = time.monotonic()
            self.tables[spec.name] = TableShard(spec.name, sharding, self.server_rank, weight, spec.optimizer)

    # the step protocol ---------------------------------------------------------------------------

    def lookup(self, table: str, step: int | None, rows: torch.Tensor) -> Future:
        """The values of local ``rows`` of ``table`` as step ``step`` must see them.

        ``step=None`` (evaluation) answers from the current rows at once.
        """
        return self._lookup({table: rows}, step, table)

    def lookup_many(self, step: int | None, requests: dict[str, torch.Tensor]) -> Future:
        """:meth:`lookup` of several tables' local rows at once: one answer, ``{table: values}``."""
        return self._lookup(requests, step, None)

    def _lookup(self, requests: dict[str, torch.Tensor], step: int | None, single: str | None) -> Future:
        # one future and one hold of the lock for all the tables of a request
        future: Future = Future()
        with self._lock, self._failing_on_error():
            for table in requests:
                self._table(table)
            if step is None or self._lookup_ready(step):
                future.set_result(self._answer(requests, step, single))
            else:
                self._lookups.append((step, future, requests, single))
        return future

    @contextlib.contextmanager
    def _failing_on_error(self) -> Iterator[None]:
        """Run a request of the step protocol (holding the lock): refused if the server failed, and an error in it
        fails the server, every waiting answer with it."""
        if self.failure is not None:
            raise EmbeddingServerFailed(self.failure)
        try:
            yield
        except Exception as error:
            self.failure = (
                f"embedding server {self.server_rank} stopped serving the step protocol after"
                f" {type(error).__name__}: {error}"
            )
            failed = EmbeddingServerFailed(self.failure)
            for _, future, _, _ in self._lookups:
                future.set_exception(failed)
            for _, future in self._flushes:
                future.set_exception(failed)
            self._lookups, self._flushes = [], []
            raise

    def _answer(self, requests: dict[str, torch.Tensor], step: int | None, single: str | None) -> object:
        if single is not None:
            return self._values(single, step, requests[single])
        return {table: self._values(table, step, rows) for table, rows in requests.items()}

    def _values(self, table: str, step: int | None, rows: torch.Tensor) -> torch.Tensor:
        """Local ``rows`` of ``table`` as lookup ``step`` sees them: the current ones, updates after its
        version rolled back (newest first, so the oldest's values are the ones left)."""
        values = self.tables[table].lookup(rows)
        if step is None:
            return values
        for update in range(self.applied, max(step - 1 - self.staleness, -1), -1):
            changed, before = self._overwritten.get(update, {}).get(table, (None, None))  # an update may miss it
            if changed is None or not len(changed) or not len(rows):
                continue
            where = torch.searchsorted(changed, rows).clamp_(max=len(changed) - 1)
            hit = changed[where] == rows
            values[hit] = before[where[hit]]
        return values

    def push(self, trainer: int, step: int, grads: Push, weight: float) -> None:
        """Trainer ``trainer``'s gradients of step ``step`` (it pushes every step once, with or without rows, in any
        arrival order within :data:`PUSH_REORDER_WINDOW`), multiplied by ``weight`` in the update.

        Raises:
            ValueError: for a trainer this server does not serve, or gradients of another dtype than their table's.
            KeyError: for a table it does not hold.
            RuntimeError: for a step pushed twice, or too far ahead of the trainer's pushes in order.
            EmbeddingServerFailed: once any request failed the server.
        """
        with self._lock, self._failing_on_error():
            if not 0 <= trainer < self.num_trainers:
                raise ValueError(f"push from trainer {trainer}; this server serves {self.num_trainers} trainers")
            last = self._pushed[trainer]
            if step <= last or trainer in self._pushes.get(step, {}):
                raise RuntimeError(f"trainer {trainer} pushed step {step} twice; it pushes every step once")
            if step > last + PUSH_REORDER_WINDOW:
                raise RuntimeError(
                    f"trainer {trainer} pushed step {step}, more than {PUSH_REORDER_WINDOW} steps after its last push"
                    f" in order (step {last}): a push between them was lost"
                )
            for name, (_, values) in grads.items():
                dtype = self._table(name).weight.dtype
                if values.dtype != dtype:  # refused here: at the update, it would fail the last trainer's push
                    raise ValueError(
                        f"trainer {trainer} pushed {dtype_name(values.dtype)} gradients of table {name!r} (step"
                        f" {step}), which is {dtype_name(dtype)}: a table's gradients have its dtype"
                    )
            self._pushes.setdefault(step, {})[trainer] = (grads, weight)
            while trainer in self._pushes.get(self._pushed[trainer] + 1, {}):  # the pushes that waited for this one
                self._pushed[trainer] += 1
            self._advance()

    def flush(self, step: int) -> Future:
        """Completes once every trainer has pushed ``step`` and every update up to it is applied.

        Trainers flush before evaluating, checkpointing and stopping, so that evaluation and
        checkpoints see every update, whatever the staleness.
        """
        future: Future = Future()
        with self._lock, self._failing_on_error():
            self.last_request = time.monotonic()
            self._flushes.append((step, future))
            self._advance()
        return future

    def _lookup_ready(self, step: int) -> bool:
        return self.applied >= step - 1 - self.staleness

    def _advance(self) -> None:
        while min(self._pushed) > self.applied:
            self._apply(self.applied + 1)
        # a trainer that pushed step p looks up steps after p only, which see update p - staleness and later
        for update in [u for u in self._overwritten if u <= min(self._pushed) - self.staleness]:
            del self._overwritten[update]
        waiting = []
        for lookup in self._lookups:
            step, future, requests, single = lookup
            if self._lookup_ready(step):
                future.set_result(self._answer(requests, step, single))
            else:
                waiting.append(lookup)
        self._lookups = waiting
        flushes = []
        for step, future in self._flushes:
            if self.applied >= step:
                future.set_result(self.applied)
            else:
                flushes.append((step, future))
        self._flushes = flushes

    def _apply(self, step: int) -> None:
        pushes = self._pushes.pop(step)
        ordered = [pushes[trainer] for trainer in range(self.num_trainers)]  # a fixed order: reproducible sums
        weights = {weight for _, weight in ordered}
        common = weights.pop() if len(weights) == 1 else None  # then one multiplication of the sum
        for name in sorted({name for push, _ in ordered for name in push}):
            shard = self.tables[name]
            taken = [(push[name], weight) for push, weight in ordered if name in push]
            if len(taken) == 1 and _ascending(taken[0][0][0]):  # one trainer's distinct rows: nothing to sum
                (unique, summed), scale = taken[0]
            else:
                rows = torch.cat([rows for (rows, _), _ in taken])
                grads = torch.cat([grads if common is not None else grads * weight for (_, grads), weight in taken])
                unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
                summed = grads.new_zeros((len(unique), grads.shape[1])).index_add_(0, inverse, grads)
                scale = 1.0 if common is None else common  # unequal weights are in the gradients already
            if scale != 1.0:
                summed = summed * scale
            if self.staleness:  # a lookup may still ask for the table before this update
                self._overwritten.setdefault(step, {})[name] = (unique, shard.lookup(unique))
            shard.update(unique, summed)
        self.applied = step

    def _table(self, name: str) -> TableShard:
        self.last_request = time.monotonic()
        if name not in self.tables:
            raise KeyError(f"server {self.server_rank} holds no table {name!r}; it holds {sorted(self.tables)}")
        return self.tables[name]

    # whole tables ---------------------------------------------------------------------------------

    def rows(self, table: str) -> torch.Tensor:
        """This server's current rows of ``table``."""
        with self._lock:
            return self._table(table).weight.clone()

    def save(self, path: str) -> None:
        """Write every shard (rows and optimiser state) to ``path``."""
        with self._lock:
            states = {name: shard.state_dict() for name, shard in self.tables.items()}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(states, tmp)
        os.replace(tmp, path)  # a reader never sees half a file

    def load(self, paths: Sequence[str]) -> None:
        """Restore every table from the files of a checkpoint's servers (any number of them).

        The saved shards are re-sharded over this job's servers; the step protocol restarts.
        """
        saved = [torch.load(path, map_location="cpu", weights_only=True, mmap=True) for path in paths]
        with self._lock:
            for name, shard in self.tables.items():
                states = [file[name] for file in saved if name in file]
                if not states:
                    raise KeyError(f"the checkpoint's embedding files {list(paths)} hold no table {name!r}")
                mine = reshard_states(states, self.num_servers, shard.optimizer.row_state_keys())[self.server_rank]
                shard.load_state_dict(mine)
            self._reset_steps()


DEFAULT_TIMEOUT_S = timedelta(minutes=30).total_seconds()  # Lightning's default process-group timeout


def _ascending(rows: torch.Tensor) -> bool:
    """Whether ``rows`` are strictly ascending (so distinct): a trainer pushes its rows so."""
    return len(rows) < 2 or bool((rows[1:] > rows[:-1]).all())


def server_name(server_rank: int) -> str:
    """The RPC name of embedding server ``server_rank``."""
    return f"embedding-server-{server_rank}"


def trainer_name(trainer_rank: int) -> str:
    """The RPC name of trainer rank ``trainer_rank``."""
    return f"trainer-{trainer_rank}"


_RENDEZVOUS_SCHEME = "dynamix-tcp"


def _rendezvous(url: str, **kwargs: object) -> Iterator[tuple[torch.distributed.Store, int, int]]:
    """torch's ``tcp://`` rendezvous, bounded by the job's timeout (``timeout=SECONDS`` in the query).

    ``rpc.init_rpc`` meets the other members with no timeout of its own: torch's handler waits 30
    minutes for a member that never comes (servers at another port, or never started).
    """
    parsed = urllib.parse.urlparse(url)
    query = dict(urllib.parse.parse_qsl(parsed.query))
    rank, world_size = int(query["rank"]), int(query["world_size"])
    timeout = timedelta(seconds=float(query["timeout"]))
    assert parsed.hostname is not None  # parse_address checked the address
    assert parsed.port is not None
    yield (
        torch.distributed.TCPStore(parsed.hostname, parsed.port, world_size, rank == 0, timeout, multi_tenant=True),
        rank,
        world_size,
    )
    raise RuntimeError(f"a {_RENDEZVOUS_SCHEME}:// rendezvous meets once")  # as torch's tcp:// does


register_rendezvous_handler(_RENDEZVOUS_SCHEME, _rendezvous)


def rpc_options(address: str, timeout_s: float) -> torch.distributed.rpc.TensorPipeRpcBackendOptions:
    """The RPC options every member of a job uses: one rendezvous address, one timeout (seconds), which
    also bounds the wait for the other members to join."""
    # TCP transport and the basic channel only: TensorPipe's shared-memory transport busy-polls, and
    # on a machine with few cores that polling starves the training (docs/internals.md)
    return torch.distributed.rpc.TensorPipeRpcBackendOptions(
        init_method=f"{_RENDEZVOUS_SCHEME}://{address}?timeout={timeout_s}",
        rpc_timeout=timeout_s,
        num_worker_threads=32,
        devices=[],
        _transports=["uv"],
        _channels=["basic"],
    )


def interface_toward(address: str) -> str | None:
    """The network interface this machine reaches ``address`` (``HOST:PORT``) through; ``None`` where none is found."""
    host, _, port = address.rpartition(":")
    try:
        family, kind, _, _, target = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as probe:
            probe.connect(target)  # a datagram socket: nothing is sent, the kernel only picks the route
            local = probe.getsockname()[0]
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == local for a in addresses):
            return name
    return None


@contextlib.contextmanager
def listening_toward(address: str) -> Iterator[str | None]:
    """Inside it, an RPC agent made by this process (``rpc.init_rpc``) listens on the interface it reaches
    ``address`` (the job's rendezvous) through, not on the one its host name resolves to: TensorPipe's
    ``TP_SOCKET_IFNAME``, set for the agent's construction only (processes started later do not inherit it). A
    ``TP_SOCKET_IFNAME`` of the user's wins. Yields the interface (``None``: TensorPipe's default)."""
    if os.environ.get(_LISTEN_INTERFACE):
        yield os.environ[_LISTEN_INTERFACE]
        return
    interface = interface_toward(address)
    if interface is not None:
        os.environ[_LISTEN_INTERFACE] = interface
    try:
        yield interface
    finally:
        os.environ.pop(_LISTEN_INTERFACE, None)


_LISTEN_INTERFACE = "TP_SOCKET_IFNAME"


def parse_address(value: str) -> str:
    """``host:port`` checked, for argparse and the strategy alike."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"an address must be HOST:PORT, got {value!r}")
    return value


# The instance a server process runs, reached through torch.distributed.rpc by the functions below.
_SERVER: EmbeddingServer | None = None
_DONE = threading.Event()
_FINISHED: set[int] = set()


def install(server: EmbeddingServer) -> threading.Event:
    """Make ``server`` the one this process serves; the event is set when every trainer has finished."""
    global _SERVER
    _SERVER = server
    _FINISHED.clear()
    _DONE.clear()
    return _DONE


def _server() -> EmbeddingServer:
    if _SERVER is None:
        raise RuntimeError("this process is not an embedding server")
    return _SERVER


def remote_create_table(spec: TableSpec, weight: torch.Tensor | None) -> None:
    _server().create_table(spec, weight)


@torch.distributed.rpc.functions.async_execution
def remote_lookup(table: str, step: int | None, rows: torch.Tensor) -> Future:
    return _server().lookup(table, step, rows)


@torch.distributed.rpc.functions.async_execution
def remote_lookup_many(step: int | None, requests: dict[str, torch.Tensor]) -> Future:
    return _server().lookup_many(step, requests)


def remote_push(trainer: int, step: int, grads: Push, weight: float) -> None:
    _server().push(trainer, step, grads, weight)


@torch.distributed.rpc.functions.async_execution
def remote_flush(step: int) -> Future:
    return _server().flush(step)


def remote_rows(table: str) -> torch.Tensor:
    return _server().rows(table)


def remote_save(path: str) -> None:
    _server().save(path)


def remote_load(paths: list[str]) -> None:
    _server().load(paths)


def remote_finish(trainer: int) -> None:
    """Trainer ``trainer`` is done with this server; it stops once every trainer is."""
    _FINISHED.add(trainer)
    if len(_FINISHED) == _server().num_trainers:
        _DONE.set()
