"""Counting the items a loss averages over in a batch: a language model's tokens whose labels are not ignored.

A front end given ``count_items`` weights every rank's gradient by its share of the global batch's *items*
instead of its samples, so that a loss that is a mean over tokens trains exactly as one process on the whole
global batch (see docs/transformers.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_dynamix._checks import require_int

ItemCounter = Callable[[Any], int]
"""``count(batch) -> int``: the items of ``batch`` that its loss averages over.

A counter may also have a ``positions(batch) -> tuple[int, int]`` method, as :class:`LabelTokens` has: the token
positions the model computes (padding included) and how many of them are padding. The step clock then measures each
rank's work in positions (what a step's time grows with) and the monitor reports the padding.
"""


class LabelTokens:
    """Counts the tokens of a batch's labels that a cross-entropy loss does not ignore, as Hugging Face models do.

    A causal language model of ``transformers`` shifts the labels by one before its loss (the last position
    predicts nothing), and ignores labels equal to ``ignore_index``: the count is then
    ``(labels[..., 1:] != ignore_index).sum()``, what ``num_items_in_batch`` counts in Hugging Face's ``Trainer``.

    Args:
        key: where the labels are: a mapping's key (``batch[key]``), or an int for a tuple or list batch.
        ignore_index: the label the loss ignores (padding).
        shift: whether the loss predicts each token from those before it (causal LMs: ``True``); ``False`` for
            a loss over every labelled position (masked LMs, token classification).

    Raises:
        ValueError: for a ``key`` that is neither a str nor an int, or an ``ignore_index`` that is not an int.
    """

    def __init__(self, key: str | int = "labels", ignore_index: int = -100, shift: bool = True) -> None:
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise ValueError(f"`key` must be a str (a mapping's key) or an int (a tuple's index), got {key!r}")
        self.key = key
        self.ignore_index = require_int("ignore_index", ignore_index, None)
        self.shift = bool(shift)

    def __call__(self, batch: Any) -> int:
        """The tokens of ``batch``'s labels the loss counts.

        Raises:
            ValueError: where the batch holds no labels at :attr:`key`, or they are not an integer tensor.
        """
        labels = self._labels(batch)
        if self.shift:
            labels = labels[..., 1:]
        return int((labels != self.ignore_index).sum())

    def _labels(self, batch: Any) -> torch.Tensor:
        try:
            labels = batch[self.key] if isinstance(batch, (Mapping, tuple, list)) else getattr(batch, str(self.key))
        except (KeyError, IndexError, AttributeError, TypeError):
            raise ValueError(
                f"LabelTokens(key={self.key!r}) found no labels in a batch of type {type(batch).__name__}"
            ) from None
        if not isinstance(labels, torch.Tensor) or labels.is_floating_point():
            raise ValueError(
                f"LabelTokens(key={self.key!r}) needs the labels as an integer tensor, got"
                f" {type(labels).__name__}{'' if not isinstance(labels, torch.Tensor) else ' of ' + str(labels.dtype)}"
            )
        return labels

    def positions(self, batch: Any) -> tuple[int, int]:
        """``(positions, padding)``: the token positions of ``batch`` the model computes (its labels' elements, padding
        included) and how many of them are padding: the batch's ``attention_mask`` zeros where it is a mapping with
        one, else the labels equal to :attr:`ignore_index` (which also counts a prompt masked out of the loss)."""
        labels = self._labels(batch)
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        if isinstance(mask, torch.Tensor) and mask.shape == labels.shape:
            padding = int((mask == 0).sum())
        else:
            padding = int((labels == self.ignore_index).sum())
        return int(labels.numel()), padding

    def __repr__(self) -> str:
        return f"LabelTokens(key={self.key!r}, ignore_index={self.ignore_index}, shift={self.shift})"


def check_item_counter(count_items: object) -> ItemCounter | None:
    """``count_items`` if it is ``None`` or callable; raise ValueError naming it otherwise."""
    if count_items is not None and not callable(count_items):
        raise ValueError(
            f"`count_items` must be a callable that returns a batch's count of the items its loss averages over"
            f" (e.g. lightning_dynamix.LabelTokens()), or None to weight by samples, got {count_items!r}"
        )
    return count_items  # type: ignore[return-value]


def positions_of(count_items: ItemCounter, batch: Any) -> tuple[int, int] | None:
    """``count_items.positions(batch)`` checked (see :data:`ItemCounter`); ``None`` for a counter without the method.

    Raises:
        ValueError: for a result that is not two ints ``0 <= padding <= positions``.
    """
    method = getattr(count_items, "positions", None)
    if method is None:
        return None
    result = method(batch)
    if (
        not isinstance(result, tuple)
        or len(result) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in result)
        or not 0 <= result[1] <= result[0]
    ):
        raise ValueError(
            f"`count_items.positions(batch)` must return (positions, padding), two ints with"
            f" 0 <= padding <= positions, got {result!r}"
        )
    return result


def count_of(count_items: ItemCounter, batch: Any, samples: int) -> int:
    """``count_items(batch)`` checked: a non-negative int, positive where the batch has samples.

    Raises:
        ValueError: for a count that is not an int (or an integer tensor of one value), negative, or 0 in a
            batch with samples (its mean loss would be NaN).
    """
    count = count_items(batch)
    if isinstance(count, torch.Tensor) and count.numel() == 1 and not count.is_floating_point():
        count = int(count.item())
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"`count_items` must return a batch's count of items as an int >= 0, got {count!r}")
    if count == 0 and samples > 0:
        raise ValueError(
            f"`count_items` counted 0 items in a batch of {samples} samples: a loss that is a mean over its items"
            " is undefined there (NaN). Give each sample at least one item the loss counts (a label not ignored)."
        )
    return count
