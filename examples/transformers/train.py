"""A Hugging Face causal language model built from a config (no weights downloaded), trained with per-rank batch
sizes and gradients weighted by tokens, all from a YAML config:

    python examples/transformers/train.py fit --config examples/transformers/causal_lm.yaml

The data are generated token sequences of varying length (:class:`~lightning_dynamix.data.language.
SyntheticTokenSequences`), padded per batch; the model's loss is the mean over the tokens its labels do not
ignore, and ``count_items`` (``LabelTokens`` in the config) makes the all-reduced gradient that of one process
on the whole global batch. Needs the ``transformers`` extra.
"""

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, random_split

import lightning_dynamix  # noqa: F401  registers the "heterogeneous_ddp" strategy name
from lightning_dynamix.data.language import SyntheticTokenSequences, pad_sequences


class CausalLM(LightningModule):
    """``transformers``' ``LlamaForCausalLM`` from a small ``LlamaConfig`` (random weights)."""

    def __init__(
        self, vocab_size: int = 64, hidden_size: int = 64, layers: int = 2, heads: int = 4, lr: float = 3e-3
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
            max_position_embeddings=128,
        )  # fmt: skip
        self.model = LlamaForCausalLM(config)

    def _loss(self, batch):
        return self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        ).loss

    def training_step(self, batch, batch_idx):
        return self._loss(batch)  # the mean over the batch's tokens not ignored

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class TokenSequences(LightningDataModule):
    def __init__(self, num_samples: int = 2048, vocab_size: int = 64, max_length: int = 39, batch_size: int = 16):
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        h = self.hparams
        data = SyntheticTokenSequences(h.num_samples, vocab_size=h.vocab_size, max_length=h.max_length)
        self.train_set, self.val_set = random_split(data, [0.9, 0.1], generator=torch.Generator().manual_seed(0))

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, collate_fn=pad_sequences)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, collate_fn=pad_sequences)


if __name__ == "__main__":
    LightningCLI(CausalLM, TokenSequences)
