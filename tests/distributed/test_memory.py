"""Out-of-memory recovery in real multi-process Trainer.fit runs: a rank given more samples than its memory holds.

Two gloo ranks; rank 1's device memory is emulated (``HeterogeneityEmulator(memory_limits=[None, 9])``: a step that
gives it more raises ``torch.OutOfMemoryError`` in its backward). A resize past it mid-epoch, a first step past it,
and pid moving samples to the fast rank each make a step run out of memory; the step is split anew within the
rank's lowered cap and trained again. The parameters must equal one process on the global batches trained.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.distributed

RUNS = {"sgd": "sgd", "adam": "adam", "first-step": "sgd", "pid": "sgd"}
NUM_SAMPLES, LIMIT = 150, 9


@pytest.fixture(scope="module")
def results(tmp_path_factory, pools):
    out = tmp_path_factory.mktemp("memory")
    pools(2).run_script("memory_job.py", out, cwd=out)
    return {name: [torch.load(out / f"{name}-rank{r}.pt") for r in range(2)] for name in RUNS}


def sizes_per_step(ranks):
    return [tuple(len(r["steps"][k][2]) for r in ranks) for k in range(len(ranks[0]["steps"]))]


@pytest.mark.parametrize("name", RUNS)
def test_a_step_that_ran_out_of_memory_is_trained_again_and_equals_one_process(results, job_helpers, name):
    ranks = results[name]
    assert [r["recovered"] for r in ranks] == [1, 1]
    expected, _ = job_helpers.reference_training([r["steps"] for r in ranks], NUM_SAMPLES, RUNS[name], 1)
    for rank in ranks:
        worst = max((rank["params"][k] - expected[k]).abs().max().item() for k in expected)
        assert worst <= 1e-9, f"{name}: max abs difference {worst}"
    # no step trained more samples on rank 1 than its memory holds, and every rank agrees on its new cap
    assert max(s[1] for s in sizes_per_step(ranks)) <= LIMIT
    assert ranks[0]["caps"] == ranks[1]["caps"]
    assert ranks[0]["caps"][0] is None
    assert ranks[0]["caps"][1] <= LIMIT


@pytest.mark.parametrize("name", RUNS)
def test_every_sample_is_trained_once_per_epoch_through_the_retries(results, name):
    ranks = results[name]
    epochs = {e for e, _, _ in ranks[0]["steps"]}
    for epoch in epochs:
        seen = [i for r in ranks for (e, _, indices) in r["steps"] if e == epoch for i in indices]
        assert sorted(seen) == list(range(NUM_SAMPLES))


def test_the_step_is_split_anew_within_the_cap_keeping_its_global_batch(results):
    sizes = sizes_per_step(results["sgd"])
    # the resize gave [2, 10]: rank 1 failed at 10, was capped at 3/4 of it (7 > the 4 it trained), the 12
    # samples split 5 and 7; later sizes within the cap apply as asked
    assert (2, 10) not in sizes
    assert sizes[3] == (5, 7)
    assert (6, 6) in sizes
    assert (8, 4) in sizes
    assert sizes_per_step(results["first-step"])[0] == (5, 9)  # 14 samples, rank 1 capped at 9 on the first step


def test_decisions_after_an_out_of_memory_error_keep_within_the_lowered_cap(results):
    ranks = results["pid"]
    cap = ranks[0]["caps"][1]
    decided = ranks[0]["decided"]
    failed = next(k for k, d in enumerate(decided) if d[1] > LIMIT)  # pid asked more than the memory held, once
    assert all(d[1] <= cap for d in decided[failed + 1 :])
    assert any(d[1] == cap for d in decided[failed + 1 :])  # the fast rank is kept at its cap, not below
    # the cap is gathered with the rank's measurements (rank 0 has none: NaN)
    gathered = ranks[0]["gathered_caps"][-1]
    assert math.isnan(gathered[0])
    assert gathered[1] == cap
