"""Small collectives the training loop needs: weighted means and agreement checks; exits and forks after them."""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_dynamix.data.sampler import HeterogeneousBatchSampler


# seconds the exit handler releases the interpreter for, so that backend threads finish their work
_EXIT_GRACE_SECONDS = 0.2
# seconds a fork waits with the interpreter released while a process group is initialized
FORK_GRACE_SECONDS = 0.02
_handlers_registered = False


def _let_backend_threads_finish() -> None:
    time.sleep(_EXIT_GRACE_SECONDS)


def _let_backend_threads_finish_before_fork() -> None:
    if dist.is_available() and dist.is_initialized():
        time.sleep(FORK_GRACE_SECONDS)


def let_backend_threads_finish() -> None:
    """Register (once per process) handlers that let the process group's threads finish before an exit or a fork.

    A gloo worker thread frees a finished collective's work, and the Python tensors and callbacks
    it holds, just after the collective has returned to Python; to do so it creates a Python
    thread state, under the interpreter's lock of thread states, before it takes the GIL.

    * Exit: if the script ends at that moment, the thread meets an interpreter already shutting
      down, cannot take the GIL, and the process aborts with "terminate called without an active
      exception" (SIGABRT) although training finished: more often on a loaded machine, where the
      thread waits longer for a core. Python runs exit handlers while the interpreter is still
      whole; this one releases it for a fraction of a second.
    * Fork (a DataLoader starting its worker processes, by default at every fit or epoch, just
      after the loop's collectives): a child forked while that thread holds the lock of thread
      states inherits it locked, and CPython 3.11 takes it in the child before the child runs any
      Python (``PyOS_AfterFork_Child``): the worker hangs before its first batch, and the job with
      it. Seen about once in 25 runs of a two-rank job resumed from a checkpoint with two workers
      per rank. While a process group is initialized, a fork first releases the interpreter for
      :data:`FORK_GRACE_SECONDS`, so the threads of collectives that have returned finish first.
    """
    global _handlers_registered
    if not _handlers_registered:
        atexit.register(_let_backend_threads_finish)
        os.register_at_fork(before=_let_backend_threads_finish_before_fork)
        _handlers_registered = True


def mean_by_counts_all_reduce(tensor: torch.Tensor, count: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The mean of ``tensor`` over the ranks of ``group`` (default: all), each rank's weighted by its ``count``:
    ``sum_r count_r * tensor_r / sum_r count_r``, with one all-reduce of the products and the count (float64).

    For a value that is a mean over a rank's samples (or items: a language model's tokens), it is the mean over
    every rank's samples (items), without knowing the others' counts beforehand. Returns a new floating tensor of
    ``tensor``'s shape (NaN where every count is 0); ``tensor`` is left untouched.
    """
    flat = tensor.detach().reshape(-1).double()
    packed = torch.cat([flat * count, flat.new_tensor([float(count)])])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    result = (packed[:-1] / packed[-1]).reshape(tensor.shape)
    return result.to(tensor.dtype) if tensor.is_floating_point() else result


def gather_ints(
    values: Sequence[int], device: torch.device | None = None, group: dist.ProcessGroup | None = None
) -> list[list[int]]:
    """Every rank's ``values`` (the same length on all ranks), with one all_gather over ``group`` (default: every
    rank), in the group's order."""
    local = torch.tensor(list(values), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return [t.tolist() for t in gathered]


def gather_floats(
    values: Sequence[float], device: torch.device | None = None, group: dist.ProcessGroup | None = None
) -> list[list[float]]:
    """Every rank's ``values`` (the same length on all ranks) as float64, with one all_gather over ``group``
    (default: every rank).

    Without an initialised process group (one process), returns ``[values]``.
    """
    local = torch.tensor(list(values), dtype=torch.float64, device=device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [local.tolist()]
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return [t.tolist() for t in gathered]


_host_group: list[object] = [None, None]  # the default group it was made beside, and the gloo group


def host_group(timeout: timedelta | None = None) -> dist.ProcessGroup | None:
    """A gloo group of every rank beside the default group: for a few host-side numbers (a flag per rank) that
    must neither wait behind nor be confused with the default group's collectives (NCCL's or gloo's).

    One a process for its current default group: the first call after a default group is made is a collective
    (every rank calls it, in the same order relative to its other group creations); later calls return the same
    group, so successive fits in one process share it (each gloo group holds threads and sockets). ``None``
    without a process group of two ranks or more.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if _host_group[0] is not dist.group.WORLD:
        _host_group[:] = [dist.group.WORLD, dist.new_group(backend="gloo", timeout=timeout)]
    return _host_group[1]  # type: ignore[return-value]


def broadcast_floats(values: Sequence[float], src: int = 0, device: torch.device | None = None) -> list[float]:
    """Rank ``src``'s ``values`` on every rank (every rank passes a list of the same length)."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(tensor, src=src)
    return tensor.tolist()


def set_batch_sizes_on_every_rank(
    sampler: HeterogeneousBatchSampler,
    sizes: Sequence[int],
    from_step: int | None = None,
    device: torch.device | None = None,
) -> int:
    """``sampler.set_batch_sizes`` from a step every rank agrees on: a collective, call it on every rank.

    One all_gather checks that every rank passes the same ``sizes`` and ``from_step``, and finds
    the first step no rank has produced yet (DataLoader workers prefetch, so ranks may be a few
    steps apart): ``from_step=None`` applies the sizes from there. Without a process group of two
    or more ranks it is ``sampler.set_batch_sizes(sizes, from_step)``.

    Returns:
        The step of the current epoch from which the sizes apply.

    Raises:
        ValueError: on every rank, when the ranks disagree, or ``from_step`` was already produced on some rank.
    """
    step = from_step
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        local = [sampler.next_step, -1 if from_step is None else from_step, *sizes]
        rows = gather_ints(local, device=device)
        if any(row[1:] != rows[0][1:] for row in rows):
            raise ValueError(
                "set_batch_sizes() was called with different arguments on different ranks"
                f" (from_step and sizes per rank: {[row[1:] for row in rows]}); every rank must pass"
                " the same values, e.g. a decision broadcast from rank 0."
            )
        produced = max(row[0] for row in rows)
        if from_step is None:
            step = produced
        elif from_step < produced:
            raise ValueError(
                f"`from_step`={from_step} was already produced on some rank (steps before {produced}"
                " are fixed); pass from_step=None for the first step that can still change."
            )
    return sampler.set_batch_sizes(sizes, step)
