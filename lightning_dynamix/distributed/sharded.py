"""What both front ends need of a model sharded with FSDP2 (``fully_shard``): finding it, checking it, steering it.

Under FSDP2 each rank holds a shard of every parameter (a ``DTensor``); a module's forward all-gathers its
parameters and its backward reduce-scatters their gradients, averaged over the ranks. The per-rank batch core
weights each rank's loss by ``W * n_r / N`` for that average, keeps the unsharded gradients through an accumulation
window (:func:`set_gradient_sync`) and corrects a window whose samples were guessed wrong on the shards
(:func:`scale_gradients`); under Accelerate, its state is saved and loaded with torch distributed checkpoint
(:func:`save_shards`, :func:`load_shards`). See docs/sharded.md.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_dynamix import _compat
from lightning_dynamix.metrics.clocks import WaitTimer


def fsdp_modules(module: Module) -> list[FSDPModule]:
    """The modules of ``module`` (itself included) that ``fully_shard`` was applied to."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def is_sharded(module: object) -> bool:
    """Whether ``module`` is a model ``fully_shard`` was applied to (to it or to any of its modules)."""
    return isinstance(module, Module) and any(isinstance(m, FSDPModule) for m in module.modules())


def unsharded_parameters(module: Module) -> list[str]:
    """The names of ``module``'s trained parameters that no ``fully_shard`` holds (no rank would synchronise them)."""
    return [name for name, p in module.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]


def check_fully_sharded(module: Module, owner: str, error: type[Exception] = ValueError) -> None:
    """Refuse a sharded model with trained parameters ``fully_shard`` does not hold.

    Raises:
        ``error``: naming up to five of them and what to do.
    """
    loose = unsharded_parameters(module)
    if loose:
        shown = ", ".join(loose[:5]) + (f" and {len(loose) - 5} more" if len(loose) > 5 else "")
        raise error(
            f"{owner}: the model has {len(loose)} trained parameter(s) no fully_shard holds ({shown}); their"
            " gradients would never be synchronised. Apply fully_shard(module, mesh=...) to the model's root too (it"
            " takes every parameter its sharded submodules do not hold)."
        )


def set_gradient_sync(modules: Sequence[FSDPModule], sync: bool) -> None:
    """Let the FSDP ``modules`` (:func:`fsdp_modules`, found once: this runs at every backward) reduce-scatter their
    gradients in backward (``sync``), or keep them unsharded and accumulating until a backward that does."""
    for fsdp_module in modules:
        fsdp_module.set_requires_gradient_sync(sync, recurse=False)


def scale_gradients(module: Module, factor: float) -> None:
    """Multiply every gradient of ``module``'s parameters (its shards) by ``factor``, in place."""
    if factor == 1.0:
        return
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(factor)


SHARDS_FOLDER = "dynamix_shards"
"""Where :func:`save_shards` writes a sharded model's and its optimizers' state inside a checkpoint's folder."""


def save_shards(directory: str | os.PathLike, model: Module, optimizers: Sequence[Optimizer]) -> Path:
    """Write ``model``'s and ``optimizers``' sharded state with torch distributed checkpoint: each rank its shards.

    A collective: call it on every rank. Returns the folder written (``directory/dynamix_shards``); it loads on any
    number of ranks (:func:`load_shards`).
    """
    folder = Path(directory) / SHARDS_FOLDER
    dcp.save(_sharded_state(model, optimizers), checkpoint_id=folder)
    return folder


def load_shards(directory: str | os.PathLike, model: Module, optimizers: Sequence[Optimizer]) -> None:
    """Load what :func:`save_shards` wrote into ``model`` and ``optimizers``, resharded over this job's ranks.

    A collective: call it on every rank.

    Raises:
        FileNotFoundError: naming the folder, where ``directory`` holds no shards.
    """
    folder = Path(directory) / SHARDS_FOLDER
    if not folder.is_dir():
        raise FileNotFoundError(f"no sharded model state in {folder}: was it saved from a sharded model?")
    state = _sharded_state(model, optimizers)
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"])
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[f"optimizer_{index}"])


def _sharded_state(model: Module, optimizers: Sequence[Optimizer]) -> dict[str, Any]:
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    for index, optimizer in enumerate(optimizers):
        state[f"optimizer_{index}"] = get_optimizer_state_dict(model, optimizer)
    return state


def shard_blocks(module: Module, mesh: Any, block_types: tuple[type[Module], ...], **options: Any) -> Module:
    """``fully_shard`` on every outermost module of ``block_types`` in ``module``, then on ``module`` itself (it takes
    the parameters left over): one all-gather and one reduce-scatter per block. ``options`` go to every
    ``fully_shard`` (``mp_policy``, ``reshard_after_forward``). Returns ``module``."""
    from torch.distributed.fsdp import fully_shard

    def shard_within(parent: Module) -> None:
        for child in parent.children():
            if isinstance(child, block_types):
                fully_shard(child, mesh=mesh, **options)
            else:
                shard_within(child)

    shard_within(module)
    fully_shard(module, mesh=mesh, **options)
    return module


class TimedAllGather:
    """FSDP2's all-gather (``inner``, its ``AllGather`` comm), each call told to ``timer`` as a collective inside the
    step: the wait for the other ranks is not this rank's compute (:class:`~lightning_dynamix.metrics.StepClock`)."""

    def __init__(self, inner: Any, timer: WaitTimer) -> None:
        self.inner, self.timer = inner, timer

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        started = self.timer.now()
        work = self.inner(output_tensor, input_tensor, group, async_op)
        if work is None or not async_op:  # an asynchronous one ends at its wait, elsewhere: not timed
            self.timer.collective(started, self.timer.now())
        return work


class TimedReduceScatter:
    """FSDP2's reduce-scatter (``inner``, its ``ReduceScatter`` comm), each call told to ``timer`` as a collective
    inside the step, as :class:`TimedAllGather` is."""

    def __init__(self, inner: Any, timer: WaitTimer) -> None:
        self.inner, self.timer = inner, timer

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        started = self.timer.now()
        work = self.inner(output_tensor, input_tensor, group, op, async_op)
        if work is None or not async_op:
            self.timer.collective(started, self.timer.now())
        return work


def time_collectives(module: Module, timer: WaitTimer) -> None:
    """Tell ``timer`` of every all-gather and reduce-scatter ``module``'s FSDP modules run (once per module: a
    second call changes nothing)."""
    for fsdp_module in fsdp_modules(module):
        for group in _compat.fsdp_param_groups(fsdp_module):
            all_gather, reduce_scatter = _compat.fsdp_comms(group)
            if not isinstance(all_gather, TimedAllGather):
                all_gather = TimedAllGather(all_gather, timer)
            if not isinstance(reduce_scatter, TimedReduceScatter):
                reduce_scatter = TimedReduceScatter(reduce_scatter, timer)
            _compat.set_fsdp_comms(group, all_gather, reduce_scatter)
