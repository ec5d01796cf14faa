"""FSDP2 jobs saved with torch distributed checkpoint on 2 ranks and resumed on 3 train as if never interrupted: under
Lightning (HeterogeneousFSDPStrategy, whose controller keeps what it learnt about the machines that stay:
jobs/fsdp2_regroup_job.py) and under Accelerate (``save_state``/``load_state``: jobs/fsdp2_accelerate_regroup_job.py).

The checkpoint is a folder of shards (each rank writes its own); the 3 ranks read them resharded, with Adam's state,
and the position in the data and the sizes decided, split over the new ranks.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_regroup import assert_resumed_like_uninterrupted

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def out(tmp_path_factory, pools):
    out = tmp_path_factory.mktemp("fsdp2-regroup")
    pools(2).run_script("fsdp2_regroup_job.py", 2, out, cwd=out)
    pools(3).run_script("fsdp2_regroup_job.py", 3, out, 2, cwd=out)
    return out


def load(out, name, world):
    return [torch.load(out / f"{name}-w{world}-rank{r}.pt") for r in range(world)]


def test_a_sharded_checkpoint_of_2_ranks_resumed_on_3_trains_the_same_global_batches_and_ends_equal(out):
    assert (out / "mid-w2.ckpt").is_dir()  # shards, not one file
    assert_resumed_like_uninterrupted(load(out, "full", 2), load(out, "mid1", 2), load(out, "mid2-from2", 3))


def test_the_controller_keeps_what_it_learnt_about_the_machines_that_stay(out):
    before = torch.load(out / "pid-mid1-w2.pt")
    start = torch.load(out / "pid-mid2-from2-w3.pt")["start"]
    saved_ids, saved_speeds = before["end"]["machine_ids"], before["end"]["controller"]["speeds"]
    assert start["machine_ids"][:2] == saved_ids
    assert start["regrouped_from"] == [0, 1, None]
    assert start["speeds"] == pytest.approx([*saved_speeds, sum(saved_speeds) / 2])
    sizes = start["batch_sizes"]  # the 4x slower machine (rank 0, a virtual clock) gets the fewest samples
    assert sum(sizes) == 8
    assert sizes[0] == min(sizes)
    assert sizes[0] < max(sizes) - 1


def test_accelerate_s_state_of_2_processes_loaded_by_3_trains_the_same_global_batches_and_ends_equal(tmp_path, pools):
    for world, run in [(2, "full"), (2, "mid"), (3, "resume")]:
        pools(world).run_script("fsdp2_accelerate_regroup_job.py", tmp_path, run, cwd=tmp_path)
    assert (tmp_path / "mid-state" / "dynamix_shards").is_dir()  # each process's shards
    assert_resumed_like_uninterrupted(load(tmp_path, "full", 2), load(tmp_path, "mid", 2), load(tmp_path, "resume", 3))
