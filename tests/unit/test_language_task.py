"""The benches' language model (``--architecture causal-lm``): a causal transformer that ignores padding, trained on
the token-mean loss over generated sequences it can learn."""

from __future__ import annotations

import pytest
import torch

from lightning_dynamix.data.language import IGNORE_INDEX, SyntheticTokenSequences, pad_sequences
from lightning_dynamix.data.language_task import (
    CausalLanguageTask,
    CausalTransformer,
    TokenSequenceDataModule,
    token_loss,
)


def test_a_position_sees_neither_later_tokens_nor_padding():
    torch.manual_seed(0)
    model = CausalTransformer(vocab_size=16, width=8, depth=1).double().eval()
    ids = torch.tensor([[3, 5, 7, 9]])
    alone = model(ids, torch.ones_like(ids))
    later = model(torch.tensor([[3, 5, 2, 2]]), torch.ones_like(ids))
    assert torch.allclose(alone[0, :2], later[0, :2])  # causal: positions 0-1 do not see 2-3
    padded = model(torch.tensor([[3, 5, 7, 9, 0, 0]]), torch.tensor([[1, 1, 1, 1, 0, 0]]))
    assert torch.allclose(alone, padded[:, :4])  # padding changes nothing for the real tokens


def test_the_loss_is_the_mean_over_the_tokens_the_labels_do_not_ignore():
    batch = pad_sequences([SyntheticTokenSequences(4, seed=1)[i] for i in range(4)])
    logits = torch.randn(*batch["input_ids"].shape, 128, dtype=torch.float64)
    counted = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    assert token_loss(logits, batch["labels"]) == pytest.approx(token_loss(logits, batch["labels"], "sum") / counted)


def test_the_task_learns_the_sequences_rules_and_validates_loss_and_accuracy_by_token():
    from lightning.pytorch import Trainer

    torch.manual_seed(0)  # the training order
    data = TokenSequenceDataModule(num_samples=512, batch_size=16, num_val_samples=64, seed=3)
    task = CausalLanguageTask(hidden=32, depth=1, lr=0.01)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    before = trainer.validate(task, datamodule=data, verbose=False)[0]
    trainer.fit(task, datamodule=data)
    after = trainer.callback_metrics
    assert before["val_loss"] == pytest.approx(torch.log(torch.tensor(128.0)).item(), rel=0.15)  # uniform at first
    assert after["val_loss"] < before["val_loss"] - 1.5
    assert after["val_acc"] > before["val_acc"] + 0.2


def test_bad_arguments_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"`hidden` \(30\) must be a multiple of 4"):
        CausalLanguageTask(hidden=30)
    with pytest.raises(ValueError, match="`optimizer` must be 'sgd' or 'adam'"):
        CausalLanguageTask(optimizer="lion")
    with pytest.raises(ValueError, match="`num_val_samples`"):
        TokenSequenceDataModule(num_val_samples=0)
