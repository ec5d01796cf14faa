"""Ranks that sit a step out (batch size 0) while staying in the process group.

A rank whose batch size is 0 at a step trains nothing. Where DDP makes no collective of its own
(:func:`can_leave_gradient_sync`), it can skip the step altogether: the others all-reduce in a group
of their own (:func:`training_ranks_group`), and before it is used again it receives their state
(:func:`broadcast_training_state`). Elsewhere DDP's all-reduce needs every rank's gradient
buckets: :func:`zero_gradient_loss` gives it a loss of exactly 0 that runs through the
DDP wrapper's forward (its buffer broadcast and its reducer's preparation, the collectives and
book-keeping every rank must share) without the wrapped module's forward, and whose backward gives
every trainable parameter a zero gradient: the communication hook then adds nothing, the rank's
weight ``b_r / sum(b)`` is 0, and the optimizer step applies the same all-reduced gradient on every
rank. The fixed cost of the model's forward and backward passes is skipped.

Collectives the ranks that train make among themselves (their gradients' all-reduce while others
are away, a weighted mean logged from the training step) go through :func:`training_ranks_group`: a
process group of just those ranks, created by them alone, once per set of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer


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


def can_leave_gradient_sync(model: DistributedDataParallel) -> bool:
    """Whether the other ranks of ``model`` can all-reduce without a rank that skips the step entirely.

    DDP's forward and backward make collectives over its whole process group in some set-ups: a
    broadcast of the module's buffers before every forward, the one-off rebuild of its gradient
    buckets in the second forward, the all-reduce of the used-parameter map with
    ``find_unused_parameters``, and a static graph's first iterations. A rank can leave the
    gradient all-reduce only where none of them remains; elsewhere it joins it with a zero gradient
    (:func:`zero_gradient_loss`).
    """
    return (
        not model.find_unused_parameters
        and not model.static_graph
        and not model.will_sync_module_buffers()
        and not getattr(model, "_use_python_reducer", False)
        and getattr(model, "_has_rebuilt_buckets", False)
    )


def _optimizer_state_tensors(optimizer: Optimizer, src: int, group: dist.ProcessGroup | None) -> list[Tensor]:
    """Make ``optimizer``'s state on this rank the same shape as ``src``'s; its tensors, in one order on every rank.

    The layout (for each parameter with state: its tensors' shapes and dtypes, and its other values;
    the parameter groups' hyperparameters) comes from ``src`` as one object; the tensors are then
    broadcast by the caller.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    layout: list[Any] = [None]
    if dist.get_rank() == src:
        entries = {}
        for index, param in enumerate(params):
            state = optimizer.state.get(param, {})
            tensors = {
                k: (v.shape, v.dtype, v.device == param.device) for k, v in state.items() if isinstance(v, Tensor)
            }
            values = {k: v for k, v in state.items() if not isinstance(v, Tensor)}
            if state:
                entries[index] = (tensors, values)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        layout = [(entries, groups)]
    dist.broadcast_object_list(layout, src=src, group=group)
    entries, groups = layout[0]
    for mine, theirs in zip(optimizer.param_groups, groups, strict=True):
        mine.update(theirs)
    out: list[Tensor] = []
    for index, param in enumerate(params):
        if index not in entries:
            optimizer.state.pop(param, None)
            continue
        tensors, values = entries[index]
        old = optimizer.state[param]
        state = optimizer.state[param] = dict(values)
        for key, (shape, dtype, on_param_device) in tensors.items():
            current = old.get(key)
            if not (isinstance(current, Tensor) and current.shape == shape and current.dtype == dtype):
                current = torch.empty(shape, dtype=dtype, device=param.device if on_param_device else "cpu")
            state[key] = current
            out.append(current)
    return out


def broadcast_training_state(
    module: Module, optimizers: Sequence[Optimizer], src: int, group: dist.ProcessGroup | None = None
) -> None:
    """Give every rank ``src``'s parameters, buffers and optimizer state (a collective over ``group``).

    What ranks that skipped steps (:func:`can_leave_gradient_sync`) need before they train, validate
    or are checkpointed again: they missed the optimizer steps taken meanwhile. Tensors of one device
    and dtype travel as one flat buffer.
    """
    tensors = [t.detach() for t in (*module.parameters(), *module.buffers())]
    for optimizer in optimizers:
        tensors += _optimizer_state_tensors(optimizer, src, group)
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for same in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for tensor in same:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
