"""The private parts of other libraries the package relies on exist in the installed versions, and a missing one
fails with a message naming it and the versions tested."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dynamix import _compat


def test_every_private_part_exists_in_the_installed_versions():
    from lightning.pytorch import Trainer
    from lightning.pytorch.trainer.states import RunningStage

    assert _compat.parse_num_batches(RunningStage.TRAINING, 10, 0.5) == 5
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    assert _compat.training_dataloaders(trainer) is None  # before a fit
    assert _compat.logged_results(trainer) is None
    assert len(_compat.result_metric_types()) == 3
    _compat.reset_rpc_counters()
    assert callable(_compat._attribute(torch.cuda, "_sleep", "torch", "spin"))  # what cuda_sleep calls, CPU builds too
    found = torch.zeros(())
    _compat.non_finite_check([torch.ones(3), torch.tensor([1.0, float("inf")])], found)
    assert found.item() > 0


def test_a_private_part_a_version_lacks_is_an_error_naming_it_and_the_versions_tested():
    expected = r"`Linear\._has_rebuilt_buckets`.*tested with torch 2\.13"
    with pytest.raises(_compat.UnsupportedVersionError, match=expected):
        _compat.ddp_has_rebuilt_buckets(nn.Linear(2, 2))  # type: ignore[arg-type]
