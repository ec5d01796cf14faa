"""A DDP communication hook that all-reduces gradients with one weight per rank.

DDP's default reduction divides every rank's gradient by the world size and sums: right only when
all ranks train on the same number of samples. :func:`weighted_allreduce_hook` multiplies this
rank's gradient bucket by ``state.weight`` and sums, so with ``weight = b_r / sum(b)`` the result
is the exact global-batch gradient. It works with every backend, gloo on CPU included.

``HeterogeneousDDPStrategy`` applies the weights earlier, as a scalar on the loss's gradient (see
:class:`~lightning_dynamix.distributed.weighting.SyncWindowWeighting`), and leaves ``weight`` at
1.0, so the hook adds no pass over the gradients, except for a correction when an accumulation
window's sizes changed after it began.

The hook is also where a rank's network is measured without extra collectives: with a
:class:`~lightning_dynamix.metrics.StepClock` in ``state.clock`` it records when each bucket is
ready, its bytes and when its all-reduce completes; with :class:`BucketNorms` in ``state.norms``
it records each bucket's squared norm before the all-reduce (this rank's gradient) and after it
(the global gradient), which the gradient noise scale needs. In a group of one rank (a job of one,
or one rank training while the others sit the step out) there is nothing to all-reduce: the hook
returns the bucket as it is, reads no norms (its gradient is the global one) and the clock records
a transfer of no length.
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations at run time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_dynamix.metrics.timers import StepClock


@dataclass
class BucketNorms:
    """Squared norms of the gradient buckets of one synchronisation, as 0-dim tensors.

    ``local`` holds each bucket before the all-reduce (this rank's weighted gradient), ``reduced``
    after it (the global gradient); the tensors stay on the gradients' device (no host sync).
    """

    local: list[torch.Tensor] = field(default_factory=list)
    reduced: list[torch.Tensor] = field(default_factory=list)

    def clear(self) -> None:
        self.local.clear()
        self.reduced.clear()


@dataclass
class WeightedAllReduceState:
    """State of :func:`weighted_allreduce_hook`, updated by the training loop before each sync.

    Attributes:
        process_group: the group to all-reduce over; ``None`` for the default (world) group.
        weight: the factor for this rank's gradient in the next synchronisation (1.0: untouched).
        clock: records bucket readiness, bytes and all-reduce completion; ``None``: not measured.
        norms: collects squared bucket norms before and after the all-reduce; ``None``: not collected.
    """

    process_group: dist.ProcessGroup | None = None
    weight: float = 1.0
    clock: "StepClock | None" = None
    norms: BucketNorms | None = None


def _bucket_result(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    return future.value()[0]


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """The squared norm of a gradient bucket, a 0-dim tensor on its device (float32 at least)."""
    flat = tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()
    return torch.dot(flat, flat)  # one fused pass, no temporary the size of the bucket


def weighted_allreduce_hook(
    state: WeightedAllReduceState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Multiply the bucket by ``state.weight`` and SUM it over the group (asynchronously)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    if state.weight != 1.0:
        tensor.mul_(state.weight)
    clock = state.clock
    if group.size() == 1:
        # alone (a job of one, or the one rank that trains while the others sit the step out): the sum is
        # the bucket itself, and its gradient is the global one, so nothing for the noise scale either;
        # gloo's all-reduce over one rank would still cost time a bucket
        if clock is not None:
            clock.bucket_done(clock.bucket_ready(tensor.numel() * tensor.element_size()))
        alone: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        alone.set_result(tensor)
        return alone
    norms = state.norms
    if norms is not None:
        norms.local.append(squared_norm(tensor))
    started = clock.bucket_ready(tensor.numel() * tensor.element_size()) if clock is not None else 0.0
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    if clock is None and norms is None:
        return work.get_future().then(_bucket_result)

    def measured(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        result = future.value()[0]
        if clock is not None:
            clock.bucket_done(started)
        if norms is not None:
            norms.reduced.append(squared_norm(result))
        return result

    return work.get_future().then(measured)
