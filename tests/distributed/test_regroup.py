"""Lightning jobs resumed on another number of ranks (3 -> 2 and 2 -> 3) train as if never interrupted.

Three launches (jobs/regroup_job.py): 3 ranks train and checkpoint mid-epoch and at an epoch's end;
2 ranks resume those, then train and checkpoint themselves; 3 ranks resume the 2-rank checkpoints.
Each resumed job must train exactly the global batches of the uninterrupted job that wrote its
checkpoint (every remaining sample once), split over its own ranks, and end with its parameters.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.distributed

NUM_SAMPLES = 150
CONFIGS = ("sgd-workers0", "adam-workers2")
DIRECTIONS = [(3, 2), (2, 3)]  # (saved by, resumed on)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pools):
    out = tmp_path_factory.mktemp("regroup")
    pools(3).run_script("regroup_job.py", 3, out, cwd=out)
    pools(2).run_script("regroup_job.py", 2, out, 3, cwd=out)
    pools(3).run_script("regroup_job.py", 3, out, 2, cwd=out)

    def load(config, name, world):
        return [torch.load(out / f"{config}-{name}-w{world}-rank{r}.pt") for r in range(world)]

    load.out = out
    return load


def global_steps(ranks):
    """``(epoch, batch_idx) -> sorted sample indices over all ranks``, checking every rank ran every step."""
    keys = [[(e, b) for e, b, _ in rank["steps"]] for rank in ranks]
    assert all(k == keys[0] for k in keys), "ranks trained different steps"
    merged: dict[tuple[int, int], list[int]] = {}
    for rank in ranks:
        for epoch, batch_idx, indices in rank["steps"]:
            merged.setdefault((epoch, batch_idx), []).extend(indices)
    return {key: sorted(v) for key, v in merged.items()}


def assert_resumed_like_uninterrupted(full, before, after) -> None:
    """An interrupted job (``before`` on its ranks, then ``after`` on the same or other ranks) trained
    the uninterrupted job's (``full``) global batches, every sample once per epoch, and ends with its
    parameters (float64, 1e-6). Each argument is the list of per-rank records a job saved."""
    first, rest = global_steps(before), global_steps(after)
    assert first
    assert rest
    assert not set(first) & set(rest), "a step was trained twice"
    assert {**first, **rest} == global_steps(full)
    for epoch in (0, 1):
        seen = [i for (e, _), indices in [*first.items(), *rest.items()] if e == epoch for i in indices]
        assert sorted(seen) == list(range(NUM_SAMPLES))
    reference = full[0]["params"]
    for rank in after:
        worst = max((rank["params"][k] - reference[k]).abs().max().item() for k in reference)
        assert worst <= 1e-6, f"max abs difference {worst}"


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("checkpoint", ["mid", "end"])
@pytest.mark.parametrize(("saved", "resumed"), DIRECTIONS, ids=["3-to-2", "2-to-3"])
def test_resumed_on_other_ranks_trains_the_same_global_batches_and_ends_equal(runs, config, checkpoint, saved, resumed):
    assert_resumed_like_uninterrupted(
        runs(config, "full", saved),
        runs(config, f"{checkpoint}1", saved),
        runs(config, f"{checkpoint}2-from{saved}", resumed),
    )


@pytest.mark.parametrize(("saved", "resumed"), DIRECTIONS, ids=["3-to-2", "2-to-3"])
def test_without_a_controller_the_resumed_global_batch_is_split_evenly(runs, saved, resumed):
    after = runs("sgd-workers0", f"mid2-from{saved}", resumed)
    first_sizes = [len(rank["steps"][0][2]) for rank in after]
    assert max(first_sizes) - min(first_sizes) <= 1


@pytest.mark.parametrize(("saved", "resumed"), DIRECTIONS, ids=["3-to-2", "2-to-3"])
def test_the_controller_keeps_what_it_learnt_about_the_machines_that_stay(runs, saved, resumed):
    before = torch.load(runs.out / f"pid-mid1-w{saved}.pt")
    after = torch.load(runs.out / f"pid-mid2-from{saved}-w{resumed}.pt")
    saved_ids, saved_speeds = before["end"]["machine_ids"], before["end"]["controller"]["speeds"]
    start = after["start"]
    assert len(saved_ids) == saved
    assert start["machine_ids"][: min(saved, resumed)] == saved_ids[: min(saved, resumed)]
    # the surviving machines keep their speeds; a new machine starts from their mean
    expected_from = [r if r < saved else None for r in range(resumed)]
    assert start["regrouped_from"] == expected_from
    survivors = [saved_speeds[r] for r in range(min(saved, resumed))]
    expected = [saved_speeds[r] if r < saved else sum(survivors) / len(survivors) for r in range(resumed)]
    assert start["speeds"] == pytest.approx(expected)
    # the resumed split follows those speeds: the machine 4x slower (rank 0, virtual clock) gets the fewest samples
    sizes = start["batch_sizes"]
    assert sum(sizes) == 4 * saved  # the saved job's global batch (4 per rank, kept by PID)
    assert sizes[0] == min(sizes)
    assert sizes[0] < max(sizes) - 1
    # and the job went on deciding on the new group
    assert after["end"]["machine_ids"] == start["machine_ids"]
