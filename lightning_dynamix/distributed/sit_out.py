"""Ranks that sit a step out (batch size 0) while staying in the process group.

A rank whose batch size is 0 at a step trains nothing, yet DDP's all-reduce needs every rank's
gradient buckets. :func:`zero_gradient_loss` gives it a loss of exactly 0 that runs through the
DDP wrapper's forward (its buffer broadcast and its reducer's preparation, the collectives and
book-keeping every rank must share) without the wrapped module's forward, and whose backward gives
every trainable parameter a zero gradient: the communication hook then adds nothing, the rank's
weight ``b_r / sum(b)`` is 0, and the optimizer step applies the same all-reduced gradient on every
rank. The fixed cost of the model's forward and backward passes is skipped.

Collectives the ranks that train make among themselves (a weighted mean logged from the training
step) go through :func:`training_ranks_group`: a process group of just those ranks, created by
them alone, once per set of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel


def zero_gradient_loss(model: DistributedDataParallel) -> Tensor:
    """A 0-dim loss of exactly 0 through ``model``'s DDP forward; its backward gives zero gradients.

    Call it where the rank would compute its training loss, and back-propagate it as usual
    (with gradient accumulation too): every trainable parameter gets a zero gradient, so the
    all-reduce adds nothing from this rank. The wrapped module's ``forward`` is not called.
    """
    inner = model.module
    patched = "forward" in vars(inner)
    original = vars(inner).get("forward")

    def forward() -> Tensor:
        params = [p for p in inner.parameters() if p.requires_grad]
        if not params:
            raise RuntimeError("the model has no trainable parameters to give a zero gradient to")
        return torch.stack([p.sum() for p in params]).sum() * 0.0

    inner.forward = forward  # type: ignore[method-assign]
    try:
        return model()
    finally:
        if patched:
            inner.forward = original  # type: ignore[method-assign]
        else:
            del inner.forward


# a group's name (its store keys) follows from its ranks alone, so a process creates each group once
# per default group: two trainers in one process (Lightning keeps the default group) share them
_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
_groups_of: object = None


def training_ranks_group(batch_sizes: Sequence[int]) -> dist.ProcessGroup | None:
    """The process group of the ranks with a batch size above 0; ``None`` (the default group) when all train.

    For collectives the ranks that sit out do not join: call it on the training ranks only. Each
    set of ranks gets its group once per process and default group, created with local
    synchronisation (ranks outside it need not take part).
    """
    global _groups_of
    if min(batch_sizes) > 0:
        return None
    if _groups_of is not dist.group.WORLD:  # another default group: the old ones are gone with it
        _groups.clear()
        _groups_of = dist.group.WORLD
    ranks = tuple(r for r, b in enumerate(batch_sizes) if b > 0)
    if ranks not in _groups:
        _groups[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _groups[ranks]
