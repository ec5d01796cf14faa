"""Ranks that sit a step out (batch size 0) while staying in the process group.

A rank whose batch size is 0 at a step trains nothing. Where DDP makes no collective of its own
(:func:`can_leave_gradient_sync`), it can skip the step altogether: the others all-reduce in a group
of their own (:class:`TrainingRanksGroups`), and before it is used again it receives their state
(:func:`broadcast_training_state`). Elsewhere DDP's all-reduce needs every rank's gradient
buckets: :func:`zero_gradient_loss` gives it a loss of exactly 0 that runs through the
DDP wrapper's forward (its buffer broadcast and its reducer's preparation, the collectives and
book-keeping every rank must share) without the wrapped module's forward, and whose backward gives
every trainable parameter a zero gradient: the communication hook then adds nothing, the rank's
weight ``b_r / sum(b)`` is 0, and the optimizer step applies the same all-reduced gradient on every
rank. The fixed cost of the model's forward and backward passes is skipped.

Collectives the ranks that train make among themselves (their gradients' all-reduce while others
are away, a weighted mean logged from the training step) go through a process group of just those
ranks (:class:`TrainingRanksGroups`), which every rank makes at the step the set first appears, so
that no collective depends on which ranks train without every rank having agreed to it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_dynamix import _compat
from lightning_dynamix._checks import require_int


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


MAX_TRAINING_GROUPS = 8
"""How many groups of training ranks a process keeps at most; the one unused the longest goes first."""


class TrainingRanksGroups:
    """The process groups of the ranks that train a step while others sit it out, agreed by every rank.

    :meth:`prepare` is a collective: every rank calls it at every step where some rank sits out, with
    the step's sizes (every rank knows them: they come from the one global schedule), before any
    collective among the ranks that train. The first time a set of training ranks appears, every rank
    makes its group, members and the others alike, in the same order. (A group made by its members
    alone, with torch's ``use_local_synchronization=True``, is named after its ranks and after the
    number of groups the calling process already knows; ranks that sat out different steps know
    different numbers, so the members of a new set waited for each other under different names, for
    ever: three ranks, rank 0 out and then rank 1 out. Made by every rank, a group is named from a
    counter that all ranks advance together.)

    At most ``capacity`` groups are held: before a new one is made, the group unused for the longest is
    retired (a barrier of its members, so none is still in a collective on it, then destroyed). A job of
    64 ranks with any sequence of sitting sets holds ``capacity`` groups at most. :meth:`group` returns
    a prepared group and makes nothing: what the training ranks call for their own collectives.

    A process keeps one of these (:func:`training_ranks_groups`), so successive fits in one process
    share their groups; groups of the default group a process had before its current one are dropped.

    Args:
        capacity: the most groups held at once, at least 1.
    """

    def __init__(self, capacity: int = MAX_TRAINING_GROUPS) -> None:
        self.capacity = require_int("capacity", capacity, 1)
        # (training ranks, timeout) -> their group (NON_GROUP_MEMBER on the other ranks), least recently used first
        self._groups: OrderedDict[tuple[tuple[int, ...], timedelta | None], Any] = OrderedDict()
        self._world: object = None
        self.created = 0
        """Groups made so far, retired ones included: how often a set of training ranks was new."""

    def __len__(self) -> int:
        """The number of groups held now."""
        return len(self._groups)

    def _key(self, batch_sizes: Sequence[int], timeout: timedelta | None) -> tuple[tuple[int, ...], timedelta | None]:
        if self._world is not dist.group.WORLD:  # a new default group: the old groups went with the old one
            self._groups.clear()
            self._world = dist.group.WORLD
        return tuple(r for r, b in enumerate(batch_sizes) if b > 0), timeout

    def prepare(self, batch_sizes: Sequence[int], timeout: timedelta | None = None) -> dist.ProcessGroup | None:
        """This step's group of training ranks, made first where the set is new: a collective, on every rank.

        Args:
            batch_sizes: every rank's size at the step.
            timeout: how long a collective on a group made now may wait for its members (the
                strategy's ``timeout``); ``None``: torch's default (30 minutes with gloo).

        Returns:
            The group on a rank that trains; ``None`` on a rank that sits out, and where every rank
            trains (the default group serves).
        """
        if min(batch_sizes) > 0:
            return None
        key = self._key(batch_sizes, timeout)
        if key in self._groups:
            self._groups.move_to_end(key)
        else:
            while len(self._groups) >= self.capacity:
                _retire(self._groups.popitem(last=False)[1])
            self._groups[key] = dist.new_group(list(key[0]), timeout=timeout)
            self.created += 1
        group = self._groups[key]
        return None if group == dist.GroupMember.NON_GROUP_MEMBER else group

    def group(self, batch_sizes: Sequence[int], timeout: timedelta | None = None) -> dist.ProcessGroup | None:
        """The group :meth:`prepare` made for these sizes and timeout (``None`` where every rank trains).

        No collective: call it on the ranks that train, after every rank prepared the step.

        Raises:
            RuntimeError: where this rank has no group prepared for that set of ranks.
        """
        if min(batch_sizes) > 0:
            return None
        key = self._key(batch_sizes, timeout)
        group = self._groups.get(key)
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            raise RuntimeError(
                f"rank {dist.get_rank()} has no process group prepared for the training ranks {list(key[0])}:"
                " every rank calls TrainingRanksGroups.prepare() with the step's sizes before the ranks that"
                " train use their group"
            )
        return group


def _retire(group: Any) -> None:
    if group == dist.GroupMember.NON_GROUP_MEMBER:
        return
    # a member may still be finishing its last collective on the group; destroyed under it, the
    # connections another member still reads from would close
    dist.barrier(group=group)
    dist.destroy_process_group(group)


_process_groups = TrainingRanksGroups()


def training_ranks_groups() -> TrainingRanksGroups:
    """This process's :class:`TrainingRanksGroups`: every strategy and loop of the process shares it."""
    return _process_groups


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
        and not _compat.ddp_uses_python_reducer(model)
        and _compat.ddp_has_rebuilt_buckets(model)
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
    broadcast_flat(tensors, src, group)


def broadcast_flat(tensors: Sequence[Tensor], src: int, group: dist.ProcessGroup | None = None) -> None:
    """Give every rank ``src``'s values of ``tensors`` (in place, a collective): one flat broadcast per device and
    dtype."""
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


class StaleRanks:
    """The ranks that skipped optimizer steps (sat them out away from the all-reduce) and so hold stale state.

    Every rank keeps the same set: call :meth:`at_step` at every training step, and :meth:`sync` wherever every
    rank must hold the trained state (before validation, with each checkpoint, at the end of training).
    """

    def __init__(self) -> None:
        self.ranks: set[int] = set()

    def clear(self) -> None:
        """Forget them (a new fit: every rank starts from the same state)."""
        self.ranks.clear()

    def at_step(self, out_of_step: set[int], module: Module, optimizers: Sequence[Optimizer]) -> None:
        """A step that ranks ``out_of_step`` miss: a stale rank that trains it first receives the others' state."""
        if self.ranks - out_of_step:
            self.sync(module, optimizers)
        self.ranks |= out_of_step

    def sync(self, module: Module, optimizers: Sequence[Optimizer]) -> None:
        """Give the stale ranks the parameters, buffers and optimizer state of the others.

        A collective: every rank calls it at the same point, and every rank knows which ranks are stale.
        """
        if not self.ranks:
            return
        source = min(set(range(dist.get_world_size())) - self.ranks)
        broadcast_training_state(module, optimizers, source)
        self.ranks.clear()
