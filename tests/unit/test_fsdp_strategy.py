"""HeterogeneousFSDPStrategy in one process: its name, clear errors, a fit on one rank.

Several ranks (uneven sizes, a rank that sits out, accumulation, BatchNorm, a transformer block) are tested with real
process groups in tests/distributed/test_fsdp2.py.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynamix import DynamixCallback, HeterogeneousFSDPStrategy
from tests.unit.test_strategy import fit

pytestmark = pytest.mark.usefixtures("isolated_process_group")


class ShardedModel(LightningModule):
    """Two linear layers; ``shard``: ``fully_shard`` on the root too (``"root"``) or on the first alone."""

    def __init__(self, shard: str = "root", manual: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
        self.shard = shard
        self.automatic_optimization = not manual
        self.seen: list[int] = []

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net[0], mesh=mesh)
        if self.shard == "root":
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        index, x = batch
        self.seen.extend(index.tolist())
        loss = self.net(x).pow(2).mean()
        if not self.automatic_optimization:
            self.manual_backward(loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(40), torch.randn(40, 2)), batch_size=8)


def test_the_registered_name_trains_every_sample_once_with_the_dataloader_s_batch_size():
    model = ShardedModel()
    trainer = fit(model, "heterogeneous_fsdp", max_epochs=1)
    assert isinstance(trainer.strategy, HeterogeneousFSDPStrategy)
    assert trainer.strategy.batch_sizes == (8,)
    assert sorted(model.seen) == list(range(40))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_sizes": [-2]}, "`batch_sizes`.*ints >= 0"),
        ({"batch_sizes": [0, 4]}, r"min_batch_size=0 lets a rank sit steps out"),
        ({"min_batch_size": 0, "max_batch_size": 0}, "`max_batch_size`.*>= 1"),
        ({"loss_reduction": "avg"}, "`loss_reduction` must be 'mean'"),
    ],
)
def test_bad_arguments_are_refused_at_construction_as_the_ddp_strategy_refuses_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HeterogeneousFSDPStrategy(**kwargs)


def test_a_model_with_parameters_fully_shard_does_not_hold_is_refused_naming_them():
    with pytest.raises(
        MisconfigurationException, match=r"has 2 trained parameter\(s\) no fully_shard holds \(net.2.weight"
    ):
        fit(ShardedModel(shard="first"), HeterogeneousFSDPStrategy(), max_epochs=1)


def test_manual_optimisation_is_refused_naming_what_to_use_instead():
    with pytest.raises(MisconfigurationException, match=r"needs automatic optimisation.*HeterogeneousDDPStrategy"):
        fit(ShardedModel(manual=True), HeterogeneousFSDPStrategy(), max_epochs=1)


def test_caps_that_cannot_hold_the_global_batch_are_refused_naming_them():
    # (caps that bound a controller's split on two ranks: tests/distributed/test_fsdp2.py)
    with pytest.raises(ValueError, match=r"largest batch sizes \[3\] hold 3 samples, fewer than the global batch of 8"):
        fit(ShardedModel(), HeterogeneousFSDPStrategy(batch_size_caps=[3]), max_epochs=1)


def test_sync_batchnorm_is_refused_naming_the_conversion_to_make_in_configure_model():
    with pytest.raises(MisconfigurationException, match="convert the model's BatchNorm layers in configure_model"):
        fit(ShardedModel(), HeterogeneousFSDPStrategy(), max_epochs=1, sync_batchnorm=True)


def test_the_callback_drives_the_sharded_strategy_and_says_it_measures_no_noise_scale():
    model = ShardedModel()
    callback = DynamixCallback(controller="pid", interval=2, warmup_steps=1, gradient_noise_scale=True)
    with pytest.warns(UserWarning, match="measures no gradient noise scale"):
        trainer = fit(model, HeterogeneousFSDPStrategy(batch_sizes=[4]), max_epochs=2, callbacks=[callback])
    assert len(callback.history) >= 2  # it gathered the cluster's state: the step clock ran under FSDP2
    assert sorted(model.seen) == sorted(list(range(40)) * 2)
    assert trainer.strategy.step_clock is not None
