"""What a change of world size needs, without a training framework: machine identities and the split of a resumed job.

A job on transient machines (spot instances, shared nodes) is stopped and restarted by the
engine users already run (torch elastic, a SLURM requeue), on however many machines are there.
Lightning's strategy and callback and :class:`~lightning_dynamix.integrations.accelerate.DynamixAccelerate`
use these pieces to resume it:

* :func:`machine_id` names the machine a rank runs on, stably across restarts (``DYNAMIX_MACHINE_ID``,
  else host and local rank), so that controllers keep what they learnt about the machines that stay;
* :func:`split_global_batch` and :func:`resume_sampler` resume a saved position in the data on
  another number of ranks: the rest of the epoch keeps its global batches, split over the new ranks
  by what the controller knows of them (evenly where it knows nothing), within the size bounds;
* :class:`PreemptionNotice` turns a SIGTERM on any one rank into one agreed step at which every rank
  saves the same checkpoint and exits with :data:`PREEMPTED_EXIT_CODE`, for the launcher to restart.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_dynamix.control.allocation import split_in_proportion
from lightning_dynamix.data.sampler import HeterogeneousBatchSampler
from lightning_dynamix.data.schedule import BatchSizes, validate_batch_sizes

MACHINE_ID_VARIABLE = "DYNAMIX_MACHINE_ID"

ResumeWeights = Callable[[], Sequence[float] | None]
"""Relative speeds of the ranks of a resumed job (one weight > 0 per rank), or ``None`` to split evenly."""


def machine_id(local_rank: int | None = None) -> str:
    """This rank's stable name: ``$DYNAMIX_MACHINE_ID``, else ``<host name>:<local rank>``.

    Set ``DYNAMIX_MACHINE_ID`` per machine (and per device where a machine runs several ranks)
    where host names change across restarts, or where several "nodes" share one host.
    """
    given = os.environ.get(MACHINE_ID_VARIABLE, "").strip()
    if given:
        return given
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return f"{socket.gethostname()}:{local_rank}"


def unique_ids(ids: Sequence[str]) -> list[str]:
    """``ids`` with repeats told apart (``a``, ``a#1``, ...) in rank order, so every rank has its own key."""
    seen: dict[str, int] = {}
    out = []
    for name in ids:
        count = seen.get(name, 0)
        seen[name] = count + 1
        out.append(name if count == 0 else f"{name}#{count}")
    return out


def gather_machine_ids(local_rank: int | None = None) -> list[str]:
    """Every rank's :func:`machine_id`, in rank order: a collective (one all_gather_object) in a process group."""
    own = machine_id(local_rank)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [own]
    ids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ids, own)
    return unique_ids([str(i) for i in ids])


def split_global_batch(
    total: int,
    world_size: int,
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
    weights: Sequence[float] | None = None,
) -> BatchSizes:
    """``total`` samples over ``world_size`` ranks in proportion to ``weights`` (evenly without), within the bounds.

    Raises:
        ValueError: naming the global batch, the ranks and the bounds, when no split within
            ``[min_batch_size, max_batch_size]`` sums to ``total``; for ``weights`` of another length.
    """
    upper = "no limit" if max_batch_size is None else max_batch_size
    most = "any number of" if max_batch_size is None else world_size * max_batch_size
    if total < world_size * min_batch_size or (max_batch_size is not None and total > world_size * max_batch_size):
        raise ValueError(
            f"a global batch of {total} samples cannot be split over {world_size} ranks with sizes in"
            f" [min_batch_size, max_batch_size] = [{min_batch_size}, {upper}]: they hold"
            f" {world_size * min_batch_size} to {most} samples. Resume on another number of ranks, or widen the bounds."
        )
    if weights is None:
        weights = [1.0] * world_size
    elif len(weights) != world_size:
        raise ValueError(f"`weights` must hold one weight per rank ({world_size}), got {list(weights)!r}")
    lower = [min_batch_size] * world_size
    higher: list[int | None] = [max_batch_size] * world_size
    return split_in_proportion(total, weights, lower, higher)


def resume_sampler(
    sampler: HeterogeneousBatchSampler,
    state: dict[str, Any],
    *,
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
    batch_sizes: Sequence[int] | None = None,
    weights: ResumeWeights | None = None,
) -> None:
    """Load a saved sampler ``state`` into ``sampler``, on the same or another number of ranks.

    On the same number of ranks the saved position and sizes come back exactly. On another, the
    rest of the epoch keeps its global batches (each split by :func:`split_global_batch` with the
    ranks' ``weights()``), and explicit ``batch_sizes`` (one per new rank) win from the resumed step on.

    Raises:
        ValueError: for a state the sampler refuses (another dataset, seed, shuffle or format), a
            global batch the new ranks cannot hold within the bounds, or explicit sizes whose count
            is not the new world size.
    """
    world = sampler.world_size
    explicit = None
    if batch_sizes is not None:
        explicit = validate_batch_sizes(
            batch_sizes, world_size=world, min_batch_size=min_batch_size, max_batch_size=max_batch_size
        )
    if state.get("world_size") == world:
        sampler.load_state_dict(state)
        return
    speeds = weights() if weights is not None else None
    low = max(min_batch_size, sampler.least_batch_size)  # a rank of a BatchNorm model trains 2 samples or more
    sampler.load_state_dict(state, split=lambda total: split_global_batch(total, world, low, max_batch_size, speeds))
    if explicit is not None:
        sampler.set_batch_sizes(explicit, from_step=sampler.next_step)


PREEMPTED_EXIT_CODE = 143
"""What a process exits with after its preemption checkpoint (128 + SIGTERM, as if the signal had ended it):
non-zero, so torch elastic restarts the group and a SLURM requeue sees the job as not finished."""


class Preempted(SystemExit):
    """Raised on every rank once the preemption checkpoint is saved: the process exits with ``PREEMPTED_EXIT_CODE``."""

    def __init__(self, step: int, path: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step
        self.path = path

    def __str__(self) -> str:
        return f"preempted: saved {self.path} at step {self.step}; exiting with {PREEMPTED_EXIT_CODE} for a restart"


class PreemptionNotice:
    """A preemption notice (SIGTERM, a spot instance's warning) received by any rank, agreed by all at a step boundary.

    The signal handler only records the notice: no collective, no I/O, nothing that could deadlock
    inside a handler. Every rank calls :meth:`poll` at the same step boundaries. Each poll starts a
    non-blocking all-reduce (MAX) of this rank's flag and reads the one the previous poll started,
    which finished in the background during the step in between: so the check costs no wait on the
    training path, and every rank learns at the same poll whether any rank had a notice, then saves
    the same step. A notice is acted on at the second poll after it arrives.

    Args:
        signals: the signals taken as a notice (default SIGTERM).
    """

    def __init__(self, signals: Sequence[signal.Signals] = (signal.SIGTERM,)) -> None:
        if not signals:
            raise ValueError("`signals` must name at least one signal, e.g. (signal.SIGTERM,)")
        self.signals = tuple(signals)
        self.received_at: float | None = None
        """``time.monotonic()`` when this process received its first notice, else ``None``."""
        self._previous: dict[signal.Signals, Any] = {}
        self._pending: tuple[torch.Tensor, Any] | None = None

    @property
    def received(self) -> bool:
        """Whether this process received a notice."""
        return self.received_at is not None

    def install(self) -> None:
        """Take the notice signals over (from the main thread), remembering the handlers they had."""
        for signum in self.signals:
            if signum not in self._previous:
                self._previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        """Give the signals their previous handlers back, and forget a poll still in flight."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        self._pending = None

    def _handle(self, signum: int, frame: object) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()

    def poll(self, device: torch.device | None = None) -> bool:
        """Whether any rank had a notice at the previous poll: a collective, call it on every rank at the same step.

        Returns False at the first poll. Once it returns True no new all-reduce is started.
        """
        agreed = False
        if self._pending is not None:
            flag, work = self._pending
            if work is not None:
                work.wait()
            agreed = bool(flag.item() > 0)
            self._pending = None
        if not agreed:
            flag = torch.tensor([1.0 if self.received else 0.0], device=device)
            work = None
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
            self._pending = (flag, work)
        return agreed

    def check(self, count: int, interval: int, device: torch.device | None = None) -> float | None:
        """At every ``interval``-th ``count`` (a step or batch counter, the same on every rank), :meth:`poll`.

        Returns ``None`` while no rank had a notice; once they agree, the ``time.monotonic()`` to
        count the save from: this process's notice, or now on a rank that had none.
        """
        if count % interval or not self.poll(device):
            return None
        return self.received_at if self.received_at is not None else time.monotonic()

    def finish(self) -> None:
        """Wait for the poll in flight (every rank started it); call it on every rank when training ends."""
        if self._pending is not None and self._pending[1] is not None:
            self._pending[1].wait()
        self._pending = None
