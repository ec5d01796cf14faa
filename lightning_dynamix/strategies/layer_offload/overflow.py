"""fp16 mixed precision with the tables on servers: every trainer agrees whether the rows' gradients overflowed.

A GradScaler multiplies the loss, and so the rows' gradients, by its scale; its ``unscale_`` and its check
for inf or NaN reach the optimizer's parameters only. With the tables in the model, an inf or NaN in a
table's gradient makes the scaler skip the step and back off, on every rank (DDP all-reduced the
gradient). The rows' gradients are not the optimizer's, so after the backward pass the trainers agree
whether any has one (:func:`rows_checked`), and if so mark the step as the scaler sees it: an inf in a
dense gradient of a step it then skips (:func:`mark_overflow`). The rows are dropped with it
(:func:`~lightning_dynamix.strategies.layer_offload.lookups.push_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_dynamix.offload.remote import EmbeddingClient


def loss_scale(precision_plugin: object) -> float | None:
    """The scale of ``precision_plugin``'s GradScaler now (what the step's backward passes use); None without one."""
    scaler = getattr(precision_plugin, "scaler", None)
    return None if scaler is None else scaler.get_scale()


def rows_checked(
    closure: Callable[[], Any], optimizer: Optimizer, client: EmbeddingClient, device: torch.device, world_size: int
) -> Callable[[], Any]:
    """``closure``, then the GradScaler's check extended to the rows' gradients of ``client``'s step, agreed by
    the ``world_size`` trainers (an all-reduce where there are several)."""

    def checked() -> Any:
        result = closure()
        finite = client.rows_finite().to(device, torch.float32)
        if world_size > 1:
            torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        if not finite.item():
            mark_overflow(optimizer)
        return result

    return checked


def mark_overflow(optimizer: Optimizer) -> None:
    """Put an inf in one gradient of ``optimizer``'s parameters: its GradScaler skips the step and backs off."""
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            grad = parameter.grad
            if grad is not None and not parameter.is_meta and not grad.is_sparse and grad.numel():
                grad[(0,) * grad.dim()] = float("inf")  # any layout; a 0-d gradient is indexed by ()
                return
