"""Gradient noise scale B_noise from the per-rank and global gradients of uneven data-parallel batches.

What it measures: the critical batch size of McCandlish et al. (2018, "An Empirical Model of
Large-Batch Training"), B_noise = tr(Σ) / |G|², in samples. Σ is the covariance of one sample's
gradient and G the true (full-data) gradient. Below B_noise a larger batch buys almost linear
progress per step; above it the extra samples mostly average noise away. Goodput controllers
(Pollux / AdaptDL) turn it into a statistical efficiency (B_noise + B0) / (B_noise + B).

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/metrics/noise_scale.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torchmetrics import Metric
from typing_extensions import override

from lightning_dynamix import _compat

_Number = float | int | Tensor

# the per-interval state is one tensor, so a distributed sync is one all-gather; its entries, each summed over
# update() calls: |g_r|² - |G_B|², 1/b_r - 1/B (1 / samples), |G_B|², 1/B (1 / samples), 1 (the call count)
_NUM_SUMS = 5


def _state_dtype(device: torch.device) -> torch.dtype:
    # 1/b_r - 1/B is a small difference of small numbers: keep float64 wherever the device has it
    return torch.float32 if device.type == "mps" else torch.float64


class GradientNoiseScale(Metric):
    """Gradient noise scale B_noise (samples), pooled over ranks and steps, smoothed over intervals.

    Per synchronising step, every rank calls :meth:`update` with its own squared local norm and the
    squared global norm. Once per interval (every ``interval`` steps, say), every rank calls
    :meth:`compute`, which sums the ranks' values (one all-gather of a 5-element tensor),
    estimates tr(Σ) and |G|² from the interval, folds them into the moving averages and returns
    B_noise; then :meth:`reset` starts the next interval. The averages survive :meth:`reset` and are
    saved in ``state_dict()``; the interval's partial sums are not (they are per-rank values, and a
    checkpoint is written by one rank and read by all), so a run resumed mid-interval loses that
    interval's partial data, never the averages.

    Args:
        ema_decay: weight of the past in the moving averages, in [0, 1); 0 keeps only the latest
            interval, and a decay d averages over about 1 / (1 - d) intervals.
        **kwargs: passed to :class:`torchmetrics.Metric` (``sync_on_compute``, ``process_group``,
            ...). With ``sync_on_compute=False`` every rank estimates from its own values only, and
            the ranks' averages differ.

    Example:
        >>> metric = GradientNoiseScale(ema_decay=0.9)
        >>> metric.update(local_sq_norm=2.0, local_batch_size=8, global_sq_norm=1.2, global_batch_size=32)
        >>> metric.update(local_sq_norm=1.1, local_batch_size=24, global_sq_norm=1.2, global_batch_size=32)
        >>> b_noise = metric.compute()  # samples; NaN while unknown
        >>> metric.reset()
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None
    plot_lower_bound = 0.0

    sums: Tensor

    def __init__(self, ema_decay: float = 0.9, **kwargs: Any) -> None:
        if isinstance(ema_decay, bool) or not isinstance(ema_decay, (int, float)) or not 0.0 <= ema_decay < 1.0:
            raise ValueError(
                f"`ema_decay` must be a number in [0, 1), got {ema_decay!r}: 0 keeps only the latest interval, "
                "a decay d averages over about 1 / (1 - d) intervals."
            )
        super().__init__(**kwargs)
        self.ema_decay = float(ema_decay)
        self.add_state("sums", default=torch.zeros(_NUM_SUMS, dtype=_state_dtype(self.device)), dist_reduce_fx="sum")
        # bias-corrected moving averages (squared gradient units) and the weight 1 - decay^intervals
        self._ema_trace = 0.0
        self._ema_sq_norm = 0.0
        self._ema_weight = 0.0
        self._interval_folded = False

    @override
    def update(
        self,
        local_sq_norm: _Number,
        local_batch_size: _Number,
        global_sq_norm: _Number,
        global_batch_size: _Number,
    ) -> None:
        """Add one rank's values for one synchronising step; tensor operations only, no host sync.

        Args:
            local_sq_norm: |g_r|², squared norm of this rank's mean gradient before the all-reduce.
            local_batch_size: b_r, samples in this rank's gradient (> 0).
            global_sq_norm: |G_B|², squared norm of the mean gradient over all ranks after it.
            global_batch_size: B, samples over all ranks (>= b_r).

        Tensors must hold one element; they are moved to the metric's device, so keep the metric on
        the gradients' device (Lightning does, for a metric that is an attribute of the
        LightningModule) or the move waits for the accelerator.
        """
        for name, size in (("local_batch_size", local_batch_size), ("global_batch_size", global_batch_size)):
            if not isinstance(size, Tensor) and not size > 0:  # tensors are not checked: that would sync
                raise ValueError(f"`{name}` must be a positive number of samples, got {size!r}.")
        local_sq, local_b, global_sq, global_b = map(
            self._as_state, (local_sq_norm, local_batch_size, global_sq_norm, global_batch_size)
        )
        inverse_global = global_b.reciprocal()
        step = torch.stack(
            [
                local_sq - global_sq,
                local_b.reciprocal() - inverse_global,
                global_sq,
                inverse_global,
                torch.ones_like(global_sq),
            ]
        )
        self.sums = self.sums + step
        self._interval_folded = False

    def _as_state(self, value: _Number) -> Tensor:
        if isinstance(value, Tensor):
            return value.detach().to(device=self.sums.device, dtype=self.sums.dtype).reshape(())
        # a fill on the device: no host-to-device copy, which would wait for the accelerator's queue
        return self.sums.new_full((), float(value))

    @override
    def compute(self) -> Tensor:
        """Fold this interval into the moving averages and return B_noise (samples) as a 0-d tensor.

        Call it once per interval, on every rank (it synchronises), then :meth:`reset`. Calling it
        again before the next :meth:`update` returns the same value without folding twice.
        Returns NaN when the interval is unestimable (no updates, a single rank so that b_r = B,
        or a non-finite value such as an overflowed AMP step); the averages are then left as they
        were. Otherwise the value is :attr:`noise_scale` after folding, NaN included.
        """
        if not self._interval_folded:
            sums = self.sums.tolist()  # the one host sync, once per interval
            local_minus_global, inverse_gap, global_sq, inverse_global, count = sums
            estimable = count > 0 and inverse_gap > 0 and all(map(math.isfinite, sums))
            if not estimable:
                return torch.tensor(math.nan, dtype=self.sums.dtype, device=self.sums.device)
            trace = local_minus_global / inverse_gap
            sq_norm = global_sq / count - trace * inverse_global / count
            self._fold(trace, sq_norm)
        return torch.tensor(self.noise_scale, dtype=self.sums.dtype, device=self.sums.device)

    def _fold(self, trace: float, sq_norm: float) -> None:
        # m_n = m_{n-1} + (x_n - m_{n-1}) * (1 - d) / (1 - d^n): the bias-corrected EMA written so that
        # the first interval gives m_1 = x_1 exactly, whatever the decay
        self._ema_weight = self.ema_decay * self._ema_weight + (1.0 - self.ema_decay)
        step = (1.0 - self.ema_decay) / self._ema_weight
        self._ema_trace += (trace - self._ema_trace) * step
        self._ema_sq_norm += (sq_norm - self._ema_sq_norm) * step
        self._interval_folded = True

    @property
    def trace_estimate(self) -> float:
        """Moving average of tr(Σ), the trace of one sample's gradient covariance; NaN before any interval."""
        return self._ema_trace if self._ema_weight > 0 else math.nan

    @property
    def sq_norm_estimate(self) -> float:
        """Moving average of |G|², the squared norm of the true gradient; NaN before any interval.

        May be zero or negative: the noise then hides the gradient (see :attr:`noise_scale`).
        """
        return self._ema_sq_norm if self._ema_weight > 0 else math.nan

    @property
    def noise_scale(self) -> float:
        """B_noise = trace_estimate / sq_norm_estimate in samples, from the moving averages.

        NaN before any interval and while ``sq_norm_estimate <= 0``: the gradient is not yet
        distinguishable from noise, so B_noise is unknown (larger than anything measured), and an
        infinite value would turn a controller's (B_noise + B0) / (B_noise + B) into NaN anyway;
        a controller should keep its batch sizes on NaN. The averages keep their raw values, so
        later intervals can bring it back. A negative ``trace_estimate`` (noise below what the
        interval could resolve) gives 0.
        """
        trace, sq_norm = self.trace_estimate, self.sq_norm_estimate
        if not sq_norm > 0:  # NaN included
            return math.nan
        return max(trace, 0.0) / sq_norm

    @override
    def reset(self) -> None:
        """Start a new interval: clear the per-interval sums; the moving averages are kept."""
        super().reset()
        self._interval_folded = False

    @override
    def forward(self, *args: Any, **kwargs: Any) -> None:
        """Same as :meth:`update` (returns None): one step alone gives no useful B_noise.

        The base class would compute a value per call, and here computing folds into the moving
        averages, so every step would be counted as an interval.
        """
        self.update(*args, **kwargs)

    @override
    def get_extra_state(self) -> dict[str, float]:
        """The moving averages, for ``state_dict()``."""
        return {"ema_trace": self._ema_trace, "ema_sq_norm": self._ema_sq_norm, "ema_weight": self._ema_weight}

    @override
    def set_extra_state(self, state: dict[str, float]) -> None:
        """Restore the moving averages from ``load_state_dict()``."""
        self._ema_trace = float(state["ema_trace"])
        self._ema_sq_norm = float(state["ema_sq_norm"])
        self._ema_weight = float(state["ema_weight"])

    @override
    def _apply(self, fn: Callable[[Tensor], Tensor], exclude_state: Sequence[str] = "") -> Module:
        # `.to(torch.bfloat16)` on the LightningModule (true half precision) would otherwise cast the
        # sums too, where 1/b_r - 1/B loses all its digits: follow the device, keep the dtype
        excluded = (exclude_state,) if isinstance(exclude_state, str) else tuple(exclude_state)
        this = super()._apply(fn, exclude_state=(*excluded, "sums"))
        if "sums" not in excluded:
            dtype = _state_dtype(this.device)
            this.sums = this.sums.to(device=this.device, dtype=dtype)
            defaults = _compat.metric_state_defaults(this)
            defaults["sums"] = defaults["sums"].to(device=this.device, dtype=dtype)
        return this
