"""FSDP2 with uneven, changing per-rank sizes trains exactly like one process on the global batches: under Lightning
(HeterogeneousFSDPStrategy, real Trainer.fit runs) and under Accelerate (DynamixAccelerate with a model sharded by
fully_shard).

Two and three gloo ranks, float64, sizes that change mid-epoch and inside accumulation windows and give a rank 0
samples (it runs one sample of the step at weight 0, so that FSDP's collectives meet): an MLP with SGD, a model with
GlobalBatchNorm (a rank may train a single sample), a transformer block with Adam and accumulation
(jobs/fsdp2_lightning_job.py, jobs/fsdp2_accelerate_job.py).
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
def jobs(tmp_path_factory, pools, job_module):
    """Under Lightning (one job runs every scenario) and Accelerate (one job a scenario), on 2 and 3 ranks, the
    two world sizes at once on the session's pools of ranks: each one's output folder."""
    outs = {}
    for world in (2, 3):
        outs["lightning", world] = tmp_path_factory.mktemp(f"fsdp2-lightning-{world}")
        outs["accelerate", world] = tmp_path_factory.mktemp(f"fsdp2-accelerate-{world}")
    lightning, accelerate = "fsdp2_lightning_job.py", "fsdp2_accelerate_job.py"
    run_scripts(*[(pools(w), lightning, (w, outs["lightning", w]), outs["lightning", w]) for w in (2, 3)])
    for name in job_module.SCENARIOS:
        run_scripts(*[(pools(w), accelerate, (outs["accelerate", w], name), outs["accelerate", w]) for w in (2, 3)])
    return outs


@pytest.fixture(
    scope="module",
    params=[("lightning", 2), ("lightning", 3), ("accelerate", 2), ("accelerate", 3)],
    ids=["lightning-2-ranks", "lightning-3-ranks", "accelerate-2-ranks", "accelerate-3-ranks"],
)
def job(request, jobs, job_module):
    out, world_size = jobs[request.param], request.param[1]
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


def test_accelerate_refuses_a_model_it_cannot_weight_and_a_loss_without_the_model(tmp_path, pools):
    pools(2).run_script("fsdp2_accelerate_job.py", tmp_path, "errors", cwd=tmp_path)
    for rank in range(2):
        messages = torch.load(tmp_path / f"errors-rank{rank}.pt")
        assert "has 2 trained parameter(s) no fully_shard holds (2.weight, 2.bias)" in messages["loose"]
        assert "convert them before fully_shard" in messages["plain"]
        assert "a process that sits a step out is handed one sample of the step" in messages["zero_loss"]


def test_a_rank_that_makes_the_others_wait_inside_the_step_is_measured_slow_and_given_fewer_samples(tmp_path, pools):
    """Virtual clocks (jobs/fsdp2_wait_job.py): rank 1 computes 3x slower, and FSDP's collectives hold rank 0 until it
    arrives, inside rank 0's forward and backward. Timed as waiting, rank 0's compute is its own: pid moves samples
    to it (counted as compute, both ranks would read alike and the split stay even)."""
    pools(2).run_script("fsdp2_wait_job.py", tmp_path, "compute", cwd=tmp_path)
    records = torch.load(tmp_path / "decisions-compute.pt")
    first = records[0]
    assert first["sizes"] == [8, 8]
    assert first["compute"][1] == pytest.approx(3 * first["compute"][0])  # 24 ms against 8 ms of virtual compute
    assert first["wait"][0] >= 2 * first["compute"][0]  # rank 0 waited inside its step for rank 1
    final = records[-1]["decided"]
    assert sum(final) == 16
    assert final[0] >= 11  # towards 12:4, the split that evens 1:3


def test_a_cap_on_the_fast_rank_s_machine_bounds_the_split_the_controller_wants(tmp_path, pools):
    pools(2).run_script("fsdp2_wait_job.py", tmp_path, "capped", cwd=tmp_path)
    records = torch.load(tmp_path / "decisions-capped.pt")
    assert {tuple(r["decided"]) for r in records} == {(10, 6)}  # 12:4 would even 1:3; rank 0 holds 10


def test_a_rank_late_to_run_again_after_each_collective_is_measured_slow_by_its_arrivals(tmp_path, pools):
    """Virtual clocks (jobs/fsdp2_wait_job.py, ``wake``): both ranks compute alike, but rank 1 runs again 0.5 ms after
    each collective completed (a co-tenant holds its core), inside its time in the collective, and so arrives late
    at the next, where rank 0 waits. By time inside collectives alone both read alike; by arrivals, rank 1's late
    wake is its own time, rank 0's wait is waiting, and pid moves samples to rank 0."""
    pools(2).run_script("fsdp2_wait_job.py", tmp_path, "wake", cwd=tmp_path)
    records = torch.load(tmp_path / "decisions-wake.pt")
    first = records[0]
    assert first["sizes"] == [8, 8]
    assert first["compute"][0] == pytest.approx(0.008)  # its own 8 samples at 1 ms
    assert first["compute"][1] > first["compute"][0] + 0.002  # 8 ms and the late wakes after the last arrival
    assert first["wait"][0] > 0.002  # rank 0 waited for rank 1 at the collectives after
    assert first["decided"] == [9, 7]  # the closest split to even 9.5:6.5
    assert records[-1]["decided"] == [9, 7]
