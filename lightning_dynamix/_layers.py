"""The one multi-layer perceptron builder every model of the package is made with."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn


def mlp(
    widths: Sequence[int], activation: Callable[[], nn.Module] = nn.ReLU, final_activation: bool = False
) -> nn.Sequential:
    """Linear layers through ``widths`` (the input width first), ``activation()`` after each but the last.

    Args:
        widths: the input width, then each layer's output width (at least two entries).
        activation: makes the activation module placed after a linear layer.
        final_activation: put one after the last linear layer too.

    Raises:
        ValueError: for fewer than two widths, or a width below 1.
    """
    if len(widths) < 2 or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
        raise ValueError(f"`widths` must be two or more ints >= 1 (the input width first), got {list(widths)!r}")
    layers: list[nn.Module] = []
    for index in range(len(widths) - 1):
        layers.append(nn.Linear(widths[index], widths[index + 1]))
        if final_activation or index < len(widths) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)
