"""Batch-dependent layers: the least size a model needs, its enforcement everywhere a size is chosen, and
GlobalBatchNorm outside a process group (the multi-process exactness is in tests/distributed/test_batch_norm.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynamix import HeterogeneousDDPStrategy
from lightning_dynamix.control.allocation import respect_least_batch_size
from lightning_dynamix.data.schedule import EpochSchedule
from lightning_dynamix.decisions import DecisionMaker
from lightning_dynamix.distributed.batch_norm import (
    GlobalBatchNorm,
    convert_batch_norm,
    least_batch_size,
    revert_batch_norm,
)
from lightning_dynamix.metrics.state import ClusterState, WorkerMetrics


class Declares(nn.Module):
    def __init__(self, need: object) -> None:
        super().__init__()
        self.min_samples_per_rank = need


def test_every_batch_norm_needs_two_samples_per_rank_and_the_layers_are_named():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Sequential(nn.BatchNorm2d(4), nn.SyncBatchNorm(4)))
    assert least_batch_size(model) == (2, ["1 (BatchNorm1d)", "2.0 (BatchNorm2d)", "2.1 (SyncBatchNorm)"])
    assert least_batch_size(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.GroupNorm(2, 4))) == (1, [])
    assert least_batch_size(convert_batch_norm(model), world_size=2) == (1, [])  # global statistics: any split
    assert least_batch_size(model, world_size=1)[0] == 2  # one rank: its batch is the global one
    assert least_batch_size(nn.Sequential(nn.BatchNorm3d(2), Declares(4))) == (4, ["1 (Declares)"])
    with pytest.raises(ValueError, match=r"`min_samples_per_rank` of layer 0 \(Declares\) must be an int >= 1.*0"):
        least_batch_size(nn.Sequential(Declares(0)))


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("shape", [(6, 4), (6, 4, 5), (6, 4, 3, 3)])
def test_global_batch_norm_is_torch_s_batch_norm_in_one_process(shape, momentum):
    torch.manual_seed(0)
    plain = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d}[len(shape)](4, momentum=momentum).double()
    ours = convert_batch_norm(nn.Sequential(plain)).double()
    reference = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d}[len(shape)](4, momentum=momentum).double()
    assert isinstance(ours[0], GlobalBatchNorm)
    for _ in range(3):
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        torch.testing.assert_close(ours(x), reference(x))
    ours.eval(), reference.eval()
    torch.testing.assert_close(ours(x), reference(x))
    for (name, a), (_, b) in zip(ours[0].state_dict().items(), reference.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_convert_and_revert_keep_the_parameters_statistics_and_settings():
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.BatchNorm1d(4, eps=1e-3, affine=True)), nn.BatchNorm2d(2))
    weight, running = model[1][0].weight, model[1][0].running_mean
    converted = convert_batch_norm(model)
    layer = converted[1][0]
    assert type(layer) is GlobalBatchNorm
    assert layer.weight is weight
    assert layer.running_mean is running
    assert layer.eps == 1e-3
    assert type(converted[2]) is GlobalBatchNorm
    reverted = revert_batch_norm(converted)
    assert type(reverted[1][0]) is nn.BatchNorm1d
    assert type(reverted[2]) is nn.BatchNorm2d
    assert reverted[1][0].weight is weight
    assert reverted[1][0].running_mean is running


@pytest.mark.parametrize(
    ("sizes", "least", "upper", "expected"),
    [
        ((31, 1), 2, None, (30, 2)),
        ((40, 0, 1), 2, None, (39, 0, 2)),
        ((30, 1, 1), 4, None, (32, 0, 0)),
        ((16, 16), 2, None, (16, 16)),
        ((3, 3, 1), 2, 3, (3, 2, 2)),  # within the upper bound
        ((1, 1), 3, None, (2, 0)),  # every rank below half of the least: the largest trains alone
    ],
)
def test_a_size_below_the_least_becomes_zero_or_the_least_and_the_total_is_kept(sizes, least, upper, expected):
    assert respect_least_batch_size(sizes, least, upper) == expected


class Split:
    """A controller that always decides one split."""

    uses_measurements = False

    def __init__(self, sizes):
        self.sizes = sizes

    def decide(self, state):
        from lightning_dynamix.control import Decision

        return Decision(tuple(self.sizes))

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def state(sizes, least, low=0):
    workers = tuple(
        WorkerMetrics(r, b, step_time=0.1, compute_time=0.05, data_time=0.0, sync_wait=0.01)
        for r, b in enumerate(sizes)
    )
    return ClusterState(workers, min_batch_size=low, least_batch_size=least)


@pytest.mark.parametrize("decided", [(31, 1), (1, 31)])
def test_no_controller_decision_gives_a_rank_fewer_samples_than_the_model_needs(decided):
    maker = DecisionMaker(Split(decided), "split", "none", "test")
    assert sorted(maker.propose(state((16, 16), least=2), (16, 16)).batch_sizes) == [2, 30]
    assert maker.propose(state((16, 16), least=1), (16, 16)).batch_sizes == decided


@pytest.mark.parametrize("num_samples", range(32, 80))
@pytest.mark.parametrize("sizes", [(16, 16), (30, 2), (20, 0, 3)])
def test_an_epoch_s_final_step_never_gives_a_training_rank_fewer_than_the_least(num_samples, sizes):
    schedule = EpochSchedule(num_samples, sizes, least_batch_size=2)
    steps = [schedule.batch_sizes_at(k) for k in range(len(schedule))]
    assert sum(map(sum, steps)) == num_samples  # every sample once
    assert all(b == 0 or b >= 2 for s in steps for b in s)
    assert all((b == 0) == (n == 0) for s in steps for b, n in zip(s, sizes))  # a rank out stays out


def test_a_schedule_refuses_a_size_below_the_least():
    with pytest.raises(
        ValueError, match=r"`batch_sizes` must give every rank that trains at least 2 samples.*\[5, 1\]"
    ):
        EpochSchedule(40, (5, 1), least_batch_size=2)


class BatchNormTask(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(21, 3), torch.randn(21, 1)), batch_size=4)


def fit(strategy, **kwargs):
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(BatchNormTask())
    return trainer


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_batch_size": 1}, r"min_batch_size=1\) is too small: layer net.1 \(BatchNorm1d\).*at least 2 samples"),
        (
            {"batch_sizes": [1]},
            r"`batch_sizes` must give every rank that trains at least 2.*\[1\].*net.1 \(BatchNorm1d\)",
        ),
        ({"batch_sizes": [1], "min_batch_size": 0}, r"at least 2 samples.*\[1\].*net.1 \(BatchNorm1d\)"),
    ],
)
def test_a_size_the_model_s_batch_norm_cannot_train_is_refused_at_set_up_naming_the_layer(kwargs, message):
    with pytest.raises(MisconfigurationException, match=message):
        fit(HeterogeneousDDPStrategy(**kwargs))


def test_the_smallest_size_rises_to_what_batch_norm_needs_and_sync_batchnorm_lowers_it_again(caplog):
    strategy = HeterogeneousDDPStrategy()
    with caplog.at_level("INFO", logger="lightning_dynamix"):
        trainer = fit(strategy)
    assert (strategy.min_batch_size, strategy.least_batch_size) == (2, 2)
    assert "every rank that trains gets at least 2 samples per step: layer net.1 (BatchNorm1d)" in caplog.text
    # 21 samples in steps of 4: a sixth step would hold 1 sample; the fifth takes 5 instead
    assert trainer.num_training_batches == 5
    assert strategy.train_batch_sampler.least_batch_size == 2
    sitting = HeterogeneousDDPStrategy(min_batch_size=0)
    fit(sitting)
    assert (sitting.min_batch_size, sitting.least_batch_size) == (0, 2)
    synchronised = HeterogeneousDDPStrategy()
    fit(synchronised, sync_batchnorm=True)
    assert (synchronised.min_batch_size, synchronised.least_batch_size) == (2, 2)  # one rank: its batch is global
