"""A SIGTERM to one rank saves one checkpoint of one step on every rank; the job resumes it on fewer ranks.

jobs/preempt_job.py: 3 real ranks (Lightning's launcher, gloo); rank 2 sends itself SIGTERM mid-epoch. The
resumed job runs on the session's pool of 2 ranks.
"""

from __future__ import annotations

import pytest
import torch

from lightning_dynamix.elastic import PREEMPTED_EXIT_CODE
from tests.distributed.conftest import run_job
from tests.distributed.test_regroup import assert_resumed_like_uninterrupted

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pools):
    out = tmp_path_factory.mktemp("preempt")
    train = run_job("preempt_job.py", 3, out, "train", cwd=out, check=False)
    saved = torch.load(out / "checkpoints" / "last-preempted.ckpt", weights_only=False)["global_step"]
    # the restart on 2 ranks is a job as any other: the session's pool of 2 ranks runs it (tests/distributed/pool.py)
    pools(2).run_script("preempt_job.py", 2, out, "resume", cwd=out)
    return out, train, saved


def test_a_sigterm_to_one_rank_saves_one_step_on_every_rank_and_exits_for_a_restart(runs):
    out, train, saved = runs
    assert train.returncode == PREEMPTED_EXIT_CODE, train.stderr[-4000:]
    ranks = [torch.load(out / f"preempted-w3-rank{r}.pt") for r in range(3)]
    assert [r["exception"] for r in ranks] == ["Preempted"] * 3
    steps = {r["saved_step"] for r in ranks}
    assert len(steps) == 1
    (step,) = steps
    # rank 2 signalled itself at the end of its 7th batch, before the check there (Lightning runs checkpoint
    # callbacks last): the flag sent at step 7 is read at step 8, the same step on every rank
    assert step == 8
    assert saved == step  # the file the launcher's restart finds
    assert [len(r["steps"]) for r in ranks] == [step] * 3


def test_the_job_resumes_the_preemption_checkpoint_on_fewer_ranks_with_nothing_lost(runs):
    out, _, _ = runs

    def load(name, world):
        return [torch.load(out / f"{name}-w{world}-rank{r}.pt") for r in range(world)]

    assert_resumed_like_uninterrupted(load("full", 3), load("preempted", 3), load("resumed", 2))


def test_the_resumed_job_leaves_its_end_in_the_file_a_later_restart_finds(runs):
    out, _, _ = runs
    end = [torch.load(out / f"resumed-w2-rank{r}.pt") for r in range(2)]
    checkpoint = torch.load(out / "checkpoints" / "last-preempted.ckpt", weights_only=False)
    assert checkpoint["global_step"] == end[0]["global_step"] > 8
