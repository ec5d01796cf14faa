"""A SIGTERM to one rank saves one checkpoint of one step on every rank; the job resumes it on fewer ranks.

jobs/preempt_job.py: 3 real ranks (Lightning's launcher, gloo); rank 2 sends itself SIGTERM mid-epoch.
"""

from __future__ import annotations

import pytest
import torch

from lightning_dynamix.elastic import PREEMPTED_EXIT_CODE
from tests.distributed.conftest import run_job
from tests.distributed.test_regroup import NUM_SAMPLES, global_steps

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("preempt")
    train = run_job("preempt_job.py", 3, out, "train", cwd=out, check=False)
    resume = run_job("preempt_job.py", 2, out, "resume", cwd=out)
    return out, train, resume


def test_a_sigterm_to_one_rank_saves_one_step_on_every_rank_and_exits_for_a_restart(runs):
    out, train, _ = runs
    assert train.returncode == PREEMPTED_EXIT_CODE, train.stderr[-4000:]
    ranks = [torch.load(out / f"preempted-w3-rank{r}.pt") for r in range(3)]
    assert [r["exception"] for r in ranks] == ["Preempted"] * 3
    steps = {r["saved_step"] for r in ranks}
    assert len(steps) == 1
    (step,) = steps
    # the step after the notice (rank 2 signalled itself after its 7th batch), the same on every rank
    assert step == 7
    checkpoint = torch.load(out / "checkpoints" / "last-preempted.ckpt", weights_only=False)
    assert checkpoint["global_step"] == step
    assert [len(r["steps"]) for r in ranks] == [step] * 3


def test_the_job_resumes_the_preemption_checkpoint_on_fewer_ranks_with_nothing_lost(runs):
    out, _, _ = runs
    full = global_steps([torch.load(out / f"full-w3-rank{r}.pt") for r in range(3)])
    before = global_steps([torch.load(out / f"preempted-w3-rank{r}.pt") for r in range(3)])
    resumed = [torch.load(out / f"resumed-w2-rank{r}.pt") for r in range(2)]
    after = global_steps(resumed)
    assert not set(before) & set(after), "a step was trained twice"
    assert {**before, **after} == full
    for epoch in (0, 1):
        seen = [i for (e, _), indices in [*before.items(), *after.items()] if e == epoch for i in indices]
        assert sorted(seen) == list(range(NUM_SAMPLES))
    reference = torch.load(out / "full-w3-rank0.pt")["params"]
    for rank in resumed:
        assert max((rank["params"][k] - reference[k]).abs().max().item() for k in reference) <= 1e-6
