"""Learning-rate scaling rules for when a controller changes the global batch.

Every rule gives the learning rate at global batch ``B`` relative to the one at the base global
batch ``B0`` (the batch the job's learning rate was tuned for), as a function of the scale
``S = B / B0``:

* ``"none"``: 1. The learning rate is left alone (what Tyagi & Sharma do).
* ``"linear"``: ``S`` (Goyal et al.: the linear scaling rule).
* ``"sqrt"``: ``sqrt(S)`` (keeps the variance of the update constant for SGD).
* ``"adascale"``: the AdaScale gain ``r = (var + sqr) / (var / S + sqr)``, with ``var`` the
  per-sample gradient variance over ``B0`` and ``sqr = |G|^2``. With the simple noise scale
  ``B_noise = tr(Sigma) / |G|^2`` this is ``(B_noise / B0 + 1) / (B_noise / B + 1)``: close to
  ``S`` while ``B << B_noise`` (noise dominates: a bigger batch is worth a proportionally bigger
  step) and close to 1 once ``B >> B_noise`` (the gradient is already accurate). ``r`` always lies in
  ``[min(1, S), max(1, S)]``. When the noise scale is unknown (NaN, e.g. during warm-up or with a
  single rank) it falls back to ``sqrt(S)``, the geometric middle of that range; at ``S == 1``
  every rule gives exactly 1.
"""

from __future__ import annotations

import math

LR_SCALING_RULES: tuple[str, ...] = ("none", "linear", "sqrt", "adascale")


def validate_lr_scaling(rule: object) -> str:
    """Check a learning-rate scaling rule name and return it.

    Raises:
        ValueError: naming ``lr_scaling``, the value given and the valid names.
    """
    if not isinstance(rule, str) or rule not in LR_SCALING_RULES:
        raise ValueError(f"`lr_scaling` must be one of {list(LR_SCALING_RULES)}, got {rule!r}.")
    return rule


def adascale_gain(global_batch: float, base_global_batch: float, noise_scale: float) -> float:
    """AdaScale's gain ``(B_noise / B0 + 1) / (B_noise / B + 1)`` for a known noise scale ``B_noise`` (samples)."""
    return (noise_scale / base_global_batch + 1.0) / (noise_scale / global_batch + 1.0)


def lr_scale(rule: str, global_batch: int, base_global_batch: int, noise_scale: float = math.nan) -> float:
    """The learning rate at ``global_batch`` relative to the learning rate at ``base_global_batch``.

    Args:
        rule: one of :data:`LR_SCALING_RULES` (see the module docstring for each law).
        global_batch: the new global batch ``B``, samples per optimizer step over all ranks.
        base_global_batch: the global batch ``B0`` the job's learning rate was set for, samples.
        noise_scale: the gradient noise scale ``B_noise``, samples; used by ``"adascale"`` only.
            NaN, infinite or negative means unknown, and ``"adascale"`` then returns ``sqrt(B / B0)``.

    Returns:
        A finite factor > 0; exactly 1.0 when ``global_batch == base_global_batch``.

    Raises:
        ValueError: for an unknown rule or batch sizes that are not positive.
    """
    validate_lr_scaling(rule)
    if not global_batch > 0:
        raise ValueError(f"`global_batch` must be > 0 samples, got {global_batch!r}.")
    if not base_global_batch > 0:
        raise ValueError(f"`base_global_batch` must be > 0 samples, got {base_global_batch!r}.")
    if global_batch == base_global_batch:
        return 1.0
    scale = global_batch / base_global_batch
    if rule == "none":
        return 1.0
    if rule == "linear":
        return scale
    if rule == "sqrt":
        return math.sqrt(scale)
    if math.isfinite(noise_scale) and noise_scale >= 0:
        return adascale_gain(global_batch, base_global_batch, noise_scale)
    return math.sqrt(scale)
