"""Synthetic token sequences of varying length for a causal language model, and the collate that pads them.

Nothing is downloaded: :class:`SyntheticTokenSequences` generates each sequence from its index (the same on every
rank and run). Every sequence follows a rule a model can learn from its context, ``next = (a * token + b) mod V``
with ``(a, b)`` drawn per sequence from a few, so a causal model's loss falls well below the uniform ``log V``.
:func:`pad_sequences` pads a batch to its longest sequence with ``attention_mask`` and labels of -100 on padding,
as Hugging Face's ``DataCollatorForLanguageModeling(mlm=False)`` does; the tokens a causal model's loss counts are
then those :class:`~lightning_dynamix.data.items.LabelTokens` counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from lightning_dynamix._checks import require_int

IGNORE_INDEX = -100
"""The label a cross-entropy loss ignores (PyTorch's and Hugging Face's default): padding."""


class SyntheticTokenSequences(Dataset):
    """``num_samples`` token sequences of ``min_length`` to ``max_length`` tokens over a vocabulary of ``vocab_size``.

    Item ``i`` is ``{"input_ids": LongTensor[length], "index": i}``, the same wherever and whenever it is read.

    Args:
        num_samples: how many sequences (>= 1).
        vocab_size: tokens ``0 .. vocab_size - 1`` (>= 4); 0 is also the padding id of :func:`pad_sequences`,
            where the attention mask and labels hide it.
        min_length: the fewest tokens of a sequence (>= 2: a causal model predicts from the second on).
        max_length: the most tokens of a sequence (>= ``min_length``).
        rules: how many ``(a, b)`` rules the sequences are drawn from (>= 1).
        seed: the corpus (lengths, rules, first tokens).

    Raises:
        ValueError: naming the argument and the valid range.
    """

    def __init__(
        self,
        num_samples: int = 1024,
        vocab_size: int = 64,
        min_length: int = 4,
        max_length: int = 39,
        rules: int = 4,
        seed: int = 0,
    ) -> None:
        self.num_samples = require_int("num_samples", num_samples, 1)
        self.vocab_size = require_int("vocab_size", vocab_size, 4)
        self.min_length = require_int("min_length", min_length, 2)
        self.max_length = require_int("max_length", max_length, min_length)
        self.rules = require_int("rules", rules, 1)
        self.seed = require_int("seed", seed, None)
        generator = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(min_length, max_length + 1, (num_samples,), generator=generator)
        """Each sequence's length in tokens."""
        odd = torch.arange(1, vocab_size, 2)  # odd multipliers: a rule that maps every token to 0 is never drawn
        self._rules = torch.stack(
            [
                odd[torch.randint(len(odd), (rules,), generator=generator)],
                torch.randint(vocab_size, (rules,), generator=generator),
            ],
            dim=1,
        )
        self._rule_of = torch.randint(rules, (num_samples,), generator=generator)
        self._first = torch.randint(vocab_size, (num_samples,), generator=generator)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} is outside 0..{self.num_samples - 1}")
        a, b = (int(v) for v in self._rules[self._rule_of[index]])
        tokens = [int(self._first[index])]
        for _ in range(int(self.lengths[index]) - 1):
            tokens.append((a * tokens[-1] + b) % self.vocab_size)
        return {"input_ids": torch.tensor(tokens, dtype=torch.long), "index": index}


def pad_sequences(samples: Sequence[dict[str, Any]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """A batch of :class:`SyntheticTokenSequences` items padded on the right to the longest.

    Returns ``input_ids`` (padded with ``pad_id``), ``attention_mask`` (1 on tokens, 0 on padding), ``labels``
    (the tokens, :data:`IGNORE_INDEX` on padding) and ``index`` (each sample's).
    """
    longest = max(len(sample["input_ids"]) for sample in samples)
    input_ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for row, sample in enumerate(samples):
        tokens = sample["input_ids"]
        input_ids[row, : len(tokens)] = tokens
        mask[row, : len(tokens)] = 1
    labels = input_ids.masked_fill(mask == 0, IGNORE_INDEX)
    index = torch.tensor([int(sample["index"]) for sample in samples], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "index": index}


def sample_lengths(dataset: Any) -> list[int]:
    """Every sample's length, for batching by length: what the dataset says, else each sample's ``input_ids`` length.

    The dataset's own ``lengths`` (a sequence of ints, one per sample, as :class:`SyntheticTokenSequences` has) is
    used where it has one, through any ``torch.utils.data.Subset`` (``random_split``); otherwise every sample is
    read once and measured, as Hugging Face's ``LengthGroupedSampler`` does: a mapping's ``input_ids``, or the
    sample itself where it is a tensor or a sequence.

    Raises:
        ValueError: for a sample whose length cannot be read, naming it and what would be valid.
    """
    from torch.utils.data import Subset

    if isinstance(dataset, Subset):
        parent = sample_lengths(dataset.dataset)
        return [parent[i] for i in dataset.indices]
    own = getattr(dataset, "lengths", None)
    if own is not None and len(own) == len(dataset):
        return [int(v) for v in (own.tolist() if isinstance(own, torch.Tensor) else own)]
    lengths = []
    for index in range(len(dataset)):
        sample = dataset[index]
        tokens = sample.get("input_ids") if isinstance(sample, dict) else sample
        if not isinstance(tokens, (torch.Tensor, Sequence)) or isinstance(tokens, (str, bytes)):
            raise ValueError(
                f"cannot read the length of sample {index} of {type(dataset).__name__} (a {type(sample).__name__}):"
                " batching by length needs a dataset with `lengths` (one int per sample) or samples that are"
                " mappings with `input_ids`, tensors or sequences"
            )
        lengths.append(len(tokens))
    return lengths


def grouped_by_length(order: torch.Tensor, lengths: torch.Tensor, group: int) -> torch.Tensor:
    """``order`` with each run of ``group`` consecutive positions sorted by length, longest first (stable).

    The steps of a global schedule take consecutive positions, so a step's samples then have alike lengths and
    little padding. The groups keep the order's randomness across groups; within one, steps go from the longest
    sequences to the shortest (the longest first: a batch that does not fit in memory shows at once).
    """
    groups = []
    for start in range(0, len(order), group):
        chunk = order[start : start + group]
        groups.append(chunk[torch.argsort(lengths[chunk], descending=True, stable=True)])
    return torch.cat(groups) if groups else order
