"""Epoch-level metrics every rank reduces, also where ranks sat steps out.

Lightning reduces a value logged with ``self.log(..., on_epoch=True, sync_dist=True)`` (or a
torchmetrics ``Metric`` logged with ``on_epoch=True``) at the end of the epoch: each rank takes part
in one collective per metric, one metric after another, in the order its own results first saw
them. Two things break that where ranks sit steps out (``min_batch_size=0``), because a rank that
sits a step out does not run ``training_step``:

* a rank that sat out every step in which a metric was logged holds nothing for it and skips its
  collective: the others wait for it until the process group's timeout;
* a rank that first logged its metrics in another order (it sat out the step where the others began
  with a ``training_step`` metric, and logged one from ``on_train_batch_end`` first) pairs one
  metric's all-reduce with another's: the values are wrong, silently.

:func:`agree_on_epoch_metrics` runs at the end of every training epoch of a job whose ranks may sit
out, on every rank, before anything reads the epoch's metrics. One ``all_gather_object`` tells every
rank which epoch-level metrics each holds; a rank adds those it lacks with nothing accumulated (a
mean over 0 samples, a sum of 0, a maximum of -inf, a minimum of +inf, an untouched ``Metric``), so
its part of the reduction adds nothing, and every rank puts its metrics in one order (by name). The
values are then those of the ranks that logged them, as in a job where no rank sat out.

This reaches into Lightning's result collection, which Lightning keeps private, through
:mod:`lightning_dynamix._compat`: a Lightning that changed it fails with a message naming its version.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from typing_extensions import override

from lightning_dynamix import _compat

_NOTHING_ACCUMULATED = {"mean": 0.0, "sum": 0.0, "max": float("-inf"), "min": float("inf")}


@dataclass(frozen=True)
class _Logged:
    """What a rank tells the others of one epoch-level metric it holds: enough to make the same one."""

    key: str
    fx: str
    name: str
    prog_bar: bool
    logger: bool
    on_step: bool
    on_epoch: bool
    reduce_fx: str
    enable_graph: bool
    add_dataloader_idx: bool
    dataloader_idx: int | None
    metric_attribute: str | None
    sync_dist: bool
    rank_zero_only: bool
    is_tensor: bool
    value_dtype: torch.dtype | None  # of the accumulated value: the default dtype where it was logged ("64-true")


def _reduced_at_epoch_end(metric: Any) -> bool:
    """Whether Lightning reduces ``metric`` over the ranks at the epoch's end (a collective on every rank)."""
    meta = metric.meta
    if not meta.on_epoch:
        return False
    if not metric.is_tensor:
        return True  # a torchmetrics Metric synchronises its states when computed
    return bool(meta.sync.should) and not meta.sync.rank_zero_only and meta.sync.group is None


def _describe(key: str, metric: Any) -> _Logged:
    meta = metric.meta
    return _Logged(
        key=key,
        fx=meta.fx,
        name=meta.name,
        prog_bar=meta.prog_bar,
        logger=meta.logger,
        on_step=meta.on_step,
        on_epoch=meta.on_epoch,
        reduce_fx=meta.reduce_fx.__name__,
        enable_graph=meta.enable_graph,
        add_dataloader_idx=meta.add_dataloader_idx,
        dataloader_idx=meta.dataloader_idx,
        metric_attribute=meta.metric_attribute,
        sync_dist=meta.sync.should,
        rank_zero_only=meta.sync.rank_zero_only,
        is_tensor=metric.is_tensor,
        value_dtype=metric.value.dtype if metric.is_tensor else None,
    )


def _with_nothing_accumulated(trainer: pl.Trainer, logged: _Logged, metric: Any | None) -> Any:
    """``metric`` (made from ``logged`` where ``None``) as a rank holds it that logged nothing for it this epoch."""
    if metric is None:
        _Metadata, _ResultMetric, _Sync = _compat.result_metric_types()
        not_metadata = ("key", "sync_dist", "rank_zero_only", "is_tensor", "value_dtype")
        fields = {k: v for k, v in asdict(logged).items() if k not in not_metadata}
        meta = _Metadata(**fields)
        # what LightningModule.log gives it, so that a later self.log of the same name finds it equal
        meta.sync = _Sync(
            _should=logged.sync_dist, fn=trainer.strategy.reduce, _group=None, rank_zero_only=logged.rank_zero_only
        )
        metric = _ResultMetric(meta, logged.is_tensor)
        metric.to(trainer.strategy.root_device)
    if logged.is_tensor:
        value: Any = torch.tensor(_NOTHING_ACCUMULATED[logged.reduce_fx], device=trainer.strategy.root_device)
    else:
        value = getattr(trainer.lightning_module, logged.metric_attribute or "", None)
        if value is None:
            raise RuntimeError(
                f"rank {trainer.global_rank} logged no `{logged.name}` in the epoch (it sat out every step that logs"
                " it), and the torchmetrics Metric the other ranks logged cannot be found on the LightningModule:"
                f" give it as an attribute of the module, or log it with `metric_attribute=...`"
            )
    # an update of 0 samples (a step-level value would be reduced at once, by this rank alone: not here)
    on_step, metric.meta.on_step = metric.meta.on_step, False
    try:
        metric.update(value, 0)
    finally:
        metric.meta.on_step = on_step
    if logged.value_dtype is not None:  # the reduction's tensors must have one size on every rank
        metric.value = metric.value.to(logged.value_dtype)
    metric.has_reset = False
    return metric


def agree_on_epoch_metrics(trainer: pl.Trainer) -> None:
    """Give every rank the same epoch-level metrics, in the same order, before Lightning reduces them.

    A collective: call it on every rank at the end of a training epoch (see the module's docstring).
    """
    results = _compat.logged_results(trainer)
    if results is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    valid = dict(results.valid_items())  # what Lightning would reduce now
    mine = [_describe(key, metric) for key, metric in valid.items() if _reduced_at_epoch_end(metric)]
    everyone: list[list[_Logged] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    union: dict[str, _Logged] = {}
    for logged_by_rank in everyone:
        for logged in logged_by_rank or ():
            union.setdefault(logged.key, logged)
    for key, logged in union.items():
        metric = results.get(key)
        if metric is None or metric.has_reset:
            results[key] = _with_nothing_accumulated(trainer, logged, metric)
    # one order on every rank, so that the epoch's collectives pair up metric by metric
    ordered = sorted(results.items())
    results.clear()
    results.update(ordered)


class EpochMetricsAgreement(Callback):
    """Runs :func:`agree_on_epoch_metrics` at the end of each training epoch, on every rank.

    ``HeterogeneousDDPStrategy(min_batch_size=0)`` puts it first among the Trainer's callbacks, before
    any callback or hook that reads the epoch's metrics. It costs one ``all_gather_object`` of the
    metrics' names per epoch.
    """

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        agree_on_epoch_metrics(trainer)
