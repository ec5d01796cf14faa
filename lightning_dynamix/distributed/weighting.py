"""The arithmetic that makes a summed all-reduce of uneven per-rank gradients exact.

With rank ``r`` training on ``b_r`` samples and a loss that is the mean over its own samples,
multiplying its gradient by ``w_r = b_r / sum(b)`` and summing over ranks gives exactly the mean
gradient over the global batch: the gradient one process would compute on all ``sum(b)``
samples.

Gradient accumulation extends the batch to every step back-propagated since the last
synchronisation (a *window*): the all-reduced gradient is the mean over all samples of the
window, on all ranks, even when sizes change inside the window.

A loss that is a mean over *items* rather than samples (a language model's over the tokens its labels do not
ignore) is weighted the same way with each rank's item count ``n_r`` in place of ``b_r``: the all-reduced gradient
is then the mean over every item of the window, as one process computes it on the whole global batch.

:class:`SyncWindowWeighting` applies the weights where they cost nothing: as a scalar factor on
each backward pass (the gradient of the loss, so autograd carries it into every parameter's
gradient with no extra pass over them). That needs the window's total sample count up front,
which the caller estimates from the schedule; if the window turns out different (sizes changed
inside it, or it was cut short), :meth:`~SyncWindowWeighting.sync_weight` returns the correction
the communication hook applies. In the usual case (no accumulation, or a window whose sizes were
already fixed) it is exactly 1 and the hook does not touch the gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from lightning_dynamix.distributed.comm_hooks import WeightedAllReduceState

LossReduction = Literal["mean", "sum"]
LOSS_REDUCTIONS: tuple[str, ...] = ("mean", "sum")


def validate_loss_reduction(loss_reduction: object) -> LossReduction:
    """Return ``loss_reduction`` if it is "mean" or "sum"; raise ValueError naming it otherwise."""
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(
            f"`loss_reduction` must be 'mean' (the loss averages over the rank's samples) or 'sum'"
            f" (it sums over them), got {loss_reduction!r}"
        )
    return loss_reduction  # type: ignore[return-value]


class SyncWindowWeighting:
    """One rank's gradient weights over a synchronisation window.

    Before every backward pass call :meth:`add_backward` and multiply that pass's gradient by
    the factor it returns; before the pass that synchronises, set the communication hook's
    weight to :meth:`sync_weight` (the hook multiplies by it, then SUMs over ranks); after it,
    call :meth:`reset`.

    Targets: for ``loss_reduction="mean"`` the all-reduced gradient is the mean of the
    per-sample gradients over every sample of the window on every rank; for ``"sum"`` it is their
    sum. Either way it equals what one process computes with the same loss on the concatenated
    global batch.

    Args:
        rank: this process's rank (its size is read from the per-step sizes).
        loss_reduction: how the training loss combines the rank's own samples.
    """

    def __init__(self, rank: int, loss_reduction: LossReduction = "mean") -> None:
        self.rank = rank
        self.loss_reduction = validate_loss_reduction(loss_reduction)
        self.reset()

    def reset(self) -> None:
        """Start a new window (after a synchronisation)."""
        self._window_samples = 0  # samples over all ranks of the distinct steps in the window
        self._window_own_samples = 0  # this rank's samples of those steps
        self._window_items = 0  # the items a mean loss averages over (samples, or the counts given), all ranks
        self._window_own_items = 0  # this rank's
        self._last_step: int | None = None
        self._normaliser = 0  # the window total the backward factors divided by

    @property
    def window_started(self) -> bool:
        """Whether a backward pass has been recorded since the last :meth:`reset`."""
        return self._normaliser > 0

    @property
    def window_samples(self) -> int:
        """Samples over all ranks in the steps back-propagated since the last synchronisation."""
        return self._window_samples

    @property
    def window_own_samples(self) -> int:
        """This rank's samples in the steps back-propagated since the last synchronisation."""
        return self._window_own_samples

    @property
    def window_items(self) -> int:
        """Items over all ranks in the window's steps: the ``items`` given, else the samples."""
        return self._window_items

    @property
    def window_own_items(self) -> int:
        """This rank's items in the window's steps: the ``items`` given, else its samples."""
        return self._window_own_items

    def add_backward(
        self,
        step: int,
        batch_sizes: Sequence[int],
        loss_scale: float = 1.0,
        window_estimate: int | None = None,
        items: Sequence[int] | None = None,
    ) -> float:
        """Record a backward pass of ``step`` and return the factor for its gradient.

        Args:
            step: the step whose batch is back-propagated; repeated backward passes of one step
                (several losses of one batch) count its samples once.
            batch_sizes: every rank's real batch size at that step.
            loss_scale: the factor the training loop already applied to the loss (Lightning's
                automatic optimisation divides it by ``accumulate_grad_batches``).
            window_estimate: at the window's first backward, the expected items (samples where no ``items``
                are given) over all ranks of every step up to the next synchronisation; default: this step's.
            items: every rank's count of the items a mean loss averages over at that step (a language model's
                tokens not ignored); ``None``: the samples, ``batch_sizes``.

        Returns:
            ``n_r / (loss_scale * window)`` for a mean loss (``n_r``: this rank's items, or samples),
            ``1 / loss_scale`` for a summed one.

        Raises:
            ValueError: for ``items`` of another length than ``batch_sizes``, or a negative count.
        """
        counts = batch_sizes if items is None else items
        if items is not None and (len(items) != len(batch_sizes) or min(items) < 0):
            raise ValueError(f"`items` must give every rank's count (>= 0), {len(batch_sizes)} of them, got {items}")
        if step != self._last_step:
            self._window_samples += sum(batch_sizes)
            self._window_own_samples += batch_sizes[self.rank]
            self._window_items += sum(counts)
            self._window_own_items += counts[self.rank]
            self._last_step = step
        if self._normaliser == 0:
            self._normaliser = window_estimate if window_estimate is not None else sum(counts)
            if self._normaliser < 1:
                raise ValueError(f"`window_estimate` must be a positive number of items, got {window_estimate}")
        if self.loss_reduction == "mean":
            return counts[self.rank] / (loss_scale * self._normaliser)
        return 1.0 / loss_scale

    def sync_weight(self) -> float:
        """The hook's factor at this synchronisation: 1.0 unless the window's estimate was off."""
        if self._normaliser == 0:
            raise RuntimeError("sync_weight() needs at least one add_backward() in the window")
        if self.loss_reduction == "mean" and self._normaliser != self._window_items:
            return self._normaliser / self._window_items
        return 1.0


def report_gradient_norms(
    hook_state: WeightedAllReduceState,
    weighting: SyncWindowWeighting,
    sink: Callable[[torch.Tensor, int, torch.Tensor, int], None],
) -> None:
    """Hand a synchronisation's squared gradient norms to ``sink``, then clear them: call after backward.

    ``sink(local_sq_norm, local_samples, global_sq_norm, global_samples)`` receives this rank's
    gradient (the mean over its own samples of the window) and the all-reduced one (over all samples),
    whatever weights the buckets carried; for a loss that is a mean over items, the means are the items', but
    the counts stay samples: the noise scale is then in samples, the unit of the batch sizes the controllers
    compare it with (a sample's tokens are not independent draws, so tokens would not be the units of the
    estimate either). Nothing happens when the hook measured no norms, or when
    this rank trained no sample in the window (it sat out: it has no gradient of its own).
    """
    norms = hook_state.norms
    if norms is None or not norms.local:
        return
    # DDP waited for every bucket's all-reduce (and so its completion callback) before backward returned
    local, reduced = torch.stack(norms.local).sum(), torch.stack(norms.reduced).sum()
    norms.clear()
    own, total = weighting.window_own_items, weighting.window_items
    if own == 0:
        return
    # buckets hold (own / total) x this rank's mean gradient before the all-reduce and the global
    # mean after it ("mean" losses); summed losses give own x and total x the means
    mean = weighting.loss_reduction == "mean"
    local_scale, global_scale = (total / own, 1.0) if mean else (1.0 / own, 1.0 / total)
    samples, own_samples = weighting.window_samples, weighting.window_own_samples
    sink(local * local_scale**2, own_samples, reduced * global_scale**2, samples)
