"""A built-in language-model workload: a small causal transformer on generated token sequences of varying length.

The benches' ``--architecture causal-lm``: :class:`CausalLanguageTask` trains a :class:`CausalTransformer` (plain
torch, no extra needed) on :class:`~lightning_dynamix.data.language.SyntheticTokenSequences` padded per batch by
:func:`~lightning_dynamix.data.language.pad_sequences`. Its loss is the mean over the tokens its labels do not
ignore, as a Hugging Face causal model's is, so a job weights its ranks by tokens
(:class:`~lightning_dynamix.data.items.LabelTokens`); its validation reports the token-mean loss (``val_loss``) and
next-token accuracy (``val_acc``). The ``transformers`` example (``examples/transformers``) trains a Hugging Face
model on the same data.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, Subset
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_dynamix._checks import require_int, require_number
from lightning_dynamix.data.language import IGNORE_INDEX, SyntheticTokenSequences, pad_sequences

Batch = dict[str, torch.Tensor]


class CausalTransformer(nn.Module):
    """A decoder-only transformer: token and learned position embeddings, ``depth`` pre-norm layers of causal
    self-attention (``heads`` heads, GELU, ``4 x width`` feed-forward), a final norm and a linear head to the
    vocabulary. Padding is masked out of attention by the batch's ``attention_mask``."""

    def __init__(self, vocab_size: int, width: int, depth: int, heads: int = 4, max_length: int = 64) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"`hidden` ({width}) must be a multiple of {heads} (attention heads) for causal-lm")
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Parameter(torch.randn(max_length, width) * 0.02)
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.layers = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Next-token logits, ``(batch, length, vocab_size)``."""
        length = input_ids.shape[1]
        if length > self.position.shape[0]:
            raise ValueError(f"a sequence of {length} tokens is longer than the model's {self.position.shape[0]}")
        # True where a position may not attend: later positions, and padding (bool, as the padding mask)
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).triu(1)
        hidden = self.embed(input_ids) + self.position[:length]
        hidden = self.layers(hidden, mask=causal, src_key_padding_mask=attention_mask == 0, is_causal=True)
        return self.head(self.norm(hidden))


def token_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of each position's prediction of the next token, over the labels not ignored (padding)."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )  # fmt: skip


class CausalLanguageTask(LightningModule):
    """Trains a :class:`CausalTransformer` on the token-mean loss; validates loss and next-token accuracy.

    Logs ``train_loss`` at every step, ``val_loss`` (the mean over every validation token) and ``val_acc`` (the
    fraction of validation tokens predicted) once per validation; both are torchmetrics objects weighted by
    tokens, so under DDP they are exact over all ranks' tokens.

    Args:
        vocab_size: tokens of the vocabulary (the data's).
        hidden: the model's width (a multiple of 4, its attention heads).
        depth: its layers (>= 1).
        lr: learning rate.
        optimizer: ``"adam"`` (AdamW, default) or ``"sgd"`` (momentum 0.9).
        seed: seed of the initial weights; ``None`` draws them from the global generator.
        max_length: the longest sequence the model takes (its position embeddings).
    """

    def __init__(
        self,
        vocab_size: int = 128,
        hidden: int = 128,
        depth: int = 2,
        lr: float = 3e-3,
        optimizer: str = "adam",
        seed: int | None = 0,
        max_length: int = 64,
    ) -> None:
        super().__init__()
        require_int("vocab_size", vocab_size, 4)
        require_int("hidden", hidden, 4)
        require_int("depth", depth, 1)
        require_number("lr", lr, 0.0, low_open=True)
        if optimizer not in ("sgd", "adam"):
            raise ValueError(f"`optimizer` must be 'sgd' or 'adam', got {optimizer!r}")
        self.save_hyperparameters()

        def build() -> nn.Module:
            return CausalTransformer(vocab_size, hidden, depth, max_length=max_length)

        if seed is None:
            self.network = build()
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(require_int("seed", seed, 0))
                self.network = build()
        self.val_loss = MeanMetric()
        self.val_acc = MeanMetric()

    @override
    def forward(self, batch: Batch) -> torch.Tensor:
        return self.network(batch["input_ids"], batch["attention_mask"])

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = token_loss(self(batch), batch["labels"])  # the mean over this rank's tokens
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def on_validation_epoch_start(self) -> None:
        self.val_loss.reset()
        self.val_acc.reset()

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        logits = self(batch)
        labels = batch["labels"][:, 1:]
        counted = labels != IGNORE_INDEX
        tokens = int(counted.sum())
        self.val_loss.update(token_loss(logits, batch["labels"], "sum") / tokens, weight=tokens)
        correct = (logits[:, :-1].argmax(dim=-1) == labels) & counted
        self.val_acc.update(correct.sum() / tokens, weight=tokens)
        self.log("val_loss", self.val_loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("val_acc", self.val_acc, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        h = self.hparams
        if h.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=h.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=h.lr)


class TokenSequenceDataModule(LightningDataModule):
    """``num_samples`` training and ``num_val_samples`` validation sequences of
    :class:`~lightning_dynamix.data.language.SyntheticTokenSequences` (one corpus, split), padded per batch.

    Args:
        num_samples: training sequences per epoch.
        batch_size: every rank's batch size (the strategy's sizes replace it in training).
        seed: the corpus.
        num_val_samples: validation sequences.
        vocab_size: tokens of the vocabulary.
        min_length: the shortest sequence, tokens.
        max_length: the longest sequence, tokens.
        rules: how many rules the sequences follow (the default takes the model of the benches ~150 steps of 32
            sequences to a validation loss of 0.5, from 4.9).
    """

    def __init__(
        self,
        num_samples: int = 16384,
        batch_size: int = 32,
        seed: int = 0,
        num_val_samples: int = 1024,
        vocab_size: int = 128,
        min_length: int = 4,
        max_length: int = 39,
        rules: int = 16,
    ) -> None:
        super().__init__()
        require_int("num_samples", num_samples, 1)
        require_int("batch_size", batch_size, 1)
        require_int("num_val_samples", num_val_samples, 1)
        self.save_hyperparameters()
        self._corpus: SyntheticTokenSequences | None = None

    def _data(self) -> SyntheticTokenSequences:
        if self._corpus is None:
            h = self.hparams
            self._corpus = SyntheticTokenSequences(
                h.num_samples + h.num_val_samples, vocab_size=h.vocab_size, min_length=h.min_length,
                max_length=h.max_length, rules=h.rules, seed=h.seed,
            )  # fmt: skip
        return self._corpus

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        h = self.hparams
        train = Subset(self._data(), range(h.num_samples))
        return DataLoader(train, batch_size=h.batch_size, shuffle=True, collate_fn=pad_sequences)

    @override
    def val_dataloader(self) -> DataLoader[Any]:
        h = self.hparams
        validation = Subset(self._data(), range(h.num_samples, h.num_samples + h.num_val_samples))
        return DataLoader(validation, batch_size=256, collate_fn=pad_sequences)
