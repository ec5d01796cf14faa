"""A DDP communication hook that all-reduces gradients with one weight per rank.

DDP's default reduction divides every rank's gradient by the world size and sums: right only when
all ranks train on the same number of samples. :func:`weighted_allreduce_hook` multiplies this
rank's gradient bucket by ``state.weight`` and sums, so with ``weight = b_r / sum(b)`` the result
is the exact global-batch gradient. It works with every backend, gloo on CPU included.

``HeterogeneousDDPStrategy`` applies the weights earlier, as a scalar on the loss's gradient (see
:class:`~lightning_dynamix.distributed.weighting.SyncWindowWeighting`), and leaves ``weight`` at
1.0, so the hook adds no pass over the gradients, except for a correction when an accumulation
window's sizes changed after it began.
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations at run time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class WeightedAllReduceState:
    """State of :func:`weighted_allreduce_hook`, updated by the training loop before each sync.

    Attributes:
        process_group: the group to all-reduce over; ``None`` for the default (world) group.
        weight: the factor for this rank's gradient in the next synchronisation (1.0: untouched).
    """

    process_group: dist.ProcessGroup | None = None
    weight: float = 1.0


def _bucket_result(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    return future.value()[0]


def weighted_allreduce_hook(
    state: WeightedAllReduceState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Multiply the bucket by ``state.weight`` and SUM it over the group (asynchronously)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    if state.weight != 1.0:
        tensor.mul_(state.weight)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work.get_future().then(_bucket_result)
