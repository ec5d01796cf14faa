"""BatchNorm in real multi-process Trainer.fit runs: global statistics over uneven ranks, and the least size.

With ``sync_batchnorm=True`` three gloo ranks with uneven sizes that change, sit out (0) and train a single sample
must train the model one process trains on the concatenated global batches: parameters and running statistics.
Without it, pid against a rank 40 times slower (whose share is under one sample) must never give a BatchNorm
model's rank a single sample.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.distributed

WORLD, NUM_SAMPLES = 3, 150
RUNS = {"sgd": "sgd", "adam": "adam", "sgd-joined": "sgd"}


@pytest.fixture(scope="module")
def results(tmp_path_factory, pools):
    out = tmp_path_factory.mktemp("batch-norm")
    pools(WORLD).run_script("batch_norm_job.py", out, cwd=out)
    return {name: [torch.load(out / f"{name}-rank{r}.pt") for r in range(WORLD)] for name in RUNS}


@pytest.fixture(scope="module")
def pid_result(tmp_path_factory, pools):
    out = tmp_path_factory.mktemp("batch-norm-pid")
    pools(2).run_script("batch_norm_pid_job.py", out, cwd=out)
    return torch.load(out / "pid-rank0.pt")


def one_process(job_helpers, ranks, optimizer):
    """One process with torch's BatchNorm trains on the concatenated global batches, one step each."""
    network = job_helpers.batch_norm_network(0)
    opt = job_helpers.make_optimizer(optimizer, network.parameters())
    data = job_helpers.IndexedDataset(NUM_SAMPLES)
    for k in range(len(ranks[0]["steps"])):
        indices = torch.tensor([i for r in ranks for i in r["steps"][k][2]])
        opt.zero_grad()
        F.cross_entropy(network(data.x[indices]), data.y[indices]).backward()
        opt.step()
    return network.state_dict()


@pytest.mark.parametrize("name", RUNS)
def test_synchronised_batch_norm_trains_like_one_process_on_the_global_batch(results, job_helpers, name):
    ranks = results[name]
    sizes = [tuple(len(r["steps"][k][2]) for r in ranks) for k in range(len(ranks[0]["steps"]))]
    assert any(s.count(0) == 1 for s in sizes)
    assert any(s.count(0) == 2 for s in sizes)
    assert any(1 in s for s in sizes)  # a rank of one sample: the global statistics need no more
    expected = one_process(job_helpers, ranks, RUNS[name])
    assert {"net.2.running_var", "net.6.running_mean", "net.6.num_batches_tracked"} <= {f"net.{k}" for k in expected}
    for rank in ranks:
        for key, value in expected.items():
            worst = (rank["state"][key].double() - value.double()).abs().max().item()
            assert worst <= 1e-6, f"{name}: {key} differs by {worst}"
        # Lightning puts the user's layers back at the end of fit
        assert rank["layers"][2] == "BatchNorm2d"
        assert rank["layers"][6] == "BatchNorm1d"


def test_plain_batch_norm_without_sync_is_what_one_process_on_the_global_batch_is_not(results, job_helpers):
    # the control: torch's BatchNorm per rank on the same steps gives other parameters (so the test above can fail)
    ranks = results["sgd"]
    network = job_helpers.batch_norm_network(0)
    opt = job_helpers.make_optimizer("sgd", network.parameters())
    data = job_helpers.IndexedDataset(NUM_SAMPLES)
    for k in range(len(ranks[0]["steps"])):
        opt.zero_grad()
        total = sum(len(r["steps"][k][2]) for r in ranks)
        for r in ranks:  # each rank's own statistics, gradients weighted by its share
            indices = torch.tensor(r["steps"][k][2])
            if len(indices) > 1:
                (F.cross_entropy(network(data.x[indices]), data.y[indices]) * len(indices) / total).backward()
        opt.step()
    worst = max(
        (ranks[0]["state"][k].double() - v.double()).abs().max().item() for k, v in network.state_dict().items()
    )
    assert worst > 1e-3


def test_pid_never_gives_a_batch_norm_rank_one_sample_and_the_job_runs_to_its_end(pid_result):
    assert pid_result["min_batch_size"] == 2  # raised from the default 1 at set-up, for the BatchNorm1d
    assert pid_result["global_step"] == pid_result["num_training_batches"]  # one epoch, to its end
    assert pid_result["decided"], "pid decided nothing"
    assert all(min(sizes) >= 2 for sizes in pid_result["sizes"] + pid_result["decided"])
    assert any(sizes != [16, 16] for sizes in pid_result["decided"])  # it moved samples off the slow rank


def test_synchronised_batch_norm_under_accelerate_trains_like_one_process_on_the_global_batch(
    tmp_path, job_helpers, pools
):
    pools(WORLD).run_script("accelerate_batch_norm_job.py", tmp_path, cwd=tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    sizes = [tuple(len(r["steps"][k][2]) for r in ranks) for k in range(len(ranks[0]["steps"]))]
    assert any(s[0] == 0 for s in sizes)
    assert any(1 in s for s in sizes)
    assert any(s.count(0) == 2 for s in sizes)
    assert all(r["least_batch_size"] == 1 for r in ranks)
    expected = one_process(job_helpers, ranks, "adam")
    for rank in ranks:
        for key, value in expected.items():
            worst = (rank["state"][key].double() - value.double()).abs().max().item()
            assert worst <= 1e-6, f"{key} differs by {worst}"
