"""What both front ends need of a model sharded with FSDP2 (``fully_shard``): finding it, checking it, steering it.

Under FSDP2 each rank holds a shard of every parameter (a ``DTensor``); a module's forward all-gathers its
parameters and its backward reduce-scatters their gradients, averaged over the ranks. The per-rank batch core
weights each rank's loss by ``W * n_r / N`` for that average, keeps the unsharded gradients through an accumulation
window (:func:`set_gradient_sync`) and corrects a window whose samples were guessed wrong on the shards
(:func:`scale_gradients`). See docs/sharded.md.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn import Module


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


def set_gradient_sync(module: Module, sync: bool) -> None:
    """Let every FSDP module of ``module`` reduce-scatter its gradients in backward (``sync``), or keep them
    unsharded and accumulating until a backward that does."""
    for fsdp_module in fsdp_modules(module):
        fsdp_module.set_requires_gradient_sync(sync, recurse=False)


def scale_gradients(module: Module, factor: float) -> None:
    """Multiply every gradient of ``module``'s parameters (its shards) by ``factor``, in place."""
    if factor == 1.0:
        return
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(factor)
