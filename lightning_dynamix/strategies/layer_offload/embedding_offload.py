"""The offload part both layer-offload strategies hold: a LightningModule's tables on embedding servers.

:class:`EmbeddingOffload` takes the strategies' offload arguments, checks them at construction, and does
the offload's share of every hook the strategies delegate to it, from set-up to the end of a fit. It reads
of its strategy only Lightning's public strategy API (:class:`OffloadingStrategy`); what it needs besides
(the strategy's timeout, its weight on the rows' gradients, who to tell of a wait for the servers) the
strategy passes in as arguments. The pieces it puts together live beside it: :mod:`.tables`,
:mod:`.servers`, :mod:`.lookups`, :mod:`.overflow` and :mod:`.checkpoints`.
"""

from __future__ import annotations

import inspect
import subprocess
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer

from lightning_dynamix._checks import require_bool, require_int
from lightning_dynamix.data import HeterogeneousDataLoader
from lightning_dynamix.distributed import let_backend_threads_finish
from lightning_dynamix.metrics.clocks import WaitTimer
from lightning_dynamix.offload import SparseRowOptimizer
from lightning_dynamix.offload.embedding_server import parse_address
from lightning_dynamix.offload.remote import EmbeddingClient, RemoteTable, remote_module
from lightning_dynamix.offload.server_launcher import LaunchedServer
from lightning_dynamix.placement import PlacementPlan
from lightning_dynamix.strategies.layer_offload import checkpoints, lookups, overflow, server_processes, tables

ServerWait = WaitTimer
"""Told of every wait of a lookup for the servers' answer (``collective(started, ended)``, marks of its ``now()``)."""


class OffloadingStrategy(Protocol):
    """What an :class:`EmbeddingOffload` reads of the strategy that holds it: Lightning's public strategy API."""

    @property
    def lightning_module(self) -> LightningModule | None: ...

    @property
    def precision_plugin(self) -> Precision: ...

    @property
    def optimizers(self) -> list[Optimizer]: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def cluster_environment(self) -> ClusterEnvironment | None: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def node_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def barrier(self, name: str | None = None) -> None: ...


class EmbeddingOffload:
    """A LightningModule's embedding tables on CPU embedding servers, for the strategy that holds it.

    :class:`~lightning_dynamix.strategies.LayerOffloadStrategy` and
    :class:`~lightning_dynamix.strategies.HeterogeneousLayerOffloadStrategy` each own one and call it from their
    hooks, in this order: :meth:`take_tables` before DDP's set-up and :meth:`create_tables` after it;
    :meth:`read_ahead` on every DataLoader; :meth:`prefetch_for_step` before every step;
    :meth:`before_optimizer_step` and :meth:`after_optimizer_step` around the optimizer step; :meth:`flush`
    before evaluation; :meth:`save_shards`, :meth:`remove_shards`, :meth:`remember_checkpoint` and
    :meth:`load_shards` with checkpoints; :meth:`note_failure` and :meth:`teardown` at the end.

    Args:
        num_embedding_servers, offload, sparse_optimizer, sparse_optimizer_args, staleness, launch_servers,
            server_port, return_embeddings, prefetch_depth, trainer_threads: the strategies' offload arguments,
            as :class:`~lightning_dynamix.strategies.LayerOffloadStrategy` documents them.

    Raises:
        ValueError: for any argument out of its range, a plan file that does not exist or a plan without
            tables on CPU, ``sparse_optimizer_args`` without ``sparse_optimizer``, or ``launch_servers=False``
            without ``server_port``.
    """

    def __init__(
        self,
        num_embedding_servers: int | None = None,
        offload: str | Sequence[str] | PlacementPlan = "auto",
        sparse_optimizer: str | SparseRowOptimizer | None = None,
        sparse_optimizer_args: Mapping[str, Any] | None = None,
        staleness: int = 0,
        launch_servers: bool = True,
        server_port: int | None = None,
        return_embeddings: bool = True,
        prefetch_depth: int | None = None,
        trainer_threads: int | None = None,
    ) -> None:
        self.plan = tables.offload_plan(offload)
        self.offload = tables.validate_offload(offload if self.plan is None else self.plan.offloaded_layers())
        if num_embedding_servers is None:
            num_embedding_servers = 1 if self.plan is None else self.plan.embedding_servers()
        self.num_embedding_servers = require_int("num_embedding_servers", num_embedding_servers, 1)
        self.sparse_optimizer_args = dict(sparse_optimizer_args or {})
        tables.validate_sparse_optimizer(sparse_optimizer, self.sparse_optimizer_args)
        self.sparse_optimizer = sparse_optimizer
        self.staleness = require_int("staleness", staleness, 0)
        self.launch_servers = require_bool("launch_servers", launch_servers)
        if server_port is not None:
            parse_address(f"localhost:{server_port}")
        elif not launch_servers:
            raise ValueError(
                "`server_port` is required with launch_servers=False: the servers started with"
                " `python -m lightning_dynamix.serve --address <trainer 0's host>:<port>` must be given the same port"
            )
        self.server_port = server_port
        self.return_embeddings = bool(return_embeddings)
        self.prefetch_depth = None if prefetch_depth is None else require_int("prefetch_depth", prefetch_depth, 0)
        self.trainer_threads = None if trainer_threads is None else require_int("trainer_threads", trainer_threads, 1)
        self.servers: list[subprocess.Popen | LaunchedServer] = []
        """The server processes this trainer launched, while they run (``pid``, ``poll()``, ``wait()``,
        ``terminate()``, ``kill()`` as :class:`subprocess.Popen`'s)."""
        self._strategy: OffloadingStrategy | None = None  # the strategy that holds this part, from its set-up on
        self._threads_before: int | None = None
        self._client: EmbeddingClient | None = None
        self._offloaded: dict[str, nn.Module] = {}  # the LightningModule's own embedding modules, set aside
        self._remote: dict[str, RemoteTable] = {}  # their stand-ins, by name
        self._loss_scale: float | None = None  # the GradScaler's scale the step's backward passes used
        self._misses_warned = False
        self._failed = False
        self._checkpoint_path: Path | None = None

    @property
    def client(self) -> EmbeddingClient | None:
        """This trainer's connection to the servers, while they run."""
        return self._client

    # set-up ----------------------------------------------------------------------------------------------

    def take_tables(
        self, strategy: OffloadingStrategy, trainer: Any, timeout_s: float, server_waited: ServerWait | None = None
    ) -> None:
        """Before DDP's set-up: take the tables out of ``strategy``'s LightningModule, start or meet the servers,
        and put remote stand-ins in the tables' place.

        Args:
            strategy: the strategy that holds this part.
            trainer: its Trainer.
            timeout_s: how long any wait for a server may take, in seconds (the strategy's timeout).
            server_waited: told of every wait of a lookup for the servers' answer; None tells nobody.

        Raises:
            MisconfigurationException: for a model or a Trainer this cannot offload or read ahead (before any
                server starts).
            RuntimeError: for servers that do not meet the trainers within ``timeout_s``.
        """
        let_backend_threads_finish()
        module = strategy.lightning_module
        assert module is not None
        targets = tables.select_tables(module, self.offload)
        # the precision plugin gives the model its dtype ("64-true", "bf16-true") in DDP's set-up, without the
        # tables, which are out of it by then: they get that dtype here, as they would in it, and keep it
        targets = {name: strategy.precision_plugin.convert_module(embedding) for name, embedding in targets.items()}
        if trainer.state.fn == TrainerFn.FITTING and self.prefetch_depth:  # refused before any server starts
            lookups.refuse_read_ahead(self.prefetch_depth, lookups.read_ahead_refusals(module, trainer))
        self._strategy = strategy
        self._failed = False
        self._set_threads(strategy)
        self._start_servers(strategy, timeout_s)
        self._client = EmbeddingClient(strategy.global_rank, self.num_embedding_servers, timeout_s)
        self._client.waited = server_waited
        self._remote = {name: remote_module(self._client, name, embedding) for name, embedding in targets.items()}
        for name, stand_in in self._remote.items():
            tables.set_submodule(module, name, stand_in)
        self._offloaded = targets
        self._misses_warned = False

    def create_tables(self, trainer: Any) -> None:
        """After DDP's set-up (the optimizers are configured): create the tables on the servers, and leave the
        trainer's embedding modules without rows while the servers train them."""
        strategy = self._set_up()
        client = self._connected()
        optimizer = tables.sparse_optimizer_for(
            trainer.state.fn, self.sparse_optimizer, self.sparse_optimizer_args, strategy.optimizers
        )
        if strategy.is_global_zero:
            for name, embedding in self._offloaded.items():
                weight = None if embedding.weight.is_meta else embedding.weight
                client.create_table(tables.table_spec(name, embedding, optimizer), weight)
        if trainer.state.fn == TrainerFn.FITTING:
            for embedding in self._offloaded.values():  # the servers own the rows now, and train them
                embedding.weight = nn.Parameter(torch.empty_like(embedding.weight, device="meta"))
        strategy.barrier("embedding tables created")

    def _set_threads(self, strategy: OffloadingStrategy) -> None:
        threads = self.trainer_threads
        if threads is None and self.launch_servers and strategy.node_rank == 0:
            threads = server_processes.threads_beside_servers(self.num_embedding_servers, strategy.num_processes)
        if threads is not None:
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(threads)

    def _start_servers(self, strategy: OffloadingStrategy, timeout_s: float) -> None:
        num_trainers = strategy.world_size
        address = server_processes.meeting_address(strategy, self.server_port)
        if self.launch_servers and strategy.is_global_zero:
            self.servers = [
                server_processes.launch_server(
                    address, s, self.num_embedding_servers, num_trainers, self.staleness, timeout_s
                )
                for s in range(self.num_embedding_servers)
            ]
        server_processes.join_servers(
            strategy.global_rank, num_trainers, self.num_embedding_servers, address, timeout_s, self.launch_servers
        )

    # the step --------------------------------------------------------------------------------------------

    def read_ahead(self, dataloader: object) -> object:
        """``dataloader``, read ahead where the training's lookups are pipelined (see ``prefetch_depth``).

        Raises:
            MisconfigurationException: for a ``prefetch_depth`` set where reading ahead cannot work.
        """
        module = self._strategy.lightning_module if self._strategy is not None else None
        depth = lookups.read_ahead_depth(self.prefetch_depth, dataloader, module)
        if isinstance(dataloader, HeterogeneousDataLoader):
            dataloader.read_ahead = (depth, self.prefetch_batch) if depth else None
            return dataloader
        return lookups.ReadAhead(dataloader, depth, self.prefetch_batch) if depth else dataloader

    def prefetch_for_step(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], training: bool = False) -> None:
        """Before a step (its hook's ``args`` and ``kwargs``): look up every table its batch's
        ``embedding_ids`` names, one request per server, unless a training step's rows were asked for as its
        batch was read ahead."""
        if training and self._client is not None and self._client.has_prefetch(training=True):
            return
        self.prefetch_batch(args[0] if args else kwargs.get("batch"), 0)

    def prefetch_batch(self, batch: Any, ahead: int) -> None:
        """Look up the tables of a batch trained ``ahead`` steps after the current one (read ahead)."""
        if self._client is None or self._strategy is None:
            return
        lookups.prefetch_rows(self._client, self._remote, self._strategy.lightning_module, batch, ahead)

    def before_optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The closure the strategy's optimizer step is to run: ``closure``, and under a GradScaler (fp16 mixed
        precision) its check for inf or NaN extended to the rows' gradients (:mod:`.overflow`)."""
        strategy = self._set_up()
        self._loss_scale = overflow.loss_scale(strategy.precision_plugin)  # this step's backward passes use it
        if self._loss_scale is None:
            return closure
        return overflow.rows_checked(closure, optimizer, self._connected(), strategy.root_device, strategy.world_size)

    def after_optimizer_step(self, row_gradient_weight: float) -> None:
        """After the strategy's optimizer step: send the step's row gradients to the servers, to be multiplied
        there by ``row_gradient_weight`` (and dropped where the GradScaler skipped the step)."""
        strategy = self._set_up()
        client = self._connected()
        lookups.push_rows(client, row_gradient_weight, self._loss_scale, overflow.loss_scale(strategy.precision_plugin))
        if client.prefetch_misses and not self._misses_warned:
            self._misses_warned = True
            warnings.warn(
                f"{type(strategy.lightning_module).__name__}.embedding_ids(batch) gave a table other ids than its"
                f" forward looked up ({client.prefetch_misses} so far): those tables were looked up again,"
                " one request per table and server. Return exactly the ids each table's forward receives.",
                stacklevel=3,  # the caller of the strategy's optimizer_step
            )

    def flush(self) -> None:
        """Wait until the servers applied every update pushed (before evaluation, which sees the tables)."""
        if self._client is not None:
            self._client.flush()

    # checkpoints -----------------------------------------------------------------------------------------

    def save_shards(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        """Before the strategy writes ``checkpoint`` to ``filepath``: on trainer 0, have the servers write their
        shards beside it, and record them in ``checkpoint``."""
        strategy = self._strategy
        if strategy is not None and strategy.is_global_zero and self._client is not None:
            checkpoint[checkpoints.CHECKPOINT_KEY] = checkpoints.save_shards(
                self._client, Path(filepath), self.num_embedding_servers, self._offloaded
            )

    def remove_shards(self, filepath: Any) -> None:
        """After the strategy removed the checkpoint file ``filepath``: on trainer 0, remove its shards."""
        if self._strategy is not None and self._strategy.is_global_zero:
            checkpoints.remove_shards(Path(filepath))

    def remember_checkpoint(self, checkpoint_path: Any) -> None:
        """The strategy loads the checkpoint file ``checkpoint_path``: its shards lie beside it."""
        self._checkpoint_path = Path(checkpoint_path)

    def load_shards(self, checkpoint: Mapping[str, Any]) -> None:
        """After the strategy loaded the model's state from ``checkpoint``: have the servers restore the tables'
        rows from its shards.

        Raises:
            MisconfigurationException: for a checkpoint without the tables offloaded.
        """
        strategy = self._set_up()
        saved = checkpoint.get(checkpoints.CHECKPOINT_KEY)
        checkpoints.check_shards(saved, self._checkpoint_path, self._offloaded)
        assert saved is not None
        if strategy.is_global_zero:
            assert self._checkpoint_path is not None
            checkpoints.load_shards(self._connected(), saved, self._checkpoint_path)
        strategy.barrier("embedding tables restored")

    # the end ---------------------------------------------------------------------------------------------

    def note_failure(self) -> None:
        """The fit failed: at the end, nothing more is asked of the servers than what can still come back."""
        self._failed = True

    def teardown(self) -> None:
        """At the end of a fit: the tables back into the model (``return_embeddings``), the servers told and
        stopped, the trainer's threads as they were."""
        if self._client is not None:
            finished = False
            try:
                finished = self._finish()
            finally:
                self._client = None
                launched, self.servers = self.servers, []
                server_processes.stop_servers(launched, finished, self._failed)
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def _finish(self) -> bool:
        """Flush, bring the tables back, tell the servers this trainer is done; whether every trainer was
        answered, so that the servers have nothing left to do."""
        finished = False
        strategy = self._set_up()
        client = self._connected()
        module = strategy.lightning_module
        try:
            if not self._failed:
                client.flush()
            if self.return_embeddings:
                try:
                    tables.bring_tables_back(client, self._offloaded, strategy.root_device)
                except Exception:
                    if not self._failed:
                        raise  # after a failure, the tables come back where they still can
            if not self._failed:
                client.finish()
                if strategy.world_size > 1:  # then every trainer has its answer
                    strategy.barrier("embedding servers finished")
                finished = True
        finally:
            client.close()
            # modules whose rows did not come back keep their stand-ins, which say where the tables went
            whole = all(not embedding.weight.is_meta for embedding in self._offloaded.values())
            if module is not None and whole:
                for name, embedding in self._offloaded.items():
                    tables.set_submodule(module, name, embedding)
            self._offloaded, self._remote = {}, {}
            server_processes.leave_servers()
        return finished

    def _set_up(self) -> OffloadingStrategy:
        assert self._strategy is not None, "EmbeddingOffload.take_tables was not called"
        return self._strategy

    def _connected(self) -> EmbeddingClient:
        assert self._client is not None, "EmbeddingOffload is not connected to its servers"
        return self._client


OFFLOAD_ARGUMENTS = tuple(inspect.signature(EmbeddingOffload).parameters)
"""The names of :class:`EmbeddingOffload`'s arguments, which both offload strategies take."""


def offload_arguments(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take :class:`EmbeddingOffload`'s arguments out of ``kwargs``, a strategy's keyword arguments, and return them;
    the rest stay."""
    return {name: kwargs.pop(name) for name in OFFLOAD_ARGUMENTS if name in kwargs}


Init = TypeVar("Init", bound=Callable[..., None])


def advertises_offload_arguments(init: Init) -> Init:
    """``init``, a strategy's ``__init__`` whose ``**kwargs`` take :class:`EmbeddingOffload`'s arguments (see
    :func:`offload_arguments`), with a signature that lists them as keyword-only parameters before ``**kwargs``.

    ``inspect.signature``, ``help`` and LightningCLI (jsonargparse) read that signature: ``init_args`` in a YAML
    file take the offload arguments by name and type, as if ``init`` listed them itself, while they are
    written down and checked in one place (:class:`EmbeddingOffload`).
    """
    own = inspect.signature(init, eval_str=True)
    parameters = list(own.parameters.values())
    if not parameters or parameters[-1].kind is not inspect.Parameter.VAR_KEYWORD:
        raise TypeError(f"{init.__qualname__} must end with **kwargs to take EmbeddingOffload's arguments")
    offload = [
        parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for parameter in inspect.signature(EmbeddingOffload, eval_str=True).parameters.values()
    ]
    init.__signature__ = own.replace(parameters=[*parameters[:-1], *offload, parameters[-1]])  # type: ignore[attr-defined]
    return init
