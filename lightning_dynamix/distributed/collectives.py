"""Small collectives the training loop needs: weighted means and agreement checks."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def weighted_mean_all_reduce(tensor: torch.Tensor, weight: float) -> torch.Tensor:
    """The weighted mean of ``tensor`` over all ranks: ``sum_r weight_r * tensor_r``.

    The weights must sum to one over the ranks (``b_r / sum(b)`` for per-sample means).
    Returns a new floating tensor; ``tensor`` is left untouched.
    """
    result = tensor.detach().clone() if tensor.is_floating_point() else tensor.detach().double()
    result.mul_(weight)
    dist.all_reduce(result, op=dist.ReduceOp.SUM)
    return result


def gather_ints(values: Sequence[int], device: torch.device | None = None) -> list[list[int]]:
    """Every rank's ``values`` (the same length on all ranks), with one all_gather."""
    local = torch.tensor(list(values), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [t.tolist() for t in gathered]


def gather_floats(values: Sequence[float], device: torch.device | None = None) -> list[list[float]]:
    """Every rank's ``values`` (the same length on all ranks) as float64, with one all_gather.

    Without an initialised process group (one process), returns ``[values]``.
    """
    local = torch.tensor(list(values), dtype=torch.float64, device=device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [local.tolist()]
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [t.tolist() for t in gathered]


def broadcast_floats(values: Sequence[float], src: int = 0, device: torch.device | None = None) -> list[float]:
    """Rank ``src``'s ``values`` on every rank (every rank passes a list of the same length)."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(tensor, src=src)
    return tensor.tolist()
