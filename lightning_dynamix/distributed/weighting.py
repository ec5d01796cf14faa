"""The arithmetic that makes a summed all-reduce of uneven per-rank gradients exact.

With rank ``r`` training on ``b_r`` samples and a loss that is the mean over its own samples,
multiplying its gradient by ``w_r = b_r / sum(b)`` and summing over ranks gives exactly the mean
gradient over the global batch: the gradient one process would compute on all ``sum(b)``
samples.

Gradient accumulation extends the batch to every step back-propagated since the last
synchronisation (a *window*): the all-reduced gradient is the mean over all samples of the
window, on all ranks. When a rank's size changes inside a window, each backward pass gets its own
factor (returned by :meth:`SyncWindowWeighting.add_backward`) so that every sample counts the
same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

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

    Call :meth:`add_backward` before every backward pass, :meth:`sync_weight` before the one
    that synchronises (the weight the communication hook multiplies this rank's gradient by
    before the SUM all-reduce), and :meth:`reset` after it.

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
        self._last_step: int | None = None
        self._first_size = 0
        self._first_loss_scale = 1.0

    @property
    def window_samples(self) -> int:
        """Samples over all ranks in the steps back-propagated since the last synchronisation."""
        return self._window_samples

    def add_backward(self, step: int, batch_sizes: Sequence[int], loss_scale: float = 1.0) -> float:
        """Record a backward pass of ``step`` and return the factor its gradient must be scaled by.

        Args:
            step: the step whose batch is back-propagated; repeated backward passes of one step
                (several losses of one batch) count its samples once.
            batch_sizes: every rank's real batch size at that step.
            loss_scale: the factor the training loop already applied to the loss (Lightning's
                automatic optimisation divides it by ``accumulate_grad_batches``).

        Returns:
            1.0 unless this rank's size or the loss scale differ from the window's first step.
        """
        size = batch_sizes[self.rank]
        if step != self._last_step:
            self._window_samples += sum(batch_sizes)
            self._last_step = step
        if self._first_size == 0:
            self._first_size = size
            self._first_loss_scale = loss_scale
            return 1.0
        # every backward must contribute (first_loss_scale / first_size) * (sum of its per-sample grads)
        if self.loss_reduction == "mean":
            return (self._first_loss_scale * size) / (loss_scale * self._first_size)
        return self._first_loss_scale / loss_scale

    def sync_weight(self) -> float:
        """The factor for this rank's accumulated gradient before the SUM all-reduce."""
        if self._first_size == 0:
            raise RuntimeError("sync_weight() needs at least one add_backward() in the window")
        if self.loss_reduction == "mean":
            return self._first_size / (self._first_loss_scale * self._window_samples)
        return 1.0 / self._first_loss_scale
