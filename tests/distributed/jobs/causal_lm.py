"""A Hugging Face causal language model trained with uneven, changing per-rank sizes: the tasks of
``test_causal_lm.py``, run on every rank of a :class:`~tests.distributed.pool.RankPool`, and the one-process
reference they are compared with.

The model is ``transformers``' ``LlamaForCausalLM`` from a tiny ``LlamaConfig`` (random weights, float64), its loss
the mean over the tokens its labels do not ignore; the data :class:`SyntheticTokenSequences` of 4-39 tokens,
padded per batch by :func:`pad_sequences`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from common import quiet_trainer
from lightning.pytorch import Callback, LightningModule
from sit_out_sequences import StepResizer
from torch.utils.data import DataLoader

from lightning_dynamix import HeterogeneousDDPStrategy, LabelTokens
from lightning_dynamix.data.language import SyntheticTokenSequences, pad_sequences

VOCAB, LR = 32, 0.5


def make_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
    )  # fmt: skip
    return LlamaForCausalLM(config).double()


def dataset(num_samples: int) -> SyntheticTokenSequences:
    return SyntheticTokenSequences(num_samples, vocab_size=VOCAB, min_length=4, max_length=39, seed=3)


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _lm_loss(model, batch) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss


def accelerate(
    first: list[int], plan: list[tuple[int, list[int]]], accumulate: int, by_tokens: bool, num_samples: int,
    epochs: int, seed: int,
) -> dict:  # fmt: skip
    """``DynamixAccelerate`` from sizes ``first``; ``plan``: (batch, sizes) decided after that batch; a rank that
    sits a step out back-propagates ``zero_loss()``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from lightning_dynamix.integrations.accelerate import DynamixAccelerate

    AcceleratorState._reset_state()  # a new Accelerator per task in a process that keeps its process group
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    dynamix = DynamixAccelerate(
        accelerator, batch_sizes=first, min_batch_size=0, seed=seed, count_items=LabelTokens() if by_tokens else None
    )
    network = make_model()
    model, opt, loader = dynamix.prepare(
        network,
        torch.optim.SGD(network.parameters(), lr=LR),
        DataLoader(dataset(num_samples), batch_size=4, shuffle=True, collate_fn=pad_sequences),
    )
    decisions = dict((at, sizes) for at, sizes in plan)
    steps, batches, logged = [], 0, []
    for epoch in range(epochs):
        for step, batch in enumerate(loader):
            with accelerator.accumulate(model):
                if dynamix.sits_out:
                    steps.append((epoch, step, []))
                    loss = dynamix.zero_loss()
                    logged.append(dynamix.global_mean(None).item())
                else:
                    steps.append((epoch, step, batch["index"].tolist()))
                    loss = _lm_loss(model, batch)
                    logged.append(dynamix.global_mean(loss).item())
                dynamix.backward(loss)
                opt.step()
                opt.zero_grad()
            dynamix.step(loss)
            if batches in decisions:
                dynamix.set_batch_sizes(decisions[batches])
            batches += 1
    dist.barrier()  # every rank finished with the model before the next task builds another
    return {"steps": steps, "params": _params(network), "logged": logged}


class LanguageModel(LightningModule):
    def __init__(self, num_samples: int, log_loss: bool = False) -> None:
        super().__init__()
        self.model = make_model()
        self.num_samples = num_samples
        self.log_loss = log_loss
        self.steps: list[tuple[int, int, list[int]]] = []
        self.logged: list[float] = []

    def training_step(self, batch, batch_idx):
        self.steps.append((self.current_epoch, batch_idx, batch["index"].tolist()))
        loss = _lm_loss(self.model, batch)
        if self.log_loss:
            self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.log_loss:
            self.logged.append(float(self.trainer.callback_metrics["train_loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(dataset(self.num_samples), batch_size=4, shuffle=True, collate_fn=pad_sequences)


class Skipped(Callback):
    """Records a step a rank sat out (it runs no ``training_step``) as one with no samples."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.strategy.batch_core.sits_out:
            pl_module.steps.append((trainer.current_epoch, batch_idx, []))


def lightning(
    first: list[int], plan: list[tuple[int, list[int]]], accumulate: int, by_tokens: bool, num_samples: int,
    epochs: int, seed: int,
) -> dict:  # fmt: skip
    """``Trainer.fit`` with ``HeterogeneousDDPStrategy`` from sizes ``first``; ``plan`` as for :func:`accelerate`."""
    from datetime import timedelta

    strategy = HeterogeneousDDPStrategy(
        batch_sizes=first, min_batch_size=0, seed=seed, timeout=timedelta(seconds=60),
        count_items=LabelTokens() if by_tokens else None,
    )  # fmt: skip
    module = LanguageModel(num_samples)
    trainer = quiet_trainer(
        devices=len(first), strategy=strategy, accumulate_grad_batches=accumulate, max_epochs=epochs,
        callbacks=[StepResizer(plan), Skipped()], limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module)
    return {"steps": module.steps, "params": _params(module.model)}


def one_process(steps_by_rank, num_samples: int, accumulate: int) -> dict[str, torch.Tensor]:
    """One process trains on the concatenated global batches: an optimizer step per window of ``accumulate``
    batches (cut short at an epoch's end), on the mean over every token of the window's samples."""
    data = dataset(num_samples)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    lengths: dict[int, int] = {}
    for epoch, _, _ in steps_by_rank[0]:
        lengths[epoch] = lengths.get(epoch, 0) + 1
    window: list[int] = []
    for k, (epoch, batch_idx, _) in enumerate(steps_by_rank[0]):
        window.extend(i for rank in steps_by_rank for i in rank[k][2])
        if (batch_idx + 1) % accumulate == 0 or batch_idx + 1 == lengths[epoch]:
            opt.zero_grad()
            _lm_loss(model, pad_sequences([data[i] for i in window])).backward()
            opt.step()
            window = []
    return _params(model)


class PositionsSeen(Callback):
    """Records the token positions and padding of every batch a rank trains on."""

    def __init__(self) -> None:
        self.positions: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not trainer.strategy.batch_core.sits_out:
            self.positions.append((batch["labels"].numel(), int((batch["attention_mask"] == 0).sum())))


def measured(sizes: list[int], num_samples: int) -> dict:
    """``Trainer.fit`` with ``ClusterMetricsMonitor`` and ``count_items``: every rank's work and padding as gathered."""
    from datetime import timedelta

    from lightning_dynamix.callbacks import ClusterMetricsMonitor
    from lightning_dynamix.decisions import interval_metrics

    strategy = HeterogeneousDDPStrategy(batch_sizes=sizes, timeout=timedelta(seconds=60), count_items=LabelTokens())
    monitor = ClusterMetricsMonitor(interval=2, warmup_steps=0, gradient_noise_scale=False)
    seen = PositionsSeen()
    trainer = quiet_trainer(
        devices=len(sizes), strategy=strategy, max_epochs=1, callbacks=[monitor, seen], limit_val_batches=0
    )
    trainer.fit(LanguageModel(num_samples))
    states = [[(w.batch_size, w.work, w.padding) for w in record.state.workers] for record in monitor.history]
    logged = [interval_metrics(record)["dynamix/padding"] for record in monitor.history]  # what loggers are given
    return {"states": states, "positions": seen.positions, "logged": logged}


def logged_losses(first: list[int], plan: list[tuple[int, list[int]]], by_tokens: bool, num_samples: int) -> dict:
    """``Trainer.fit`` for one epoch with the loss logged by ``self.log(..., sync_dist=True)``: what it reported
    at every step, and the steps' samples."""
    from datetime import timedelta

    strategy = HeterogeneousDDPStrategy(
        batch_sizes=first, timeout=timedelta(seconds=60), count_items=LabelTokens() if by_tokens else None
    )
    module = LanguageModel(num_samples, log_loss=True)
    trainer = quiet_trainer(
        devices=len(first), strategy=strategy, max_epochs=1, callbacks=[StepResizer(plan)], limit_val_batches=0
    )
    trainer.fit(module)
    return {"steps": module.steps, "logged": module.logged}


def one_process_losses(steps_by_rank, num_samples: int) -> list[float]:
    """The token-mean loss of one process on each global batch, before the step's update (SGD, as the job)."""
    data = dataset(num_samples)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for k in range(len(steps_by_rank[0])):
        batch = pad_sequences([data[i] for rank in steps_by_rank for i in rank[k][2]])
        opt.zero_grad()
        loss = _lm_loss(model, batch)
        losses.append(loss.item())
        loss.backward()
        opt.step()
    return losses
