"""Lightning DDP for models that are mostly embedding tables: the tables on CPU embedding servers.

:class:`LayerOffloadStrategy` trains a LightningModule unchanged. At set-up it takes the module's
``nn.Embedding`` / ``nn.EmbeddingBag`` layers out (all of them with ``offload="auto"``, or the ones
named), shards their rows over ``num_embedding_servers`` CPU processes, and puts remote stand-ins
in their place (:mod:`lightning_dynamix.offload.remote`). The dense rest of the model trains with
DDP among the trainer ranks, the devices the Trainer was given; the servers apply a sparse
optimiser to the rows each step touched. With ``staleness=0`` this is exactly the training of the
same model in one process; ``staleness=1`` lets each step's embedding update overlap the next
step (PERSIA's bounded staleness, made exact: step ``k`` sees the tables after update ``k - 2``).

Servers and trainers talk over ``torch.distributed.rpc``. On one machine the strategy starts the
servers itself; on a cluster, start them with ``python -m lightning_dynamix.serve`` and give the
strategy ``launch_servers=False`` and the ``server_port`` they were told.

Checkpoints: every server writes its shards, with their optimiser state, beside the checkpoint
file (``<checkpoint>.embeddings/``); the checkpoint records them, and resuming restores them, into
any number of servers. At the end of ``fit`` the trained tables are copied back into the
LightningModule's own embedding modules (``return_embeddings=True``), so the model is whole again.

Lookups: each table's forward sends one request per server. A LightningModule that defines
``embedding_ids(batch) -> {table name: ids}`` lets the strategy look every table up before the step
in one request per server (:meth:`EmbeddingClient.prefetch`); the tables' forwards then use those
rows. Ids that differ from what a table's forward receives cost a request, never a wrong row.

Pipelined lookups: with ``prefetch_depth=1`` (the default where it applies) the training DataLoader
is read one batch ahead, and the rows of step ``t + 1`` are asked for while step ``t`` runs. The
servers answer them with the version of the tables that step must see (after update ``t`` with
``staleness=0``, so training stays exact; after update ``t - 1`` with ``staleness=1``, which they
have at once), and the rows are assembled as they arrive, beside the trainer's compute.

:class:`HeterogeneousLayerOffloadStrategy` is the same with a batch size per trainer rank, as
:class:`~lightning_dynamix.strategies.HeterogeneousDDPStrategy` gives them: each trainer's row
gradients carry its share of the global batch, as its dense gradients do, and the servers sum them,
so training stays exact; ``DynamixCallback`` balances its trainers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dynamix import _compat
from lightning_dynamix._checks import require_int
from lightning_dynamix.data import EmptyBatch, HeterogeneousDataLoader
from lightning_dynamix.data.loader import iterate_ahead
from lightning_dynamix.distributed import LossReduction, let_backend_threads_finish
from lightning_dynamix.offload import SparseRowOptimizer, make_sparse_optimizer
from lightning_dynamix.offload.remote import EMBEDDING_TYPES, EmbeddingClient, RemoteTable, remote_module
from lightning_dynamix.offload.server import TableSpec, parse_address, rpc_options, trainer_name
from lightning_dynamix.offload.sparse_optim import FrozenRows, sparse_counterpart
from lightning_dynamix.placement import PlacementPlan
from lightning_dynamix.serve import server_command
from lightning_dynamix.strategies.heterogeneous_ddp import HeterogeneousDDPStrategy

STRATEGY_NAME = "layer_offload"
HETEROGENEOUS_STRATEGY_NAME = "heterogeneous_layer_offload"
CHECKPOINT_KEY = "embedding_servers"
_SERVER_EXIT_WAIT_S = 30.0


class LayerOffloadStrategy(DDPStrategy):
    """DDP for the dense layers, with the embedding tables on CPU embedding servers.

    Args:
        num_embedding_servers: CPU processes the tables' rows are sharded over; default 1, or with a
            plan the units of its CPU stages that hold tables.
        offload: ``"auto"`` for every ``nn.Embedding`` / ``nn.EmbeddingBag`` of the LightningModule,
            the names of the ones to offload (as in ``named_modules()``), or a
            :class:`~lightning_dynamix.placement.PlacementPlan` (or the path of one, ``.json`` or
            ``.yaml``): the tables it puts on CPU resource types.
        sparse_optimizer: the servers' optimiser: ``"sgd"``, ``"adagrad"`` or a
            :class:`~lightning_dynamix.offload.SparseRowOptimizer`; None (default) mirrors the
            LightningModule's optimizer (``torch.optim.SGD`` without momentum or weight decay, or
            ``torch.optim.Adagrad``) with its hyperparameters.
        sparse_optimizer_args: arguments of a named ``sparse_optimizer``; ``lr`` defaults to the
            LightningModule's optimizer's.
        staleness: updates an embedding lookup may miss: 0 is synchronous; 1 overlaps each step's
            embedding update with the next step.
        launch_servers: start the servers as local processes (one machine); False when they are
            started with ``python -m lightning_dynamix.serve`` (a cluster).
        server_port: the port on trainer rank 0's machine where trainers and servers meet; required
            with ``launch_servers=False``, a free one by default otherwise.
        return_embeddings: at the end of ``fit``, copy the trained tables back into the
            LightningModule's embedding modules on every trainer; set False for tables too large for a
            trainer (the checkpoint holds them).
        prefetch_depth: training batches read ahead, whose rows are asked for while the steps before
            them run (their lookups then overlap the trainer's compute). Needs the LightningModule's
            ``embedding_ids``, one optimizer step per batch (no ``accumulate_grad_batches``), and a
            DataLoader that keeps no state of what it handed out (a stateful loader or batch sampler would
            count the batch read ahead as trained), or a ``HeterogeneousDataLoader``, which reads ahead
            beneath its count. 0 looks each step up when it starts. None (default): 1 where all hold, else 0.
        trainer_threads: torch's intra-op threads in each trainer process while it trains. None
            (default): on the machine that runs the launched servers, at most its cores less one per
            server, shared by its trainers (at least 1), so the servers have cores of their own (idle
            intra-op threads spin on a core and the servers' answers wait for it); elsewhere as set.
        **kwargs: Lightning's ``DDPStrategy`` arguments (``timeout`` also bounds every wait for a server).
    """

    strategy_name = STRATEGY_NAME

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
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.plan = _plan(offload)
        self.offload = _validate_offload(offload if self.plan is None else self.plan.offloaded_layers())
        if num_embedding_servers is None:
            num_embedding_servers = 1 if self.plan is None else self.plan.embedding_servers()
        self.num_embedding_servers = require_int("num_embedding_servers", num_embedding_servers, 1)
        self.sparse_optimizer_args = dict(sparse_optimizer_args or {})
        if sparse_optimizer is None:
            if self.sparse_optimizer_args:
                raise ValueError(
                    f"`sparse_optimizer_args` {self.sparse_optimizer_args} were given without a `sparse_optimizer`;"
                    " name one (e.g. 'adagrad') or leave both unset to mirror the LightningModule's optimizer"
                )
        elif not isinstance(sparse_optimizer, SparseRowOptimizer):
            # checked now, with a stand-in learning rate; the real one may come from the module's optimizer
            make_sparse_optimizer(sparse_optimizer, **{"lr": 1.0, **self.sparse_optimizer_args})
        else:
            make_sparse_optimizer(sparse_optimizer, **self.sparse_optimizer_args)
        self.sparse_optimizer = sparse_optimizer
        self.staleness = require_int("staleness", staleness, 0)
        if not isinstance(launch_servers, bool):
            raise ValueError(f"`launch_servers` must be True or False, got {launch_servers!r}")
        self.launch_servers = launch_servers
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
        self._threads_before: int | None = None
        self._client: EmbeddingClient | None = None
        self._servers: list[subprocess.Popen] = []
        self._offloaded: dict[str, nn.Module] = {}  # the LightningModule's own embedding modules, set aside
        self._remote: dict[str, RemoteTable] = {}  # their stand-ins, by name
        self._misses_warned = False
        self._failed = False
        self._checkpoint_path: Path | None = None

    @property
    def client(self) -> EmbeddingClient | None:
        """This trainer's connection to the servers, while they run."""
        return self._client

    # set-up ----------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Any) -> None:
        let_backend_threads_finish()
        module = self.lightning_module
        assert module is not None
        targets = self._select(module)
        # the precision plugin gives the model its dtype ("64-true", "bf16-true") in DDP's set-up, without the
        # tables, which are out of it by then: they get that dtype here, as they would in it, and keep it
        targets = {name: self.precision_plugin.convert_module(embedding) for name, embedding in targets.items()}
        if trainer.state.fn == TrainerFn.FITTING and self.prefetch_depth:  # refused before any server starts
            self._refuse_read_ahead(self._read_ahead_refusals(module, trainer))
        self._failed = False
        self._set_threads()
        self._start_rpc()
        self._client = EmbeddingClient(self.global_rank, self.num_embedding_servers, self._timeout.total_seconds())
        self._remote = {name: remote_module(self._client, name, embedding) for name, embedding in targets.items()}
        for name, stand_in in self._remote.items():
            _set_submodule(module, name, stand_in)
        self._offloaded = targets
        self._misses_warned = False
        super().setup(trainer)  # DDP over the dense rest; the optimizers are configured from it
        optimizer = self._sparse_optimizer(trainer.state.fn)
        if self.is_global_zero:
            for name, embedding in targets.items():
                weight = None if embedding.weight.is_meta else embedding.weight
                self._client.create_table(_spec(name, embedding, optimizer), weight)
        if trainer.state.fn == TrainerFn.FITTING:
            for embedding in targets.values():  # the servers own the rows now, and train them
                embedding.weight = nn.Parameter(torch.empty_like(embedding.weight, device="meta"))
        self.barrier("embedding tables created")

    def _set_threads(self) -> None:
        threads = self.trainer_threads
        if threads is None and self.launch_servers and self.node_rank == 0:
            threads = threads_beside_servers(self.num_embedding_servers, self.num_processes)
        if threads is not None:
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(threads)

    def _select(self, module: LightningModule) -> dict[str, nn.Module]:
        modules = dict(module.named_modules())
        embeddings = {name: m for name, m in modules.items() if isinstance(m, EMBEDDING_TYPES)}
        if self.offload == "auto":
            if not embeddings:
                raise MisconfigurationException(
                    f"`offload='auto'` found no nn.Embedding or nn.EmbeddingBag in {type(module).__name__}:"
                    " there is nothing to offload; use another strategy for this model"
                )
            selected = embeddings
        else:
            for name in self.offload:
                if name not in modules:
                    raise MisconfigurationException(
                        f"`offload` names {name!r}, which is not a module of {type(module).__name__};"
                        f" its embedding modules are {sorted(embeddings)}"
                    )
                if name not in embeddings:
                    raise MisconfigurationException(
                        f"`offload` names {name!r}, a {type(modules[name]).__name__}; only nn.Embedding and"
                        f" nn.EmbeddingBag can be offloaded: {sorted(embeddings)}"
                    )
            selected = {name: embeddings[name] for name in self.offload}
        shared = _shared_weights(module, selected)
        if shared:
            raise MisconfigurationException(
                f"the weights of {shared} are also used by other modules (tied weights); offloading them would"
                " split one parameter in two: leave them out of `offload`"
            )
        for name, embedding in selected.items():
            if embedding.max_norm is not None:
                raise MisconfigurationException(
                    f"embedding {name!r} has max_norm={embedding.max_norm}, which renormalises rows in place in the"
                    " forward pass; a remote table cannot: leave it out of `offload`"
                )
        return selected

    def _sparse_optimizer(self, fn: TrainerFn | None) -> SparseRowOptimizer:
        if fn != TrainerFn.FITTING:
            return FrozenRows()
        dense = self.optimizers[0] if self.optimizers else None
        if self.sparse_optimizer is None:
            if dense is None:
                raise MisconfigurationException(
                    "LayerOffloadStrategy mirrors the LightningModule's optimizer for the embedding tables, and"
                    " configure_optimizers returned none: set `sparse_optimizer`"
                )
            try:
                return sparse_counterpart(dense)
            except ValueError as error:
                raise MisconfigurationException(f"{error}; set LayerOffloadStrategy(sparse_optimizer=...)") from None
        if isinstance(self.sparse_optimizer, SparseRowOptimizer):
            return self.sparse_optimizer
        args = dict(self.sparse_optimizer_args)
        if "lr" not in args and dense is not None:
            args["lr"] = dense.param_groups[0]["lr"]
        return make_sparse_optimizer(self.sparse_optimizer, **args)

    def _start_rpc(self) -> None:
        num_trainers = self.world_size
        host = self.cluster_environment.main_address if self.cluster_environment is not None else "127.0.0.1"
        port = self.server_port
        if port is None:
            port = self.broadcast(_free_port() if self.is_global_zero else None, src=0)
        address = parse_address(f"{host}:{port}")
        if self.launch_servers and self.is_global_zero:
            self._servers = [self._launch(address, s, num_trainers) for s in range(self.num_embedding_servers)]
        _forget_earlier_rpc_groups()
        try:
            rpc.init_rpc(
                trainer_name(self.global_rank),
                rank=self.global_rank,
                world_size=num_trainers + self.num_embedding_servers,
                rpc_backend_options=rpc_options(address, self._timeout.total_seconds()),
            )
        except torch.distributed.DistError as error:  # the store timed out, or the address was not there
            if self.launch_servers:
                hint = "a server this strategy started may have failed as it started (its output is above)"
            else:
                hint = (
                    f"start them with `python -m lightning_dynamix.serve --address {address} --server-rank S"
                    f" --num-servers {self.num_embedding_servers} --num-trainers {num_trainers}`, S from 0 to"
                    f" {self.num_embedding_servers - 1}, or pass the `server_port` they were given"
                )
            raise RuntimeError(
                f"{trainer_name(self.global_rank)}: the job's {self.num_embedding_servers} embedding server(s) and"
                f" {num_trainers} trainer(s) did not all meet at {address} within the strategy's timeout of"
                f" {self._timeout.total_seconds():g} s: {hint} ({error})"
            ) from error

    def _launch(self, address: str, server: int, num_trainers: int) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
        env["CUDA_VISIBLE_DEVICES"] = ""  # servers are CPU processes
        env["OMP_NUM_THREADS"] = "1"
        # torch's RPC warns of every connection closed without its graceful shutdown ("encountered error"), on
        # both ends, though nothing failed (docs/troubleshooting.md): a server's C++ side logs errors only
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        command = server_command(
            "--address",
            address,
            "--server-rank",
            str(server),
            "--num-servers",
            str(self.num_embedding_servers),
            "--num-trainers",
            str(num_trainers),
            "--staleness",
            str(self.staleness),
            "--timeout",
            str(self._timeout.total_seconds()),
            "--parent-pid",
            str(os.getpid()),
        )
        return subprocess.Popen(command, env=env)

    # training ------------------------------------------------------------------------------------------

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # a GradScaler (fp16 mixed precision) multiplies the loss, and so the rows' gradients, by its scale, and
        # its unscale_ and its check for inf or NaN reach the optimizer's parameters only
        scaler = getattr(self.precision_plugin, "scaler", None)
        scale = None if scaler is None else scaler.get_scale()  # this step's backward passes used it
        if scaler is not None:
            closure = self._rows_checked(closure, optimizer)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self._client is not None
        weight = self._row_gradient_weight()
        if scale is None:
            self._client.push(weight)
        elif scaler.get_scale() < scale:  # it found inf or NaN and skipped the step (its scale backed off)
            self._client.push(weight, drop=True)  # the tables skip it too
        else:
            self._client.push(weight / scale)
        if self._client.prefetch_misses and not self._misses_warned:
            self._misses_warned = True
            warnings.warn(
                f"{type(self.lightning_module).__name__}.embedding_ids(batch) gave a table other ids than its"
                f" forward looked up ({self._client.prefetch_misses} so far): those tables were looked up again,"
                " one request per table and server. Return exactly the ids each table's forward receives.",
                stacklevel=2,
            )
        return output

    def _row_gradient_weight(self) -> float:
        """What the servers multiply this trainer's row gradients by: ``1 / trainers``, the mean DDP takes of
        the dense gradients."""
        return 1.0 / self.world_size

    def _rows_checked(self, closure: Callable[[], Any], optimizer: Optimizer) -> Callable[[], Any]:
        """``closure``, then the GradScaler's check extended to the rows' gradients.

        With the tables in the model, an inf or NaN in a table's gradient makes the scaler skip the step
        and back off, on every rank (DDP all-reduced the gradient). The rows' gradients are not the
        optimizer's, so after the backward pass the trainers agree whether any has one, and if so mark
        the step as the scaler sees it: an inf in a dense gradient of a step it then skips. The rows
        are dropped with it (see :meth:`optimizer_step`).
        """

        def checked() -> Any:
            result = closure()
            assert self._client is not None
            finite = self._client.rows_finite().to(self.root_device, torch.float32)
            if self.world_size > 1:
                torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
            if not finite.item():
                _mark_overflow(optimizer)
            return result

        return checked

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        depth = self._read_ahead_depth(dataloader)
        if isinstance(dataloader, HeterogeneousDataLoader):
            dataloader.read_ahead = (depth, self._prefetch_batch) if depth else None
            return dataloader
        return _ReadAhead(dataloader, depth, self) if depth else dataloader

    def _read_ahead_depth(self, dataloader: object) -> int:
        """How many batches of ``dataloader`` to read ahead: ``prefetch_depth``, checked, or what applies."""
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or self.prefetch_depth == 0:
            return 0
        reasons = self._read_ahead_refusals(module, trainer)
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
            return 1 if self.prefetch_depth is None else self.prefetch_depth
        if self.prefetch_depth is not None:
            self._refuse_read_ahead(reasons)
        return 0

    @staticmethod
    def _read_ahead_refusals(module: LightningModule, trainer: Any) -> list[str]:
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

    def _refuse_read_ahead(self, reasons: list[str]) -> None:
        if reasons:
            raise MisconfigurationException(
                f"`prefetch_depth={self.prefetch_depth}` reads training batches ahead, and cannot here: "
                + "; ".join(reasons)
                + ". Set prefetch_depth=0 (or leave it unset) to look each step up when it starts."
            )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._client is None or not self._client.has_prefetch(training=True):
            self._prefetch(args, kwargs)
        return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._prefetch(args, kwargs)
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._prefetch(args, kwargs)
        return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._prefetch(args, kwargs)
        return super().predict_step(*args, **kwargs)

    def _prefetch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Look up every table the module's ``embedding_ids(batch)`` names, one request per server."""
        self._prefetch_batch(args[0] if args else kwargs.get("batch"), 0)

    def _prefetch_batch(self, batch: Any, ahead: int) -> None:
        """Look up the tables of a batch trained ``ahead`` steps after the current one (read ahead)."""
        module = self.lightning_module
        hook = getattr(module, "embedding_ids", None)
        training = bool(self._remote) and next(iter(self._remote.values())).training
        if hook is None or self._client is None or (ahead and not training) or isinstance(batch, EmptyBatch):
            return  # a rank that sits a step out looks nothing up
        ids = hook(batch)
        if not isinstance(ids, Mapping):
            raise TypeError(
                f"{type(module).__name__}.embedding_ids(batch) must return a mapping of offloaded table names"
                f" to id tensors, got {type(ids).__name__}"
            )
        lookups = {}
        for name, value in ids.items():
            table = self._remote.get(name)
            if table is None:
                if isinstance(_submodule(module, name), EMBEDDING_TYPES):
                    continue  # a table `offload` left in the trainer: its lookup is local
                raise ValueError(
                    f"{type(module).__name__}.embedding_ids(batch) names {name!r}, which is not an embedding"
                    f" module of the model; the offloaded tables are {sorted(self._remote)}"
                )
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{type(module).__name__}.embedding_ids(batch)[{name!r}] must be a tensor of ids,"
                    f" got {type(value).__name__}"
                )
            lookups[name] = (table.sharding, table.embedding_dim, table.dtype, value)
        if lookups:
            self._client.prefetch(lookups, training=training, ahead=ahead)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._flush()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._flush()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._flush()

    def _flush(self) -> None:
        if self._client is not None:
            self._client.flush()

    # checkpoints -----------------------------------------------------------------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.is_global_zero and self._client is not None:
            directory = _shard_directory(Path(filepath))
            if directory.exists():
                shutil.rmtree(directory)
            self._client.flush()
            files = self._client.save(directory)
            checkpoint[CHECKPOINT_KEY] = {
                "directory": directory.name,
                "files": files,
                "num_servers": self.num_embedding_servers,
                "tables": {
                    name: {"num_rows": m.num_embeddings, "dim": m.embedding_dim} for name, m in self._offloaded.items()
                },
            }
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            shutil.rmtree(_shard_directory(Path(filepath)), ignore_errors=True)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the servers must exist to take their shards back

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self._checkpoint_path = Path(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            raise MisconfigurationException(
                f"the checkpoint {self._checkpoint_path} holds no embedding tables (it was not written by"
                " LayerOffloadStrategy); load it into the model before fitting with this strategy instead"
            )
        missing = sorted(set(self._offloaded) - set(saved["tables"]))
        if missing:
            raise MisconfigurationException(
                f"the checkpoint {self._checkpoint_path} holds the tables {sorted(saved['tables'])}, not {missing}"
            )
        if self.is_global_zero:
            assert self._client is not None
            assert self._checkpoint_path is not None
            directory = self._checkpoint_path.parent / saved["directory"]
            self._client.load([directory / name for name in saved["files"]])
        self.barrier("embedding tables restored")

    # the end ---------------------------------------------------------------------------------------------

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        if self._client is not None:
            finished = False
            try:
                finished = self._finish()
            finally:
                self._client = None
                self._stop_servers(finished)
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        super().teardown()

    def _finish(self) -> bool:
        """Flush, bring the tables back, tell the servers this trainer is done; whether every trainer was
        answered, so that the servers have nothing left to do."""
        finished = False
        client = self._client
        assert client is not None
        module = self.lightning_module
        try:
            if not self._failed:
                client.flush()
            if self.return_embeddings:
                try:
                    for name, embedding in self._offloaded.items():
                        table = client.table(name, embedding.num_embeddings)
                        embedding.weight = nn.Parameter(table.to(self.root_device))
                except Exception:
                    if not self._failed:
                        raise  # after a failure, the tables come back where they still can
            if not self._failed:
                client.finish()
                if self.world_size > 1:  # then every trainer has its answer
                    self.barrier("embedding servers finished")
                finished = True
        finally:
            client.close()
            # modules whose rows did not come back keep their stand-ins, which say where the tables went
            whole = all(not embedding.weight.is_meta for embedding in self._offloaded.values())
            if module is not None and whole:
                for name, embedding in self._offloaded.items():
                    _set_submodule(module, name, embedding)
            self._offloaded, self._remote = {}, {}
            # Not rpc's graceful shutdown: its barrier counts shutdowns per process, so a trainer's
            # second fit would never meet the new servers there. `finish` above is the agreement
            # that nothing is in flight (the servers wait for every trainer's).
            rpc.shutdown(graceful=False)
        return finished

    def _stop_servers(self, finished: bool) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            if finished:
                # Nothing is left for them to do: on their own they would wait a grace period for the last
                # answer to leave (they cannot know it arrived), then shut down; the trainers know.
                server.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=0 if self._failed else _SERVER_EXIT_WAIT_S)
            if server.poll() is None:
                server.kill()
                server.wait()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            STRATEGY_NAME,
            cls,
            description="DDP for the dense layers with the embedding tables on CPU embedding servers",
        )


def threads_beside_servers(servers: int, trainers: int = 1) -> int:
    """torch's intra-op threads for each of ``trainers`` trainer processes on a machine that also runs
    ``servers`` embedding servers: its cores less one per server, shared (at least 1, and never more
    than this process has now). What ``LayerOffloadStrategy(trainer_threads=None)`` sets there."""
    cores = len(os.sched_getaffinity(0))
    return min(torch.get_num_threads(), max(1, (cores - servers) // trainers))


class _ReadAhead:
    """A training DataLoader read ``depth`` batches ahead: each batch, as it is read, is handed to the
    strategy, which asks the servers for its rows ``ahead`` steps before it is trained on."""

    def __init__(self, dataloader: Any, depth: int, strategy: LayerOffloadStrategy) -> None:
        self.dataloader, self.depth, self.strategy = dataloader, depth, strategy

    def __iter__(self) -> Iterator[Any]:
        return iterate_ahead(self.dataloader, self.depth, self.strategy._prefetch_batch)

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:  # sampler, dataset, batch_size, ... as Lightning reads them
        return getattr(self.dataloader, name)


_RANK_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE")


def _mark_overflow(optimizer: Optimizer) -> None:
    """Put an inf in one gradient of ``optimizer``'s parameters: its GradScaler skips the step and backs off."""
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            grad = parameter.grad
            if grad is not None and not parameter.is_meta and not grad.is_sparse and grad.numel():
                grad[(0,) * grad.dim()] = float("inf")  # any layout; a 0-d gradient is indexed by ()
                return


def _plan(offload: object) -> PlacementPlan | None:
    if isinstance(offload, PlacementPlan):
        plan = offload
    elif isinstance(offload, (str, Path)) and str(offload).endswith((".json", ".yaml", ".yml")):
        if not Path(offload).is_file():
            raise ValueError(f"`offload` names the plan file {str(offload)!r}, which does not exist")
        plan = PlacementPlan.load(offload)
    else:
        return None
    if not plan.offloaded_layers():
        placed = dict(zip(plan.layers, plan.assignment))
        raise ValueError(
            f"the placement plan puts no embedding table on a CPU resource type ({placed});"
            " there is nothing for embedding servers to hold"
        )
    return plan


def _validate_offload(offload: object) -> str | tuple[str, ...]:
    if offload == "auto":
        return "auto"
    if isinstance(offload, str) or not isinstance(offload, Sequence) or not offload:
        raise ValueError(f"`offload` must be 'auto' or a non-empty list of embedding module names, got {offload!r}")
    names = tuple(offload)
    bad = [name for name in names if not isinstance(name, str) or not name]
    if bad or len(set(names)) != len(names):
        raise ValueError(f"`offload` must list distinct module names, got {list(names)!r}")
    return names


def _spec(name: str, embedding: nn.Module, optimizer: SparseRowOptimizer) -> TableSpec:
    return TableSpec(
        name=name,
        num_rows=embedding.num_embeddings,
        dim=embedding.embedding_dim,
        optimizer=optimizer,
        init_seed=torch.initial_seed() % (2**31) + sum(map(ord, name)),
        padding_idx=embedding.padding_idx,
        dtype=embedding.weight.dtype,
    )


def _shared_weights(module: nn.Module, selected: Mapping[str, nn.Module]) -> list[str]:
    owners: dict[int, set[str]] = {}
    for owner, child in module.named_modules(remove_duplicate=False):
        for parameter in child.parameters(recurse=False):
            owners.setdefault(id(parameter), set()).add(owner)
    return sorted(name for name, m in selected.items() if len(owners.get(id(m.weight), ())) > 1)


def _submodule(root: nn.Module, name: str) -> nn.Module | None:
    try:
        return root.get_submodule(name)
    except AttributeError:
        return None


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def _shard_directory(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + ".embeddings")


def _forget_earlier_rpc_groups() -> None:
    # torch.distributed.rpc numbers, per process, its rendezvous keys (by init_rpc calls) and its
    # all-gathers (by the set of worker names). The servers are new processes at every fit, so a
    # trainer's second fit would wait for keys and sequence numbers they never write. The earlier
    # group is shut down and each fit meets at a store of its own: counting from zero is safe.
    _compat.reset_rpc_counters()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class HeterogeneousLayerOffloadStrategy(LayerOffloadStrategy, HeterogeneousDDPStrategy):
    """:class:`LayerOffloadStrategy` with a batch size per trainer rank, changeable at any step.

    The trainer ranks train as :class:`~lightning_dynamix.strategies.HeterogeneousDDPStrategy` trains its
    ranks (one global schedule of per-rank batches, a rank with 0 samples sitting the step out): each
    trainer's gradients, the dense ones and its tables' rows alike, carry its share of the global batch,
    the dense ones are summed by the weighted all-reduce and the rows by the servers, so training is exactly
    that of one process on the global batch. ``DynamixCallback`` measures and resizes the trainers as it
    does any heterogeneous job; the embedding servers take no batch.

    Args:
        batch_sizes: one initial batch size per trainer rank (``devices * num_nodes`` of them); default the
            training DataLoader's ``batch_size`` on every trainer.
        min_batch_size, max_batch_size, loss_reduction, shuffle, seed, drop_last: as for
            :class:`~lightning_dynamix.strategies.HeterogeneousDDPStrategy`.
        num_embedding_servers, offload, sparse_optimizer, sparse_optimizer_args, staleness, launch_servers,
            server_port, return_embeddings, prefetch_depth, trainer_threads: as for :class:`LayerOffloadStrategy`
            (pipelined lookups read the heterogeneous DataLoader ahead).
        **ddp_kwargs: Lightning's ``DDPStrategy`` arguments, except a communication hook of its own.

    Raises:
        MisconfigurationException: at set-up, before any server starts, for a number of ``batch_sizes``
            other than the number of trainer ranks; the rest as both strategies raise.
    """

    strategy_name = HETEROGENEOUS_STRATEGY_NAME

    def __init__(
        self,
        batch_sizes: Sequence[int] | None = None,
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
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        loss_reduction: LossReduction = "mean",
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(
            num_embedding_servers=num_embedding_servers,
            offload=offload,
            sparse_optimizer=sparse_optimizer,
            sparse_optimizer_args=sparse_optimizer_args,
            staleness=staleness,
            launch_servers=launch_servers,
            server_port=server_port,
            return_embeddings=return_embeddings,
            prefetch_depth=prefetch_depth,
            trainer_threads=trainer_threads,
            batch_sizes=batch_sizes,
            min_batch_size=min_batch_size,
            max_batch_size=max_batch_size,
            loss_reduction=loss_reduction,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            **ddp_kwargs,
        )

    @override
    def setup(self, trainer: Any) -> None:
        sizes = self._batch_sizes
        if sizes is not None and len(sizes) != self.world_size:
            raise MisconfigurationException(
                f"`batch_sizes` {list(sizes)} gives {len(sizes)} trainer ranks a size, but the Trainer has"
                f" {self.world_size} (devices x num_nodes); give one size per trainer rank (the embedding servers"
                " take no batch)"
            )
        super().setup(trainer)
        assert self._client is not None
        self._client.waited = self._waited_for_servers

    def _waited_for_servers(self, started: float, ended: float) -> None:
        # the servers answer once every trainer pushed the update the lookup must see: a wait for the other
        # trainers (and the servers), which the step clock must not count as this trainer's compute
        if self._step_clock is not None and self._in_training_step:
            self._step_clock.collective(started, ended)

    @override
    def _row_gradient_weight(self) -> float:
        # the trainer's share of the global batch is in its gradients already (the factor on its loss's
        # gradient); the all-reduce multiplies the dense ones by the window's correction and sums: so do the servers
        return self._hook_state.weight

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            HETEROGENEOUS_STRATEGY_NAME,
            cls,
            description="LayerOffloadStrategy with a batch size per trainer rank and exactly weighted gradients",
        )


LayerOffloadStrategy.register_strategies(StrategyRegistry)
HeterogeneousLayerOffloadStrategy.register_strategies(StrategyRegistry)
