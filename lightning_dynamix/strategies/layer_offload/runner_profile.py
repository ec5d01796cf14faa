"""What a step of :class:`~lightning_dynamix.strategies.LayerOffloadStrategy` pays outside the model's layers.

A layer profile (:func:`~lightning_dynamix.placement.profile_model`) times the layers; the strategy's
step also reads a batch, runs Lightning's loop, asks the embedding servers for the batch's rows and
waits for them, pushes the rows' gradients back, has them applied, and steps the dense optimiser.
:func:`profile_runner` measures those terms on this machine, each with the real pieces:

* ``loader_seconds``: one batch read from the training DataLoader;
* ``optimizer_seconds``: one step of the LightningModule's own optimiser over its dense parameters;
* ``step_seconds``: the strategy's empty step, a real ``Trainer`` with :class:`LayerOffloadStrategy` and
  one embedding server training as many tables as the model has, of two rows each: Lightning's loop,
  one lookup and one push round trip, and what the trainer and the server pay per table, with next
  to no rows and no compute; ``request_seconds``: what a second server adds to it, of which
  ``server_table_seconds`` is the server's own work per table (timed with one row of every table);
* ``rows``, ``trainer_row_seconds`` and ``server_row_seconds``: the distinct rows a batch looks up
  per table, and per row what the trainer does with it (route it, assemble it, split its gradient)
  and what a server does (look it up, apply the sparse optimiser's update), timed with the real
  routing and an :class:`~lightning_dynamix.offload.embedding_server.EmbeddingServer` in this process holding
  the model's tables, with the counterpart of its optimiser.

:class:`~lightning_dynamix.placement.CostModel` adds them to the stages of a plan (see there), so a
plan's throughput forecasts what the strategy measures, not only what its layers cost. The terms are a
:class:`~lightning_dynamix.placement.RunnerProfile`, plain data: the planner reads them without knowing the
strategy, which is measured here, beside it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_dynamix.offload import RowSGD, sparse_counterpart
from lightning_dynamix.offload.embedding_server import EmbeddingServer, TableSpec
from lightning_dynamix.offload.sharding import RowSharding, route_tables
from lightning_dynamix.placement import RunnerProfile
from lightning_dynamix.placement.profile import (
    SPARSE_TYPES,
    Forward,
    LayerCall,
    batch_size_of,
    default_forward,
    record_layer_calls,
    time_passes,
)
from lightning_dynamix.strategies.layer_offload.strategy import LayerOffloadStrategy

_EMPTY_STEPS = 150  # steps of the empty-step run, of which the first
_EMPTY_WARMUP = 20  # are not timed


def profile_runner(
    module: nn.Module,
    dataloader: Any,
    forward: Forward | None = None,
    repeats: int = 10,
    trainer_threads: int | None = None,
) -> RunnerProfile:
    """Measure the terms of a :class:`~lightning_dynamix.placement.RunnerProfile` for ``module`` trained on
    ``dataloader``, on this machine's CPU.

    Args:
        module: the LightningModule (left as it was).
        dataloader: its training DataLoader; its first batch is the example batch.
        forward: ``forward(module, batch) -> loss``; default
            :func:`~lightning_dynamix.placement.profile.default_forward`.
        repeats: timed samples of each term measured by timing (the fastest is kept).
        trainer_threads: the strategy's ``trainer_threads`` for the empty step (None: its default).

    Raises:
        ValueError: for a module with no embedding table, or an empty DataLoader.
    """
    forward = forward or default_forward
    batches = iter(dataloader)
    try:
        batch = next(batches)
    except StopIteration:
        raise ValueError("`dataloader` is empty: the runner's terms need at least one batch") from None
    calls = [call for call in record_layer_calls(module, batch, forward) if isinstance(call.module, SPARSE_TYPES)]
    if not calls:
        raise ValueError(f"{type(module).__name__} has no nn.Embedding or nn.EmbeddingBag: nothing is offloaded")
    batch_size = batch_size_of(batch)
    loader = _loader_seconds(dataloader)
    model = copy.deepcopy(module)  # its optimiser steps a copy: the module is left as it was
    configure = getattr(model, "configure_optimizers", None)
    optimizer = _first_optimizer(configure()) if configure is not None else None
    optimizer_pass = _optimizer_pass(model, optimizer, batch, forward)
    rows, trainer_pass, server_pass, per_table_pass = _rows_passes(calls, optimizer)
    timed = time_passes([optimizer_pass, trainer_pass, server_pass, per_table_pass], "cpu", repeats, warmup=2)
    total_rows = max(sum(rows.values()), 1.0)
    dims = [call.module.embedding_dim for call in calls]
    one_server = _empty_step_seconds(dims, trainer_threads, 1)
    request = max(_empty_step_seconds(dims, trainer_threads, 2) - one_server, 0.0)
    return RunnerProfile(
        batch_size=batch_size,
        step_seconds=one_server,
        loader_seconds=loader,
        optimizer_seconds=timed[0][0],
        rows=rows,
        trainer_row_seconds=timed[1][0] / total_rows,
        server_row_seconds=max(timed[2][0] - timed[3][0], 0.0) / max(total_rows - len(calls), 1.0),
        request_seconds=request,
        server_table_seconds=min(timed[3][0], request),
    )


def _loader_seconds(dataloader: Any, batches: int = 40) -> float:
    """Seconds per batch read: the lower quartile of ``batches`` batches after the first (a fresh iterator, as
    every epoch has; on an idle machine noise only adds time, and the quartile holds still where the
    fastest alone would not)."""
    times = []
    iterator = iter(dataloader)
    next(iterator, None)
    for _ in range(batches):
        start = time.perf_counter()
        if next(iterator, None) is None:
            break
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 4] if times else 0.0


def _optimizer_pass(model: nn.Module, optimizer: torch.optim.Optimizer | None, batch: Any, forward: Forward) -> Any:
    """One step of ``model``'s optimiser over its dense parameters (the tables are the servers')."""
    if optimizer is None:
        return lambda: None
    forward(model, batch).backward()
    for leaf in model.modules():
        if isinstance(leaf, SPARSE_TYPES):
            leaf.weight.grad = None  # an optimiser skips a parameter without a gradient, as the strategy's meta tables

    def one_step() -> None:
        optimizer.step()

    return one_step


def _first_optimizer(configured: Any) -> torch.optim.Optimizer | None:
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, Mapping):
        return _first_optimizer(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    return None


def _rows_passes(
    calls: list[LayerCall], dense_optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, float], Any, Any, Any]:
    """The distinct rows of the example batch per table, and one step of what the trainer and what a server
    do with them (the server's optimiser the counterpart of the module's ``dense_optimizer``)."""
    optimizer = RowSGD(lr=0.01)  # where the module's has no counterpart (the strategy refuses it), plain SGD
    if dense_optimizer is not None:
        with contextlib.suppress(ValueError):
            optimizer = sparse_counterpart(dense_optimizer)
    server = EmbeddingServer(0, 1, 1)
    groups: dict[int, tuple[dict[str, torch.Tensor], dict[str, RowSharding]]] = {}  # by row length
    for call in calls:
        layer = call.module
        server.create_table(TableSpec(call.name, layer.num_embeddings, layer.embedding_dim, optimizer), None)
        ids, shardings = groups.setdefault(layer.embedding_dim, ({}, {}))
        ids[call.name] = call.inputs[0].detach()
        shardings[call.name] = RowSharding(layer.num_embeddings, 1)
    routes = {dim: route_tables(ids, shardings) for dim, (ids, shardings) in groups.items()}
    rows = {table: float(size) for route in routes.values() for table, size in zip(route.tables, route.sizes)}
    request = {table: local for route in routes.values() for table, local in route.shard_rows[0].items()}
    answer = server.lookup_many(0, request).wait()
    grads = {dim: torch.cat(route.assemble([answer], dim)) for dim, route in routes.items()}
    pushed = {}
    for dim, route in routes.items():
        pushed.update(route.split(grads[dim], set(route.tables))[0])
    server.push(0, 0, pushed, 1.0)
    step = [1]
    # one row of every table: what a server pays per table, whatever its rows
    one_request = {table: local[:1] for table, local in request.items()}
    one_pushed = {table: (local[:1], grads[:1]) for table, (local, grads) in pushed.items()}

    def trainer_step() -> None:  # route the ids, assemble the rows, split the gradients
        for dim, (ids, shardings) in groups.items():
            route = route_tables(ids, shardings)
            values = torch.cat(route.assemble([answer], dim))
            route.split(values, set(route.tables))

    def server_step(request: dict[str, torch.Tensor], pushed: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        server.lookup_many(step[0], request).wait()  # a lookup, and the update of its rows
        server.push(0, step[0], pushed, 1.0)
        step[0] += 1

    return (
        rows,
        trainer_step,
        functools.partial(server_step, request, pushed),
        functools.partial(server_step, one_request, one_pushed),
    )


def _empty_step_seconds(dims: list[int], trainer_threads: int | None, servers: int = 1) -> float:
    """The lower quartile of the steps of a real Trainer with LayerOffloadStrategy and ``servers`` servers,
    training a model of tables with rows of ``dims`` values, of two rows each, both looked up at every step."""

    class TwoRows(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.tables = nn.ModuleList(nn.Embedding(2, dim) for dim in dims)
            self.scale = nn.Parameter(torch.ones(1))

        def embedding_ids(self, batch: Any) -> dict[str, torch.Tensor]:
            return {f"tables.{index}": batch[0] for index in range(len(dims))}

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return sum(table(batch[0]).sum() for table in self.tables) * self.scale

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    timer = _StepTimes(warmup=_EMPTY_WARMUP)
    ids = torch.arange(2).repeat(_EMPTY_STEPS + 1)  # every batch: rows 0 and 1, on two servers, both
    loader = DataLoader(TensorDataset(ids), batch_size=2)
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:  # a measurement, not a training run: its banner would only confuse
            logger.setLevel(logging.WARNING)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            strategy = LayerOffloadStrategy(
                num_embedding_servers=servers, trainer_threads=trainer_threads, return_embeddings=False
            )
            _measuring_trainer(strategy, _EMPTY_STEPS, timer).fit(TwoRows(), loader)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    # the lower quartile: it holds still from process to process where the median moves (docs/internals.md)
    return sorted(timer.step_seconds)[len(timer.step_seconds) // 4]


class _StepTimes(Callback):
    """Every training step's wall time, from one batch end to the next, after ``warmup`` steps (seconds)."""

    # as the benchmarks' StepTimer times a step (lightning_dynamix.bench.timing); bench/ imports the strategies,
    # so the strategies cannot import it back

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.step_seconds: list[float] = []
        self._last: float | None = None
        self._seen = 0

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        self._seen += 1
        if self._last is not None and self._seen > self.warmup:
            self.step_seconds.append(now - self._last)
        self._last = now


def _measuring_trainer(strategy: LayerOffloadStrategy, steps: int, timer: _StepTimes) -> Trainer:
    """A Trainer for a measurement on the CPU: one device, ``steps`` training steps, and nothing else (no logger,
    checkpoint, validation or progress bar)."""
    return Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[timer],
    )
