"""Optimisers an embedding server applies to the rows a batch touched.

A server holds its shard of a table and the optimiser's state for those rows; each update brings
one gradient per distinct row (duplicates in the batch already summed, see
:meth:`~lightning_dynamix.offload.sharding.Route.split`), and only those rows and their state
change. The arithmetic is exactly that of torch's own optimisers on an ``nn.Embedding(...,
sparse=True)`` (``torch.optim.SGD``, ``torch.optim.Adagrad``), so a table trained on servers ends
where the same table trained in one process does. Per-row state has the rows along dimension 0,
so it is split and joined with the weights when a checkpoint is re-sharded.

The steps scale a row's change before ``index_add_`` rather than pass ``alpha``: the product is the same,
and torch's CPU ``index_add_`` is much slower with ``alpha != 1`` (docs/internals.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from lightning_dynamix._checks import require_number


class SparseRowOptimizer(ABC):
    """Updates rows of one table shard in place. Subclasses set :attr:`name` and define :meth:`step`."""

    name = ""

    def init_state(self, weight: torch.Tensor) -> dict[str, Any]:
        """The optimiser's state for a fresh shard ``weight`` (per-row tensors have rows along dimension 0)."""
        return {}

    def row_state_keys(self) -> tuple[str, ...]:
        """The entries of the state that are per row (split and joined with the weights on re-sharding)."""
        return ()

    @abstractmethod
    def step(self, weight: torch.Tensor, state: dict[str, Any], rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Apply one update to ``weight[rows]`` from ``grads`` (one per row, rows distinct)."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class RowSGD(SparseRowOptimizer):
    """``w[r] -= lr * g[r]`` on the touched rows: ``torch.optim.SGD`` on a sparse gradient.

    Args:
        lr: learning rate.
    """

    name = "sgd"

    def __init__(self, lr: float = 0.01) -> None:
        self.lr = require_number("lr", lr, 0.0, low_open=True)

    def step(self, weight: torch.Tensor, state: dict[str, Any], rows: torch.Tensor, grads: torch.Tensor) -> None:
        weight.index_add_(0, rows, grads * -self.lr)


class RowAdagrad(SparseRowOptimizer):
    """Adagrad on the touched rows: ``torch.optim.Adagrad`` on a sparse gradient.

    ``s[r] += g[r]^2``, ``w[r] -= lr_t * g[r] / (sqrt(s[r]) + eps)`` with
    ``lr_t = lr / (1 + (t - 1) * lr_decay)`` at the table's ``t``-th update.

    Args:
        lr: learning rate.
        lr_decay: learning-rate decay per update.
        initial_accumulator_value: the starting ``s`` of every row.
        eps: added to the square root.
    """

    name = "adagrad"

    def __init__(
        self, lr: float = 0.01, lr_decay: float = 0.0, initial_accumulator_value: float = 0.0, eps: float = 1e-10
    ) -> None:
        self.lr = require_number("lr", lr, 0.0, low_open=True)
        self.lr_decay = require_number("lr_decay", lr_decay, 0.0)
        self.initial_accumulator_value = require_number("initial_accumulator_value", initial_accumulator_value, 0.0)
        self.eps = require_number("eps", eps, 0.0)

    def init_state(self, weight: torch.Tensor) -> dict[str, Any]:
        return {"sum": torch.full_like(weight, self.initial_accumulator_value), "step": 0}

    def row_state_keys(self) -> tuple[str, ...]:
        return ("sum",)

    def step(self, weight: torch.Tensor, state: dict[str, Any], rows: torch.Tensor, grads: torch.Tensor) -> None:
        state["step"] += 1
        lr = self.lr / (1 + (state["step"] - 1) * self.lr_decay)
        total = state["sum"]
        summed = total.index_select(0, rows).add_(grads * grads)  # the rows are distinct
        total.index_copy_(0, rows, summed)
        weight.index_add_(0, rows, (grads / summed.sqrt_().add_(self.eps)).mul_(-lr))


SPARSE_OPTIMIZERS: dict[str, type[SparseRowOptimizer]] = {"sgd": RowSGD, "adagrad": RowAdagrad}


def make_sparse_optimizer(name: str | SparseRowOptimizer, **kwargs: Any) -> SparseRowOptimizer:
    """A sparse optimiser by name (:data:`SPARSE_OPTIMIZERS`) with its arguments, or one given as is.

    Raises:
        ValueError: for an unknown name or arguments the optimiser does not take.
    """
    if isinstance(name, SparseRowOptimizer):
        if kwargs:
            raise ValueError(f"`sparse_optimizer` was given as {name!r}; its arguments cannot be given too: {kwargs}")
        return name
    if name not in SPARSE_OPTIMIZERS:
        raise ValueError(
            f"`sparse_optimizer` must be one of {sorted(SPARSE_OPTIMIZERS)} or a SparseRowOptimizer, got {name!r}"
        )
    try:
        return SPARSE_OPTIMIZERS[name](**kwargs)
    except TypeError as error:
        raise ValueError(f"bad arguments {kwargs} for sparse optimizer {name!r}: {error}") from None


class FrozenRows(SparseRowOptimizer):
    """No optimiser: tables served for evaluation only (``validate``, ``test``, ``predict``)."""

    name = "frozen"

    def step(self, weight: torch.Tensor, state: dict[str, Any], rows: torch.Tensor, grads: torch.Tensor) -> None:
        raise RuntimeError("these embedding tables are served for evaluation only; nothing may update them")


def sparse_counterpart(optimizer: torch.optim.Optimizer) -> SparseRowOptimizer:
    """The sparse optimiser doing to the touched rows what ``optimizer`` does to a dense table.

    Raises:
        ValueError: for an optimiser, or settings (momentum, weight decay, ...), with no exact
            row-wise counterpart.
    """
    group = optimizer.param_groups[0]
    kind = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.SGD):
        unsupported = {k: group[k] for k in ("momentum", "weight_decay") if group.get(k)}
        unsupported |= {k: group[k] for k in ("nesterov", "maximize") if group.get(k)}
        if not unsupported:
            return RowSGD(lr=float(group["lr"]))
    elif isinstance(optimizer, torch.optim.Adagrad):
        unsupported = {k: group[k] for k in ("weight_decay", "maximize") if group.get(k)}
        if not unsupported:
            return RowAdagrad(
                lr=float(group["lr"]),
                lr_decay=group["lr_decay"],
                initial_accumulator_value=group["initial_accumulator_value"],
                eps=group["eps"],
            )
    else:
        raise ValueError(f"the LightningModule's optimizer is {kind}, which has no sparse counterpart here")
    raise ValueError(f"the LightningModule's {kind} uses {unsupported}, which its sparse counterpart does not support")
