"""Real multi-process Trainer.fit runs: uneven, changing sizes train exactly like one process.

Each job trains SGD and Adam, with and without gradient accumulation, a loss summed over samples
and manual optimisation, in float64, for two epochs while a callback changes the per-rank sizes
mid-epoch (also inside accumulation windows).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.conftest import run_job
from tests.distributed.pool import run_scripts

pytestmark = pytest.mark.distributed

# name: (optimizer, accumulate_grad_batches, loss reduction), as in jobs/exactness_job.py
SCENARIOS = {
    "sgd-acc1": ("sgd", 1, "mean"),
    "sgd-acc2": ("sgd", 2, "mean"),
    "adam-acc1": ("adam", 1, "mean"),
    "adam-acc2": ("adam", 2, "mean"),
    "sgd-sum-acc2": ("sgd-small", 2, "sum"),
    "sgd-manual": ("sgd", 1, "mean"),
}
NUM_SAMPLES = 150


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, pools):
    """The 2-rank and the 3-rank job, run at once on the session's pools of ranks; each one's output folder."""
    outs = {world_size: tmp_path_factory.mktemp(f"exactness-{world_size}") for world_size in (2, 3)}
    run_scripts(*[(pools(world_size), "exactness_job.py", (world_size, out), out) for world_size, out in outs.items()])
    return outs


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def job(request, jobs):
    world_size, out = request.param, jobs[request.param]
    results = {name: [torch.load(out / f"{name}-rank{r}.pt") for r in range(world_size)] for name in SCENARIOS}
    return world_size, results


def reference(job_helpers, name, ranks):
    optimizer, accumulate, reduction = SCENARIOS[name]
    steps = [r["steps"] for r in ranks]
    return job_helpers.reference_training(steps, NUM_SAMPLES, optimizer, accumulate, reduction=reduction)


@pytest.mark.parametrize("name", SCENARIOS)
def test_parameters_equal_one_process_on_the_concatenated_global_batches(job, job_helpers, name):
    _, results = job
    ranks = results[name]
    expected, _ = reference(job_helpers, name, ranks)
    for rank in ranks:
        worst = max((rank["params"][k] - expected[k]).abs().max().item() for k in expected)
        assert worst <= 1e-6, f"max abs difference {worst}"
    # the sizes did change during the run, on every rank identically
    sizes_per_step = [tuple(len(r["steps"][k][2]) for r in ranks) for k in range(len(ranks[0]["steps"]))]
    assert len(set(sizes_per_step)) >= 4


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_sample_once_per_epoch_and_same_step_count_on_all_ranks(job, name):
    _, results = job
    ranks = results[name]
    assert len({len(r["steps"]) for r in ranks}) == 1
    for epoch in (0, 1):
        seen = [i for r in ranks for (e, _, indices) in r["steps"] if e == epoch for i in indices]
        assert sorted(seen) == list(range(NUM_SAMPLES))


def test_logged_step_loss_is_the_global_batch_mean(job, job_helpers):
    """self.log(..., sync_dist=True) in training_step averages ranks weighted by their batch sizes."""
    _, results = job
    for name, ranks in results.items():
        _, expected = reference(job_helpers, name, ranks)
        for rank in ranks:
            assert rank["probes"] == pytest.approx(expected, abs=1e-9)


def test_validation_runs_with_the_strategy(job):
    _, results = job
    for ranks in results.values():
        values = {r["val_loss"] for r in ranks}
        assert len(values) == 1
        assert math.isfinite(values.pop())


def test_ranks_that_disagree_on_new_sizes_all_fail_instead_of_hanging(tmp_path):
    proc = run_job("disagree_job.py", cwd=tmp_path, timeout=120, check=False)
    assert proc.returncode != 0
    for rank in (0, 1):
        assert f"rank {rank} raised: set_batch_sizes() was called with different arguments" in proc.stdout
