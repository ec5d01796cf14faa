"""Streaming datasets under Lightning: LitData, per-rank sizes, DataLoader workers, exact as one process."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import LITDATA_CHUNK as CHUNK
from tests.conftest import LITDATA_SAMPLES as SAMPLES
from tests.distributed.conftest import run_job

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(("world_size", "loader"), [(2, "torch"), (3, "litdata")])
def test_a_litdata_dataset_trains_exactly_as_one_process_with_sizes_uneven_and_changing(
    litdata_dir, tmp_path, job_helpers, world_size, loader
):
    run_job("streaming_job.py", world_size, litdata_dir, tmp_path, loader, cwd=tmp_path)
    ranks = [torch.load(tmp_path / f"full-rank{r}.pt") for r in range(world_size)]
    assert {rank["chunks"] for rank in ranks} == {(SAMPLES + CHUNK - 1) // CHUNK}  # read by whole chunks
    for epoch in range(2):
        seen = [i for rank in ranks for e, _, indices in rank["steps"] if e == epoch for i in indices]
        assert sorted(seen) == list(range(SAMPLES))  # every sample once per epoch
    expected, _ = job_helpers.reference_training([rank["steps"] for rank in ranks], SAMPLES, "sgd", 1)
    for rank in ranks:
        worst = max((rank["params"][k] - expected[k]).abs().max().item() for k in expected)
        assert worst <= 1e-6, f"max abs difference {worst}"


def test_a_litdata_job_saved_mid_epoch_on_three_ranks_resumes_on_two_losing_and_repeating_nothing(
    litdata_dir, tmp_path, job_helpers
):
    run_job("streaming_job.py", 3, litdata_dir, tmp_path, "litdata", "save", cwd=tmp_path)
    run_job("streaming_job.py", 2, litdata_dir, tmp_path, "torch", "resume", cwd=tmp_path)
    runs = [[torch.load(tmp_path / f"{mode}-rank{r}.pt") for r in range(n)] for mode, n in (("save", 3), ("resume", 2))]
    global_steps = []
    for ranks in runs:
        for k, (epoch, batch_idx, _) in enumerate(ranks[0]["steps"]):
            global_steps.append((epoch, batch_idx, [i for rank in ranks for i in rank["steps"][k][2]]))
    assert len(runs[0][0]["steps"]) == 5
    for epoch in range(2):
        seen = [i for e, _, indices in global_steps if e == epoch for i in indices]
        assert sorted(seen) == list(range(SAMPLES))  # the saved and the resumed ranks together: each sample once
    expected, _ = job_helpers.train_one_process(global_steps, SAMPLES, "sgd")
    for rank in runs[1]:
        worst = max((rank["params"][k] - expected[k]).abs().max().item() for k in expected)
        assert worst <= 1e-6, f"max abs difference {worst}"
