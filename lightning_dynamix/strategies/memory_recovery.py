"""A step that runs out of device memory at a new size is trained again, its global batch split anew.

GPU models differ in memory, and a controller moves samples to the ranks that are fast: one of them may
then be given more samples than its memory holds. Every step at which some rank trains more samples than
it ever trained (a *trial*: the first steps, and every step after a size grew past a rank's largest) runs
its forward and backward without DDP's all-reduce. Then every rank says, in one small all-gather on a
group of its own, whether it ran out of memory:

* none did: the gradients are all-reduced at once (one flat all-reduce, weighted as DDP's hook would), and
  the step goes on to the optimizer as any other;
* some did: every rank puts back what the attempt changed (its gradients, the model's buffers, the random
  number generator's state), each rank that ran out gets a cap below the size it failed at (the largest size
  it trained, or three quarters of the size it failed at, whichever is larger), the same global batch is
  split anew within the caps (:func:`~lightning_dynamix.control.allocation.respect_batch_size_caps`), every
  rank rebuilds its batch from the shared schedule, and the step is trained again, inside the same optimizer
  step: the update is the one a single process makes on that global batch.

The caps hold from then on: every decision respects them (they are gathered with the rank's measurements
as :attr:`~lightning_dynamix.metrics.WorkerMetrics.max_batch_size`).

What it cannot recover: a step whose ``training_step`` makes a collective before the memory runs out (a
value logged with ``sync_dist=True``; ``GlobalBatchNorm``): the ranks that did not fail wait in it for the
one that did, until the process group's timeout. Recovery is off for models with ``GlobalBatchNorm``,
under manual optimisation, with gradient accumulation, and at steps where a rank sits out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from lightning_dynamix.control.allocation import respect_batch_size_caps
from lightning_dynamix.distributed.collectives import gather_floats, host_group
from lightning_dynamix.distributed.comm_hooks import squared_norm

if TYPE_CHECKING:
    from lightning_dynamix.batch_core import PerRankBatchCore
    from lightning_dynamix.metrics.timers import StepClock

log = logging.getLogger(__name__)

_SHRINK = 0.75  # a rank that ran out of memory at b samples is capped at 3/4 b (or its largest trained size)


class OutOfMemoryStop(RuntimeError):
    """A rank ran out of memory and the global batch cannot be split within the ranks' caps."""


@dataclass
class _Snapshot:
    """What a failed attempt changed and must be put back."""

    cpu_rng: Tensor
    cuda_rng: Tensor | None
    buffers: list[Tensor]


class OutOfMemoryRecovery:
    """The out-of-memory recovery of one rank: caps, trial steps, and the retry of a failed one.

    Args:
        world_size: ranks in the job.
        rank: this process's rank.
        caps: the largest size per rank given by the user (a cap per machine); ``None`` entries for none. The list
            is lowered in place.
        enabled: recover at all (``False``: an out-of-memory error ends the job as in plain DDP).
    """

    def __init__(self, world_size: int, rank: int, caps: list[int | None], enabled: bool = True) -> None:
        self.world_size = world_size
        self.rank = rank
        self.caps = caps
        """The largest size per rank, the same on every rank; lowered in place after a rank ran out of memory (the
        batch core's caps: every later split keeps within them)."""
        self.enabled = enabled
        self.trained = [0] * world_size
        """The largest size each rank trained a step at."""
        self.recovered = 0
        """Steps trained again after a rank ran out of memory."""
        self._group: Any = None
        self._trial = False
        self._failed: str | None = None
        self._snapshot: _Snapshot | None = None
        self.retry_batch: Any = None
        """The rebuilt batch the next attempt of the step trains; ``None``: the loader's."""
        self.retry_pending = False

    def setup(self, timeout: timedelta | None = None) -> None:
        """Find the group the trial steps' outcome is gathered over (:func:`host_group`, made at the first fit of a
        process: a collective, on every rank)."""
        if self.enabled and self.world_size > 1 and self._group is None:
            self._group = host_group(timeout)  # host flags, never in the way of NCCL's streams

    # ------------------------------------------------------------------ a step
    def is_trial(self, sizes: tuple[int, ...]) -> bool:
        """Whether a step at ``sizes`` gives some rank more samples than it ever trained."""
        return (
            self.enabled
            and self._group is not None
            and min(sizes) > 0
            and any(b > t for b, t in zip(sizes, self.trained))
        )

    def begin(self, module: Module, device: torch.device) -> None:
        """A trial attempt starts: remember what it may change."""
        self._trial = True
        self._failed = None
        self.retry_pending = False
        cuda = device.type == "cuda"
        self._snapshot = _Snapshot(
            cpu_rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state(device) if cuda else None,
            buffers=[b.detach().clone() for b in module.buffers()],
        )

    @property
    def in_trial(self) -> bool:
        return self._trial

    @property
    def failed(self) -> bool:
        return self._failed is not None

    def fail(self, error: BaseException) -> None:
        """This rank ran out of memory in the attempt (the error itself is dropped: it holds the step's tensors)."""
        self._failed = str(error).splitlines()[0] if str(error) else type(error).__name__
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def outcome(self, sizes: tuple[int, ...]) -> list[int]:
        """Every rank's outcome of the attempt: the size it failed at, 0 where it did not (a collective)."""
        failed = float(sizes[self.rank]) if self.failed else 0.0
        rows = gather_floats([failed], device=torch.device("cpu"), group=self._group)
        return [int(row[0]) for row in rows]

    def succeeded(self, sizes: tuple[int, ...]) -> None:
        """Every rank trained the attempt: the sizes are known to fit."""
        self.trained = [max(t, b) for t, b in zip(self.trained, sizes)]
        self._end()

    def restore(self, module: Module, device: torch.device) -> None:
        """Put back what the failed attempt changed: gradients, buffers, random state."""
        snapshot = self._snapshot
        assert snapshot is not None
        for parameter in module.parameters():
            parameter.grad = None
        with torch.no_grad():
            for buffer, saved in zip(module.buffers(), snapshot.buffers):
                buffer.copy_(saved)
        torch.set_rng_state(snapshot.cpu_rng)
        if snapshot.cuda_rng is not None:
            torch.cuda.set_rng_state(snapshot.cuda_rng, device)

    def split_anew(self, sizes: tuple[int, ...], failed_at: list[int], least: int) -> tuple[int, ...]:
        """Lower the caps of the ranks that failed and split the same global batch within every cap.

        Raises:
            OutOfMemoryStop: a rank cannot train even ``least`` samples, or the caps hold fewer samples than
                the global batch.
        """
        for rank, size in enumerate(failed_at):
            if size == 0:
                continue
            cap = max(self.trained[rank], int(size * _SHRINK))
            if cap < max(least, 1):
                raise OutOfMemoryStop(
                    f"rank {rank} ran out of device memory at {size} samples and cannot be given fewer than"
                    f" {max(least, 1)}; it cannot train this model. Free memory on its device or remove it."
                )
            current = self.caps[rank]
            self.caps[rank] = cap if current is None else min(current, cap)
        try:
            new = respect_batch_size_caps(sizes, self.caps, [least] * len(sizes))
        except ValueError as error:
            failed = [r for r, s in enumerate(failed_at) if s]
            raise OutOfMemoryStop(f"after ranks {failed} ran out of memory, {error}") from None
        if self.rank == 0:
            log.warning(
                "ranks %s ran out of device memory at sizes %s: their largest sizes are now %s; the step is"
                " trained again split %s",
                [r for r, s in enumerate(failed_at) if s],
                list(sizes),
                [self.caps[r] for r, s in enumerate(failed_at) if s],
                list(new),
            )
        self.recovered += 1
        self.retry_pending = True
        self._trial = False
        return new

    # ------------------------------------------------------------------ a trial step, start to end
    def train_attempt(
        self,
        model: DistributedDataParallel,
        device: torch.device,
        clock: StepClock | None,
        training_step: Callable[..., Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """``training_step(*args, **kwargs)`` of a trial step, without DDP's all-reduce, so that a rank that runs
        out of memory leaves no other waiting in it (:meth:`settle` all-reduces or splits anew). A retry trains
        :attr:`retry_batch` instead of the loader's batch."""
        if self.retry_batch is not None:  # the step again, its global batch split anew
            args = (self.retry_batch, *args[1:])
            self.retry_batch = None
        self.begin(model, device)
        if clock is not None:
            clock.irregular()  # its time holds the attempt and the all-reduce without overlap
        syncing = model.require_backward_grad_sync
        model.require_backward_grad_sync = False  # read by DDP's forward: no reduction prepared
        try:
            return training_step(*args, **kwargs)
        except torch.OutOfMemoryError as error:
            self.fail(error)
            return torch.zeros((), device=device, requires_grad=True)  # nothing of the model runs
        finally:
            model.require_backward_grad_sync = syncing

    def settle(
        self,
        model: DistributedDataParallel,
        device: torch.device,
        clock: StepClock | None,
        batch_core: PerRankBatchCore,
        loss: Tensor,
        backward: Callable[[Tensor], Tensor],
        to_device: Callable[[Any], Any],
    ) -> Tensor:
        """The backward pass of a trial step (``backward(loss)``), then every rank's outcome (a collective): the
        gradients all-reduced as DDP's weighted hook would, or the step's global batch split anew for a retry (its
        batch, moved by ``to_device``, in :attr:`retry_batch`)."""
        loader, weighting = batch_core.loader, batch_core.weighting
        assert loader is not None
        assert weighting is not None
        step, sizes = loader.current_step, loader.current_batch_sizes
        items = batch_core.step_items(device)  # on every rank, those that failed too: a collective
        output = loss
        if not self.failed:
            factor = weighting.add_backward(step, sizes, 1.0, sum(sizes if items is None else items), items)
            loss.register_hook(lambda grad: grad * factor)
            try:
                output = backward(loss)
            except torch.OutOfMemoryError as error:
                self.fail(error)
        failed_at = self.outcome(sizes)
        if not any(failed_at):  # every rank trained it: the all-reduce DDP's hook would have made
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            started = clock.bucket_ready(sum(g.numel() * g.element_size() for g in grads)) if clock else None
            local_sq, global_sq = all_reduce_gradients(model, weighting.sync_weight())
            if clock is not None:
                clock.bucket_done(started)
                clock.backward_end()
            norms = batch_core.hook_state.norms
            if norms is not None:
                norms.local.append(local_sq)
                norms.reduced.append(global_sq)
            batch_core.end_window()
            self.succeeded(sizes)
            return output
        self.restore(model, device)
        weighting.reset()
        new_sizes = self.split_anew(sizes, failed_at, batch_core.least_batch_size)  # the same on every rank
        loader.batch_sampler.resplit(step, new_sizes)
        self.retry_batch = to_device(loader.resplit_current())
        return output

    def until_trained(self, closure: Callable[[], Any]) -> Any:
        """Lightning's closure (training_step, zero_grad, backward), again while a rank ran out of memory."""
        while True:
            result = closure()
            if not self.retry_pending:
                return result

    def _end(self) -> None:
        self._trial = False
        self._failed = None
        self._snapshot = None
        self.retry_batch = None
        self.retry_pending = False


def recovery_obstacles(
    automatic_optimization: bool, accumulate_grad_batches: int, global_batch_norm: bool
) -> list[str]:
    """What keeps a failed attempt from being the whole optimizer step, trained again (empty where nothing does):
    manual optimisation, several batches a step, a collective of the model's own in the forward pass."""
    reasons = []
    if not automatic_optimization:
        reasons.append("manual optimisation (training_step steps the optimizer itself)")
    if accumulate_grad_batches != 1:
        reasons.append(f"accumulate_grad_batches={accumulate_grad_batches} (a step is several batches)")
    if global_batch_norm:
        reasons.append("GlobalBatchNorm (its statistics are gathered inside the forward pass)")
    return reasons


def all_reduce_gradients(module: Module, weight: float, group: Any = None) -> tuple[Tensor, Tensor]:
    """SUM every parameter's gradient, times ``weight``, over ``group`` in one flat all-reduce per dtype and device.

    What DDP's weighted hook does for a step that trained without it. Returns the squared norm of this rank's
    weighted gradient and of the summed one (the gradient noise scale's input), as the hook measures a bucket.
    """
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for parameter in module.parameters():
        if parameter.requires_grad and parameter.grad is not None:
            by_kind.setdefault((parameter.grad.dtype, parameter.grad.device), []).append(parameter.grad)
    local_sq, global_sq = [], []
    for grads in by_kind.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        if weight != 1.0:
            flat.mul_(weight)
        local_sq.append(squared_norm(flat))
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        global_sq.append(squared_norm(flat))
        for grad, reduced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(reduced.view_as(grad))
    if not local_sq:
        return torch.zeros(()), torch.zeros(())
    device = local_sq[0].device
    return torch.stack([t.to(device) for t in local_sq]).sum(), torch.stack([t.to(device) for t in global_sq]).sum()
