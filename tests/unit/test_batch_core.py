"""The per-rank batch core both front ends hold: one set of checks, one training loader, one weighting."""

from __future__ import annotations

import inspect

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynamix.batch_core import PerRankBatchCore
from lightning_dynamix.data import HeterogeneousDataLoader
from lightning_dynamix.integrations.accelerate import DynamixAccelerate
from lightning_dynamix.strategies import HeterogeneousDDPStrategy


def _dataset(n: int = 40) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float64).unsqueeze(1))


def test_both_front_ends_hold_the_core_and_read_their_bounds_from_it():
    strategy = HeterogeneousDDPStrategy(batch_sizes=[3, 5], min_batch_size=0, max_batch_size=9)
    assert isinstance(strategy.batch_core, PerRankBatchCore)
    assert (strategy.min_batch_size, strategy.least_batch_size, strategy.max_batch_size) == (0, 1, 9)
    strategy.resume_weights = lambda: [1.0, 2.0]  # DynamixCallback sets it: the core resumes with it
    assert strategy.batch_core.resume_weights() == [1.0, 2.0]
    with pytest.raises(AttributeError, match="`min_batch_size` is read-only"):
        strategy.min_batch_size = 4
    for name in ("min_batch_size", "least_batch_size", "max_batch_size", "resume_weights", "loss_reduction"):
        for front_end in (DynamixAccelerate, HeterogeneousDDPStrategy):
            assert inspect.getattr_static(front_end, name).holder == "batch_core"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_sizes": [3, "4"]}, r"`batch_sizes` must hold ints >= 0"),
        ({"batch_sizes": [0, 4]}, r"min_batch_size=0 lets a rank sit steps out"),
        ({"batch_sizes": [3, 40], "max_batch_size": 32}, r"\[1, 32\]"),
        ({"min_batch_size": 8, "max_batch_size": 4}, r"`max_batch_size` must be None or an int >= min_batch_size"),
        ({"batch_sizes": [3, 40], "batch_size_caps": [None, 16]}, r"more samples than their caps \[None, 16\]"),
        ({"batch_size_caps": [0, None]}, r"`batch_size_caps\[0\]` must be an int >= 1"),
        ({"loss_reduction": "avg"}, r"`loss_reduction` must be 'mean'"),
        ({"seed": 1.5}, r"`seed` must be an int"),
    ],
)
def test_bad_arguments_are_refused_at_construction_with_one_wording(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PerRankBatchCore("Owner", **kwargs)
    with pytest.raises(ValueError, match=message):  # the strategy raises what the core raises
        HeterogeneousDDPStrategy(**kwargs)


def test_caps_for_another_number_of_ranks_are_a_set_up_error_of_the_front_end_s_kind():
    core = PerRankBatchCore("Owner", batch_size_caps=[8, None, 4], setup_error=MisconfigurationException)
    with pytest.raises(MisconfigurationException, match=r"gives 3 ranks a cap, but the job has 2"):
        core.check_world_size(2)
    with pytest.raises(ValueError, match=r"gives 3 processes a cap, but the job has 2"):
        PerRankBatchCore("Owner", batch_size_caps=[8, None, 4], world_size=2, rank_word="process")


def test_a_batch_norm_model_raises_the_least_size_and_refuses_a_smaller_one_naming_the_layer():
    model = nn.Sequential(nn.Linear(1, 4), nn.BatchNorm1d(4))
    core = PerRankBatchCore("Owner", min_batch_size=0)
    core.fit_model(model, world_size=2)
    assert (core.min_batch_size, core.least_batch_size) == (0, 2)
    assert "1 (BatchNorm1d)" in core.least_reason
    with pytest.raises(ValueError, match=r"at least 2 samples.*1 \(BatchNorm1d\)"):
        core.validate([1, 4])
    with pytest.raises(ValueError, match=r"Owner\(min_batch_size=1\) is too small"):
        PerRankBatchCore("Owner", min_batch_size=1).fit_model(model, world_size=2)


def test_the_training_loader_splits_sizes_nobody_chose_within_the_caps():
    core = PerRankBatchCore("Owner", batch_size_caps=[4, None])
    loader = core.training_loader(DataLoader(_dataset(), batch_size=8), rank=0, world_size=2, instead="")
    assert isinstance(loader, HeterogeneousDataLoader)
    assert core.batch_sizes == (4, 12)  # the same 16 a step, within rank 0's cap
    assert core.loader is loader
    chosen = PerRankBatchCore("Owner", batch_sizes=[6, 2], batch_size_caps=[8, None])
    chosen.training_loader(DataLoader(_dataset(), batch_size=8), rank=1, world_size=2, instead="")
    assert chosen.batch_sizes == (6, 2)


def test_a_loader_it_cannot_rebuild_is_a_set_up_error_saying_what_to_do_instead():
    core = PerRankBatchCore("Owner", setup_error=MisconfigurationException)
    loader = DataLoader(_dataset(), batch_size=4, sampler=list(range(40)))
    with pytest.raises(MisconfigurationException, match=r"custom sampler.*Owner draws.*Do this instead"):
        core.training_loader(loader, rank=0, world_size=2, instead="Do this instead.")


def test_the_weights_of_one_backward_make_the_summed_gradient_the_global_mean():
    # two ranks' cores on one machine: each weights its own mean loss; their sum is the mean over 3 + 5 samples
    data = torch.arange(16, dtype=torch.float64).unsqueeze(1) / 10
    weight = torch.ones(1, dtype=torch.float64, requires_grad=True)
    summed = torch.zeros(1, dtype=torch.float64)
    for rank in (0, 1):
        core = PerRankBatchCore("Owner", batch_sizes=[3, 5], shuffle=False)
        loader = core.training_loader(DataLoader(TensorDataset(data), batch_size=1), rank, 2, instead="")
        (batch,) = next(iter(loader))
        loss = ((batch * weight) ** 2).mean()
        core.weight_backward(loss, loss_scale=1.0, window_end=None, syncing=True)
        loss.backward()
        summed += weight.grad
        weight.grad = None
        assert core.hook_state.weight == 1.0  # the window was as planned: no correction in the hook
        core.end_window()
    global_batch = data[:8]
    expected = torch.autograd.grad(((global_batch * weight) ** 2).mean(), weight)[0]
    torch.testing.assert_close(summed, expected, rtol=0, atol=1e-15)
