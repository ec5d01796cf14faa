"""Batch-dependent layers: the fewest samples a rank needs, and BatchNorm over the whole global batch.

A BatchNorm layer in training mode normalises with the mean and variance of the batch it is given.
Under data parallelism that is the rank's own batch, so with uneven per-rank batches

How it works, in full: ``docs/internals.md``, section ``lightning_dynamix/distributed/batch_norm.py``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Module

from lightning_dynamix import _compat
from lightning_dynamix.data.schedule import check_least_batch_size
from lightning_dynamix.distributed.sit_out import broadcast_flat
from lightning_dynamix.metrics.clocks import WaitTimer

log = logging.getLogger(__name__)

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None for the default group

MIN_SAMPLES_ATTRIBUTE = "min_samples_per_rank"
"""A module attribute (an int) that declares how many samples a rank must give the module in training mode;
:func:`least_batch_size` reads it beside the BatchNorm layers it knows."""

CollectiveTimer = WaitTimer
"""Told of every collective a layer makes (marks of its ``now()``), so that a step's timing counts the wait for
the other ranks as waiting, not as this rank's compute: a :class:`~lightning_dynamix.metrics.StepClock`."""

_current: list[tuple[ProcessGroup, CollectiveTimer | None, bool]] = [(None, None, False)]


def statistics_group() -> ProcessGroup:
    """The process group :class:`GlobalBatchNorm` gathers statistics over now (``None``: the default group)."""
    return _current[0][0]


@contextlib.contextmanager
def statistics_over(
    group: ProcessGroup, timer: CollectiveTimer | None = None, placeholder: bool = False
) -> Iterator[None]:
    """Inside the block, :class:`GlobalBatchNorm` gathers statistics over ``group`` (the ranks that train this step)
    and tells ``timer`` how long each of its collectives took (the backward pass's too). ``placeholder``: this rank's
    input is a placeholder it trains at weight 0 (it sits the step out but must run the model, as under FSDP): it
    takes part in every collective and adds nothing to the statistics."""
    previous = _current[0]
    _current[0] = (group, timer, placeholder)
    try:
        yield
    finally:
        _current[0] = previous


def set_statistics_group(group: ProcessGroup, timer: CollectiveTimer | None = None, placeholder: bool = False) -> None:
    """Gather :class:`GlobalBatchNorm` statistics over ``group`` from now on (``None``: the default group), timing
    its collectives with ``timer``; ``placeholder``: as for :func:`statistics_over`."""
    _current[0] = (group, timer, placeholder)


def least_batch_size(module: Module, world_size: int | None = None) -> tuple[int, list[str]]:
    """The fewest samples every rank that trains must give ``module``, and the layers that need more than one.

    Every BatchNorm layer (of any dimension, torch's ``SyncBatchNorm`` too) needs 2: in training mode it
    normalises with its input's statistics over the batch, which a single sample does not have. A
    :class:`GlobalBatchNorm` needs 1 (its statistics are the global batch's), or 2 in a job of one rank
    (``world_size=1``), whose batch is the global one. Any other module may declare its own need with an
    int attribute ``min_samples_per_rank``.

    Returns:
        ``(samples, names)``: the largest need (1 when no layer needs more) and the qualified names of
        the layers that need it, with their type, e.g. ``["net.1 (BatchNorm1d)"]``.
    """
    need, names = 1, []
    for name, layer in module.named_modules():
        if isinstance(layer, GlobalBatchNorm):
            layer_need = 2 if world_size == 1 else 1
        elif isinstance(layer, _compat.BatchNormBase):
            layer_need = 2
        else:
            declared = getattr(layer, MIN_SAMPLES_ATTRIBUTE, None)
            if declared is None:
                continue
            if isinstance(declared, bool) or not isinstance(declared, int) or declared < 1:
                raise ValueError(
                    f"`{MIN_SAMPLES_ATTRIBUTE}` of layer {name or '<root>'} ({type(layer).__name__}) must be an"
                    f" int >= 1 (samples), got {declared!r}"
                )
            layer_need = declared
        if layer_need > need:
            need, names = layer_need, []
        if layer_need == need and layer_need > 1:
            names.append(f"{name or '<root>'} ({type(layer).__name__})")
    return need, names


def fit_least_batch_size(
    module: Module,
    world_size: int,
    min_batch_size: int | None,
    batch_sizes: Sequence[int] | None,
    owner: str,
) -> tuple[int, int, str | None]:
    """The bounds a job of ``module`` on ``world_size`` ranks may use: ``(min_batch_size, least_batch_size, reason)``.

    ``min_batch_size`` is what the user gave (``None``: not given). The least size of a rank that trains
    rises to what the model's batch-dependent layers need (:func:`least_batch_size`); so does the smallest
    size where none was given (0, sitting out, stays allowed). ``reason`` names the layers (``None`` where
    no layer needs more than one sample), and one log line says what was raised.

    Raises:
        ValueError: naming ``owner`` and the layers, for a given ``min_batch_size`` or ``batch_sizes`` below the need.
    """
    low = 1 if min_batch_size is None else min_batch_size
    need, layers = least_batch_size(module, world_size)
    if need <= max(low, 1):
        return low, max(low, 1), None
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    verb = "normalises" if len(layers) == 1 else "normalise"
    reason = (
        f"layer{'s' if len(layers) > 1 else ''} {shown} {verb} with the statistics of the rank's own batch in"
        f" training, which needs at least {need} samples (synchronised BatchNorm, sync_batchnorm=True, normalises"
        " over the global batch instead)"
    )
    if min_batch_size is not None and min_batch_size > 0:
        raise ValueError(f"{owner}(min_batch_size={min_batch_size}) is too small: {reason}.")
    if batch_sizes is not None:
        check_least_batch_size(batch_sizes, need, "batch_sizes", reason)
    log.info("%s: every rank that trains gets at least %d samples per step: %s.", owner, need, reason)
    return (need if min_batch_size is None else 0), need, reason


class _GlobalBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        momentum: float,
        group: ProcessGroup,
        timer: CollectiveTimer | None,
        placeholder: bool,
    ) -> Tensor:
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        stats_dtype = torch.promote_types(x.dtype, torch.float32)
        xs = x.to(stats_dtype)
        count = 0 if placeholder else x.numel() // channels
        if count > 0:
            mean = xs.mean(dim=dims)
            m2 = ((xs - _per_channel(mean, x.dim())) ** 2).sum(dim=dims)
        else:
            mean = torch.zeros(channels, dtype=stats_dtype, device=x.device)
            m2 = torch.zeros_like(mean)
        local = torch.cat([torch.tensor([float(count)], dtype=stats_dtype, device=x.device), mean, m2])
        world = dist.get_world_size(group)
        gathered = [torch.empty_like(local) for _ in range(world)]
        started = timer.now() if timer is not None else None
        dist.all_gather(gathered, local, group=group)
        if timer is not None:
            timer.collective(started, timer.now())
        rows = torch.stack(gathered)
        counts, means, m2s = rows[:, :1], rows[:, 1 : 1 + channels], rows[:, 1 + channels :]
        total = counts.sum()
        if total <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {int(total)} over the ranks that train"
                " this step (GlobalBatchNorm normalises with the statistics of the global batch)"
            )
        global_mean = (counts * means).sum(dim=0) / total
        global_m2 = (m2s + counts * (means - global_mean) ** 2).sum(dim=0)
        var = global_m2 / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                unbiased = global_m2 / (total - 1)
                running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        x_hat = (xs - _per_channel(global_mean, x.dim())) * _per_channel(invstd, x.dim())
        out = x_hat
        if weight is not None:
            out = out * _per_channel(weight.to(stats_dtype), x.dim())
        if bias is not None:
            out = out + _per_channel(bias.to(stats_dtype), x.dim())
        ctx.save_for_backward(x_hat, invstd, weight)
        ctx.group, ctx.timer, ctx.total, ctx.has_bias = group, timer, total, bias is not None
        ctx.placeholder = placeholder
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x_hat, invstd, weight = ctx.saved_tensors
        dims = [0, *range(2, grad_out.dim())]
        dy = grad_out.to(x_hat.dtype)
        sum_dy = dy.sum(dim=dims) if dy.numel() else torch.zeros_like(invstd)
        sum_dy_xhat = (dy * x_hat).sum(dim=dims) if dy.numel() else torch.zeros_like(invstd)
        # the gradient of this rank's own outputs; DDP sums the parameters' gradients over the ranks
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype) if ctx.has_bias else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xhat])
            if ctx.placeholder:  # trained at weight 0: nothing of it reaches the others' gradients
                sums.zero_()
            started = ctx.timer.now() if ctx.timer is not None else None
            dist.all_reduce(sums, group=ctx.group)
            if ctx.timer is not None:
                ctx.timer.collective(started, ctx.timer.now())
            channels = invstd.numel()
            mean_dy, mean_dy_xhat = sums[:channels] / ctx.total, sums[channels:] / ctx.total
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            if ctx.placeholder:  # its input is in no statistic: the others' outputs do not depend on it
                mean_dy, mean_dy_xhat = torch.zeros_like(mean_dy), torch.zeros_like(mean_dy_xhat)
            grad_x = (
                (dy - _per_channel(mean_dy, dy.dim()) - x_hat * _per_channel(mean_dy_xhat, dy.dim()))
                * _per_channel(scale, dy.dim())
            ).to(grad_out.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None, None


def _per_channel(values: Tensor, dim: int) -> Tensor:
    return values.reshape(1, -1, *([1] * (dim - 2)))


class GlobalBatchNorm(_compat.BatchNormBase):  # type: ignore[misc, valid-type]
    """BatchNorm of any dimension whose training statistics are those of the global batch, over uneven ranks.

    Takes torch's BatchNorm arguments; the input is ``(N, C)`` or ``(N, C, *)``. In training mode
    inside a process group of several ranks it normalises with the global batch's mean and variance
    and updates the running statistics with them (see the module's docstring); elsewhere (evaluation,
    one process) it is exactly torch's BatchNorm.
    """

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of at least 2 dimensions (N, C, ...), got {input.dim()}D input")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        group, timer, placeholder = _current[0]
        if not (batch_stats and self.training and dist.is_available() and dist.is_initialized()) or (
            dist.get_world_size(group) == 1
        ):
            return F.batch_norm(
                input,
                self.running_mean if track else None,
                self.running_var if track else None,
                self.weight,
                self.bias,
                batch_stats,
                momentum,
                self.eps,
            )
        return _GlobalBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if self.track_running_stats else None,
            self.running_var if self.track_running_stats else None,
            self.eps,
            momentum,
            group,
            timer,
            placeholder,
        )


def convert_batch_norm(module: Module) -> Module:
    """Replace every BatchNorm layer of ``module`` (any dimension, ``SyncBatchNorm`` too) by a :class:`GlobalBatchNorm`.

    The new layers keep the parameters (the same tensors), the running statistics and the settings; each
    remembers the class it replaced for :func:`revert_batch_norm`. Returns the converted module (a new
    object when ``module`` itself is a BatchNorm layer).
    """
    if isinstance(module, _compat.BatchNormBase) and not isinstance(module, GlobalBatchNorm):
        converted = GlobalBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        _take_state(converted, module)
        converted._replaced_class = type(module)  # type: ignore[assignment]
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
        return converted
    for name, child in module.named_children():
        replacement = convert_batch_norm(child)
        if replacement is not child:
            module.add_module(name, replacement)
    return module


def _take_state(new: Module, old: Module) -> None:
    """``new`` holds ``old``'s parameters and statistics (the same tensors) and its training mode."""
    if old.affine:
        new.weight, new.bias = old.weight, old.bias
    new.running_mean, new.running_var = old.running_mean, old.running_var
    new.num_batches_tracked = old.num_batches_tracked
    new.training = old.training


def revert_batch_norm(module: Module) -> Module:
    """Undo :func:`convert_batch_norm`: every :class:`GlobalBatchNorm` it made becomes the class it replaced."""
    if isinstance(module, GlobalBatchNorm) and hasattr(module, "_replaced_class"):
        cls = module._replaced_class
        kwargs = {"num_features": module.num_features, "eps": module.eps, "momentum": module.momentum}
        reverted = cls(**kwargs, affine=module.affine, track_running_stats=module.track_running_stats)
        _take_state(reverted, module)
        return reverted
    for name, child in module.named_children():
        replacement = revert_batch_norm(child)
        if replacement is not child:
            module.add_module(name, replacement)
    return module


def has_global_batch_norm(module: Module) -> bool:
    """Whether ``module`` holds a :class:`GlobalBatchNorm` layer."""
    return any(isinstance(m, GlobalBatchNorm) for m in module.modules())


def broadcast_batch_norm_statistics(module: Module, src: int) -> None:
    """Give every rank ``src``'s running statistics of every :class:`GlobalBatchNorm` in ``module`` (a collective).

    What a rank that sat a step out (it ran no forward pass) needs to hold the statistics every rank that
    trained updated alike; one flat broadcast per device and dtype.
    """
    tensors = [
        t
        for layer in module.modules()
        if isinstance(layer, GlobalBatchNorm)
        for t in (layer.running_mean, layer.running_var, layer.num_batches_tracked)
        if t is not None
    ]
    broadcast_flat(tensors, src)
