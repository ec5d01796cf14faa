"""Ranks that sit steps out (``min_batch_size=0``) in real three-process Trainer.fit runs.

The sizes go to zero on one rank, then on two, then back, mid-epoch and inside accumulation
windows; every result must equal one process training on the union of the ranks' batches.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.distributed

SCENARIOS = {"sgd-acc1": ("sgd", 1), "adam-acc1": ("adam", 1), "sgd-acc2": ("sgd", 2), "adam-acc3": ("adam", 3)}
NUM_SAMPLES, WORLD = 150, 3


@pytest.fixture(scope="module")
def results(tmp_path_factory, pools):
    out = tmp_path_factory.mktemp("sit-out")
    pools(WORLD).run_script("sit_out_job.py", out, cwd=out)
    names = [*SCENARIOS, "mid1", "mid2", "broadcast"]
    return {name: [torch.load(out / f"{name}-rank{r}.pt") for r in range(WORLD)] for name in names}


def reference(job_helpers, name, ranks):
    optimizer, accumulate = SCENARIOS[name]
    return job_helpers.reference_training([r["steps"] for r in ranks], NUM_SAMPLES, optimizer, accumulate)


@pytest.mark.parametrize("name", SCENARIOS)
def test_ranks_that_sit_out_train_exactly_like_one_process_on_the_union(results, job_helpers, name):
    ranks = results[name]
    expected, _ = reference(job_helpers, name, ranks)
    for rank in ranks:
        worst = max((rank["params"][k] - expected[k]).abs().max().item() for k in expected)
        assert worst <= 1e-6, f"max abs difference {worst}"
    sizes = [tuple(len(r["steps"][k][2]) for r in ranks) for k in range(len(ranks[0]["steps"]))]
    # one rank out, then two ranks out, then every rank back, all happened
    two_out = next(k for k, s in enumerate(sizes) if s.count(0) == 2)
    assert any(s.count(0) == 1 for s in sizes[:two_out])
    assert any(0 not in s for s in sizes[two_out:])


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_rank_that_sits_out_skips_the_step_and_is_brought_up_to_date_before_it_is_used(results, name):
    ranks = results[name]
    _, accumulate = SCENARIOS[name]
    behind = []  # for each rank out at a step: were its parameters after it not those of a rank that trained it?
    for k in range(len(ranks[0]["steps"])):
        trained = next(r for r in ranks if r["steps"][k][2])
        behind += [r["weights"][k] != trained["weights"][k] for r in ranks if not r["steps"][k][2]]
    assert behind
    # one step, one all-reduce: a rank with no samples leaves it and skips the optimizer step (it does
    # not hold the others up); within accumulation windows it joins the all-reduce with a zero gradient
    assert all(behind) if accumulate == 1 else not any(behind)
    # the last step of each epoch has a rank out, and validation sees one model on every rank (the end of
    # training too: every rank's final parameters are checked against one process above)
    assert not ranks[1]["steps"][-1][2]
    assert len(ranks[0]["validated"]) == 2
    assert len({tuple(r["validated"]) for r in ranks}) == 1


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_emulator_slows_a_rank_s_compute_and_not_a_step_it_has_no_samples_in(results, name):
    # every rank is emulated 2x slower; a step without samples runs none of the model, left or joined
    for rank in results[name]:
        slept = [s for (_, _, indices), s in zip(rank["steps"], rank["slept"]) if indices]
        idle = [s for (_, _, indices), s in zip(rank["steps"], rank["slept"]) if not indices]
        assert idle
        assert all(s == 0.0 for s in idle)
        assert all(s > 0.0 for s in slept[1:])  # from its second step on, once its compute was measured


@pytest.mark.parametrize("name", ["sgd-acc1", "adam-acc1"])
def test_gradient_norms_are_reported_where_more_than_one_rank_trains(results, name):
    # one step, one synchronisation: a rank training alone holds the global gradient (nothing for the noise scale)
    ranks = results[name]
    alone = 0
    for k in range(len(ranks[0]["steps"])):
        training = [i for i, r in enumerate(ranks) if r["steps"][k][2]]
        alone += len(training) == 1
        for i, r in enumerate(ranks):
            assert r["norm_reports"][k] == (1 if i in training and len(training) > 1 else 0)
    assert alone


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_sample_once_per_epoch_with_ranks_out_and_back(results, name):
    ranks = results[name]
    assert len({len(r["steps"]) for r in ranks}) == 1
    for epoch in (0, 1):
        seen = [i for r in ranks for (e, _, indices) in r["steps"] if e == epoch for i in indices]
        assert sorted(seen) == list(range(NUM_SAMPLES))


def test_a_rank_receives_parameters_buffers_and_an_optimizer_state_it_never_had(results):
    ranks = results["broadcast"]
    for rank in ranks[1:]:
        for k, value in ranks[0]["module"].items():  # parameters and BatchNorm's running statistics
            assert torch.equal(rank["module"][k], value), k
        state, expected = rank["optimizer"]["state"], ranks[0]["optimizer"]["state"]
        assert state.keys() == expected.keys()
        for index, entries in expected.items():
            assert float(entries["step"]) == 3.0
            assert all(torch.equal(state[index][k], v) for k, v in entries.items())


def test_a_checkpoint_taken_while_a_rank_sits_out_resumes_on_the_same_batches_and_parameters(results):
    for r in range(WORLD):
        full, before, after = results["adam-acc1"][r], results["mid1"][r], results["mid2"][r]
        assert before["steps"][-1][2] == [] if r == 0 else before["steps"][-1][2]  # rank 0 was out at the save
        assert before["steps"] + after["steps"] == full["steps"]
        for k, value in full["params"].items():
            assert torch.allclose(after["params"][k], value, atol=1e-9)


def test_the_logged_step_loss_is_the_mean_over_the_ranks_that_trained(results, job_helpers):
    for name in SCENARIOS:
        ranks = results[name]
        _, expected = reference(job_helpers, name, ranks)
        for rank in ranks:
            trained = [(p, e) for (_, _, indices), p, e in zip(rank["steps"], rank["probes"], expected) if indices]
            assert all(p is not None for p, _ in trained)
            assert [p for p, _ in trained] == pytest.approx([e for _, e in trained], abs=1e-9)
            assert all(p is None for (_, _, indices), p in zip(rank["steps"], rank["probes"]) if not indices)
