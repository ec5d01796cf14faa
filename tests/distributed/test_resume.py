"""Real 2-process runs interrupted by a checkpoint continue exactly as if never interrupted.

The size decisions of the run (one decided before the mid-epoch checkpoint but applying after
it, one applying from the next epoch) must survive the checkpoint, with and without DataLoader
workers prefetching ahead.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.distributed

NUM_SAMPLES = 150


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, pools):
    """The jobs without and with DataLoader workers, on the session's pool of 2 ranks; each one's output folder."""
    outs = {workers: tmp_path_factory.mktemp(f"resume-{workers}") for workers in (0, 2)}
    for workers, out in outs.items():
        pools(2).run_script("resume_job.py", workers, out, cwd=out)
    return outs


@pytest.fixture(scope="module", params=[0, 2], ids=["workers-0", "workers-2"])
def runs(request, jobs):
    out = jobs[request.param]
    return {
        name: [torch.load(out / f"{name}-rank{r}.pt") for r in range(2)]
        for name in ("full", "mid1", "mid2", "end1", "end2")
    }


@pytest.mark.parametrize("checkpoint", ["mid", "end"])
def test_resumed_run_trains_on_exactly_the_batches_of_the_uninterrupted_run(runs, checkpoint):
    for rank in range(2):
        before, after = runs[f"{checkpoint}1"][rank]["steps"], runs[f"{checkpoint}2"][rank]["steps"]
        assert before
        assert after
        assert before + after == runs["full"][rank]["steps"]


@pytest.mark.parametrize("checkpoint", ["mid", "end"])
def test_resumed_run_ends_with_the_same_parameters(runs, checkpoint):
    full = runs["full"][0]["params"]
    for rank in range(2):
        resumed = runs[f"{checkpoint}2"][rank]["params"]
        assert max((resumed[k] - full[k]).abs().max().item() for k in full) <= 1e-12


def test_every_sample_once_per_epoch_across_the_interruption(runs):
    steps = [runs["mid1"][r]["steps"] + runs["mid2"][r]["steps"] for r in range(2)]
    for epoch in (0, 1):
        seen = [i for rank_steps in steps for (e, _, indices) in rank_steps if e == epoch for i in indices]
        assert sorted(seen) == list(range(NUM_SAMPLES))
    # the decision taken at the last batch of epoch 0 shaped epoch 1 of the resumed runs
    assert [len(steps[r][len(runs["end1"][0]["steps"])][2]) for r in range(2)] == [4, 5]
