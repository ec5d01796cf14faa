"""HeterogeneousFSDPStrategy in real multi-process Trainer.fit runs: FSDP2 with uneven, changing sizes trains exactly
like one process on the global batches.

Two and three gloo ranks, float64, sizes that change mid-epoch and inside accumulation windows and give a rank 0
samples (it runs one sample of the step at weight 0, so that FSDP's collectives meet): an MLP with SGD and with Adam
and accumulation, a model with GlobalBatchNorm (a rank may train a single sample), a transformer block
(jobs/fsdp2_lightning_job.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.conftest import import_job
from tests.distributed.pool import run_scripts

pytestmark = pytest.mark.distributed

NUM_SAMPLES = 150


@pytest.fixture(scope="module")
def job_module():
    return import_job("fsdp2_lightning_job")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, pools):
    """The 2-rank and the 3-rank job, run at once on the session's pools of ranks; each one's output folder."""
    outs = {world_size: tmp_path_factory.mktemp(f"fsdp2-{world_size}") for world_size in (2, 3)}
    run_scripts(*[(pools(world), "fsdp2_lightning_job.py", (world, out), out) for world, out in outs.items()])
    return outs


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def job(request, jobs, job_module):
    world_size, out = request.param, jobs[request.param]
    names = job_module.SCENARIOS
    return {name: [torch.load(out / f"{name}-rank{r}.pt") for r in range(world_size)] for name in names}


def one_process(job_helpers, job_module, name, ranks):
    """One process trains the scenario's network on the concatenated global batches, a window per optimizer step:
    its parameters and buffers, and the loss of each global batch with the parameters it was trained with."""
    architecture, optimizer, accumulate = job_module.SCENARIOS[name]
    network = job_module.network(architecture)
    opt = job_helpers.make_optimizer(optimizer, network.parameters())
    data = job_helpers.IndexedDataset(NUM_SAMPLES)
    steps = ranks[0]["steps"]
    lengths: dict[int, int] = {}
    for epoch, _, _ in steps:
        lengths[epoch] = lengths.get(epoch, 0) + 1
    window: list[int] = []
    probes = []
    for k, (epoch, batch_idx, _) in enumerate(steps):
        indices = [i for r in ranks for i in r["steps"][k][2]]
        window.extend(indices)
        if accumulate > 1:  # no BatchNorm here: a forward pass changes nothing
            with torch.no_grad():
                probes.append(float(F.cross_entropy(network(data.x[indices]), data.y[indices])))
        if (batch_idx + 1) % accumulate == 0 or batch_idx + 1 == lengths[epoch]:
            opt.zero_grad()
            loss = F.cross_entropy(network(data.x[window]), data.y[window])
            loss.backward()
            opt.step()
            if accumulate == 1:
                probes.append(loss.item())
            window = []
    return network.state_dict(), probes


def test_parameters_and_buffers_equal_one_process_on_the_global_batches(job, job_helpers, job_module):
    for name, ranks in job.items():
        expected, _ = one_process(job_helpers, job_module, name, ranks)
        assert set(ranks[0]["state"]) == set(expected)
        for rank in ranks:
            for key, value in expected.items():
                worst = (rank["state"][key].double() - value.double()).abs().max().item()
                assert worst <= 1e-6, f"{name}: {key} differs by {worst}"


def test_sizes_changed_a_rank_sat_out_and_every_sample_was_trained_once_per_epoch(job):
    for name, ranks in job.items():
        assert len({len(r["steps"]) for r in ranks}) == 1
        sizes = [tuple(len(r["steps"][k][2]) for r in ranks) for k in range(len(ranks[0]["steps"]))]
        assert len(set(sizes)) >= 4, name
        assert any(0 in s for s in sizes), name
        for epoch in (0, 1):
            seen = [i for r in ranks for (e, _, indices) in r["steps"] if e == epoch for i in indices]
            assert sorted(seen) == list(range(NUM_SAMPLES)), f"{name}: epoch {epoch}"


def test_a_loss_logged_with_sync_dist_is_the_global_batch_s_mean_whoever_sat_out(job, job_helpers, job_module):
    for name, ranks in job.items():
        _, expected = one_process(job_helpers, job_module, name, ranks)
        for rank in ranks:
            for k, probe in enumerate(rank["probes"]):
                if probe is not None:  # None: the rank sat the step out (it logged the same mean, unrecorded)
                    assert math.isclose(probe, expected[k], rel_tol=0, abs_tol=1e-9), f"{name}: step {k}"
