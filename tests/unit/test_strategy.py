"""HeterogeneousDDPStrategy in one process: configuration, clear errors, epoch length after resizes.

Multi-rank behaviour is tested with real process groups in tests/distributed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

from lightning_dynamix import HeterogeneousBatchSampler, HeterogeneousDataLoader, HeterogeneousDDPStrategy

pytestmark = pytest.mark.usefixtures("isolated_process_group")


class Model(LightningModule):
    def __init__(self, dataloader=None, num_samples=64, batch_size=8):
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.dataloader = dataloader
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seen: list[int] = []
        self.validations = 0
        self.val_x = torch.randn(8, 2)

    def training_step(self, batch, batch_idx):
        index, x = batch
        self.seen.extend(index.tolist())
        return self.layer(x).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val", self.layer(batch[1]).mean())

    def on_validation_epoch_end(self):
        self.validations += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        if self.dataloader is not None:
            return self.dataloader
        data = TensorDataset(torch.arange(self.num_samples), torch.randn(self.num_samples, 2))
        return DataLoader(data, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(8), self.val_x), batch_size=4)


def fit(model, strategy, **kwargs):
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )
    trainer.fit(model)
    return trainer


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_sizes": [-2]}, "`batch_sizes`.*ints >= 0"),
        ({"batch_sizes": [0, 4]}, r"`batch_sizes`.*\[1, inf\].*min_batch_size=0 lets a rank sit steps out"),
        ({"batch_sizes": [0, 0], "min_batch_size": 0}, "`batch_sizes` gives every rank 0 samples"),
        ({"min_batch_size": 0, "max_batch_size": 0}, "`max_batch_size`.*>= 1"),
        ({"batch_sizes": [4, 40], "max_batch_size": 32}, r"`batch_sizes`.*\[1, 32\].*\[4, 40\]"),
        ({"batch_sizes": [2], "min_batch_size": 3}, r"`batch_sizes`.*\[3, inf\]"),
        ({"min_batch_size": -1}, "`min_batch_size`.*-1"),
        ({"min_batch_size": 4, "max_batch_size": 2}, "`max_batch_size`.*>= min_batch_size"),
        ({"loss_reduction": "avg"}, "`loss_reduction`.*'avg'"),
        ({"seed": "1"}, "`seed`"),
        ({"ddp_comm_hook": lambda state, bucket: None}, "`ddp_comm_hook` is not supported"),
        ({"model_averaging_period": 4}, "`model_averaging_period` is not supported"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HeterogeneousDDPStrategy(**kwargs)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter([(torch.tensor(0), torch.zeros(2))])


@pytest.mark.parametrize(
    ("strategy_kwargs", "dataloader", "message"),
    [
        ({"batch_sizes": [4, 4]}, None, "world size is 1, got 2 sizes"),
        ({"batch_sizes": [100]}, None, "64 samples, fewer than one global batch"),
        ({}, DataLoader(_Stream(), batch_size=2), "iterable-style"),
        (
            {},
            DataLoader(
                TensorDataset(torch.arange(16), torch.randn(16, 2)),
                batch_size=4,
                sampler=WeightedRandomSampler(torch.ones(16), 16),
            ),
            "custom sampler",
        ),
        ({}, [DataLoader(TensorDataset(torch.arange(8), torch.randn(8, 2)))] * 2, "one training DataLoader"),
    ],
)
def test_bad_training_data_raises_at_setup(strategy_kwargs, dataloader, message):
    with pytest.raises(MisconfigurationException, match=message):
        fit(Model(dataloader), HeterogeneousDDPStrategy(**strategy_kwargs), max_steps=2)


def test_registered_name_and_dataloader_batch_size_are_used():
    model = Model(batch_size=8)
    trainer = fit(model, "heterogeneous_ddp", max_epochs=1)
    assert isinstance(trainer.strategy, HeterogeneousDDPStrategy)
    assert trainer.strategy.batch_sizes == (8,)
    assert sorted(model.seen) == list(range(64))


class ResizeOnce(Callback):
    def __init__(self, at_batch, sizes):
        self.at_batch, self.sizes = at_batch, sizes
        self.applied_from = None
        self.epoch_lengths_at_start: list[int] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.epoch_lengths_at_start.append(trainer.num_training_batches)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # what callbacks read: the real size of the batch just trained, and the sampler behind it
        assert trainer.strategy.current_batch_sizes == (len(batch[0]),)
        assert trainer.strategy.train_batch_sampler.batch_sizes_at(batch_idx) == (len(batch[0]),)
        if trainer.current_epoch == 0 and batch_idx == self.at_batch:
            self.applied_from = trainer.strategy.set_batch_sizes(self.sizes)


@pytest.mark.parametrize(("sizes", "expected_steps"), [([4], 2 + 12), ([16], 2 + 3)])
def test_resizing_mid_epoch_changes_the_epoch_length_lightning_runs(sizes, expected_steps):
    """Smaller batches make the epoch longer, larger ones shorter: no sample is lost or repeated and
    validation still runs once, at the end of each epoch."""
    model = Model(num_samples=64, batch_size=8)
    resize = ResizeOnce(at_batch=1, sizes=sizes)
    trainer = fit(model, HeterogeneousDDPStrategy(), max_epochs=2, callbacks=[resize])
    assert resize.applied_from == 2
    first_epoch = model.seen[: len(model.seen) - 64]
    assert sorted(first_epoch) == list(range(64))
    assert trainer.global_step == expected_steps + 64 // sizes[0]
    assert model.validations == 2
    # what the progress bar and callbacks read at the start of each epoch
    assert resize.epoch_lengths_at_start == [8, 64 // sizes[0]]


def test_sizes_set_before_training_are_the_initial_sizes():
    strategy = HeterogeneousDDPStrategy()
    assert strategy.set_batch_sizes([5]) is None
    model = Model(num_samples=20, batch_size=8)
    fit(model, strategy, max_epochs=1)
    assert strategy.batch_sizes == (5,)
    assert sorted(model.seen) == list(range(20))


def test_set_batch_sizes_checks_the_sizes_against_the_bounds_and_world_size():
    strategy = HeterogeneousDDPStrategy(max_batch_size=8)
    with pytest.raises(ValueError, match=r"\[1, 8\]"):
        strategy.set_batch_sizes([9])

    class TryBadSizes(Callback):
        def on_train_batch_end(self, trainer, *args):
            with pytest.raises(ValueError, match="world size is 1"):
                trainer.strategy.set_batch_sizes([2, 2])
            trainer.should_stop = True

    fit(Model(), strategy, max_epochs=1, callbacks=[TryBadSizes()])


def test_loss_logged_in_training_step_with_one_rank_is_unchanged():
    class Logged(Model):
        def training_step(self, batch, batch_idx):
            loss = F.mse_loss(self.layer(batch[1]), torch.zeros(len(batch[0]), 1))
            self.log("loss", loss, sync_dist=True, on_step=True)
            self.last = float(loss.detach())
            return loss

    model = Logged()
    trainer = fit(model, HeterogeneousDDPStrategy(), max_steps=3)
    assert float(trainer.callback_metrics["loss"]) == pytest.approx(model.last)


def test_validate_and_test_dataloaders_keep_working_with_the_strategy():
    class Evaluated(Model):
        def test_step(self, batch, batch_idx):
            self.log("test_value", self.layer(batch[1]).mean())

        def test_dataloader(self):
            return self.val_dataloader()

    model = Evaluated()
    trainer = fit(model, HeterogeneousDDPStrategy(), max_epochs=1)
    assert model.validations == 1
    assert trainer.validate(model, verbose=False)[0]["val"] == pytest.approx(float(model.layer(model.val_x).mean()))
    assert "test_value" in trainer.test(model, verbose=False)[0]


def test_a_heterogeneous_dataloader_of_the_users_own_is_used_as_given():
    data = TensorDataset(torch.arange(30), torch.randn(30, 2))
    sampler = HeterogeneousBatchSampler(data, [5], rank=0, world_size=1, seed=3)
    loader = HeterogeneousDataLoader(data, sampler)
    model = Model(loader)
    trainer = fit(model, HeterogeneousDDPStrategy(), max_epochs=1, use_distributed_sampler=False)
    assert trainer.strategy.train_batch_sampler is sampler
    assert trainer.strategy.batch_sizes == (5,)
    assert model.seen == sampler.sampler.indices(0, 30)  # the user's seed decided the order


def test_a_users_sampler_for_another_rank_layout_is_refused():
    data = TensorDataset(torch.arange(30), torch.randn(30, 2))
    sampler = HeterogeneousBatchSampler(data, [5, 5], rank=1, world_size=2)
    with pytest.raises(MisconfigurationException, match="rank 1 of 2, but this process is rank 0 of 1"):
        fit(
            Model(HeterogeneousDataLoader(data, sampler)),
            HeterogeneousDDPStrategy(),
            max_steps=1,
            use_distributed_sampler=False,
        )


def test_ranks_that_may_sit_out_need_automatic_optimisation():
    class Manual(Model):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            self.optimizers().step()

    with pytest.raises(MisconfigurationException, match=r"min_batch_size=0\) needs automatic optimisation"):
        fit(Manual(), HeterogeneousDDPStrategy(min_batch_size=0), max_steps=2)


def test_nccl_on_a_cpu_rank_is_refused_before_the_process_group_naming_gloo():
    # a job mixing GPU and CPU ranks: the CPU rank says what to use instead of failing at its first collective
    strategy = HeterogeneousDDPStrategy(process_group_backend="nccl")
    with pytest.raises(MisconfigurationException, match=r"rank 0, which trains on cpu.*process_group_backend='gloo'"):
        fit(Model(), strategy, max_steps=1)
    assert not torch.distributed.is_initialized()
