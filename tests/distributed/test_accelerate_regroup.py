"""DynamixAccelerate: a state saved by 3 processes resumes on 2 and one saved by 2 resumes on 3, exactly.

Each resumed job must train the global batches of the uninterrupted job that saved the state
(every remaining sample once) and end with its parameters; SGD without DataLoader workers and
Adam with 2 workers (jobs/accelerate_regroup_job.py: the preempted launch under torchrun, the others on the
session's pools of ranks).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_dynamix.distributed import job_environment
from tests import forkserver
from tests.distributed.conftest import JOBS, PRELOAD
from tests.distributed.test_regroup import assert_resumed_like_uninterrupted

pytestmark = pytest.mark.distributed


def torchrun(world: int, out: Path, *args: str, expect: int = 0) -> None:
    env = job_environment(PYTHONPATH=str(JOBS))
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", str(world)]
    with forkserver.serving(PRELOAD):  # the launcher and its workers forked from a warm Python
        proc = subprocess.run(
            [*command, str(JOBS / "accelerate_regroup_job.py"), str(out), *args],
            cwd=out, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    if proc.returncode != expect:
        pytest.fail(f"torchrun exited with {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pools):
    out = tmp_path_factory.mktemp("accelerate-regroup")
    torchrun(3, out, expect=1)  # torchrun's own code for a failed worker; each process exited with 143
    # the resumed launches on the session's pools of ranks (tests/distributed/pool.py: torchrun's variables)
    pools(2).run_script("accelerate_regroup_job.py", out, "3", cwd=out)
    pools(3).run_script("accelerate_regroup_job.py", out, "2", cwd=out)

    def load(config, name, world):
        return [torch.load(out / f"{config}-{name}-w{world}-rank{r}.pt") for r in range(world)]

    return load


@pytest.mark.parametrize("config", ["sgd-workers0", "adam-workers2"])
@pytest.mark.parametrize("checkpoint", ["mid", "end"])
@pytest.mark.parametrize(("saved", "resumed"), [(3, 2), (2, 3)], ids=["3-to-2", "2-to-3"])
def test_state_resumed_on_other_processes_trains_the_same_global_batches_and_ends_equal(
    runs, config, checkpoint, saved, resumed
):
    assert_resumed_like_uninterrupted(
        runs(config, "full", saved),
        runs(config, checkpoint, saved),
        runs(config, f"resume-{checkpoint}-from{saved}", resumed),
    )


def test_a_sigterm_to_one_process_saves_one_step_and_the_state_resumes_on_fewer_processes(runs):
    stopped = runs("sgd-workers0", "preempt", 3)
    marks = [rank["steps"][-1] for rank in stopped]
    # process 2 got the notice after optimizer step 6: the flag sent at step 7 is read at step 8, where
    # every process saved and stopped
    assert [m[:2] for m in marks] == [("preempted", 8)] * 3
    before = [{"steps": rank["steps"][:-1]} for rank in stopped]
    assert len(before[0]["steps"]) == 8
    full = runs("sgd-workers0", "full", 3)
    assert_resumed_like_uninterrupted(full, before, runs("sgd-workers0", "resume-preempt-from3", 2))


def test_finish_saves_the_end_so_a_restart_after_it_trains_nothing_again(runs):
    ended = runs("sgd-workers0", "resume-preempt-from3", 2)
    restarted = runs("sgd-workers0", "after-end", 2)
    assert [rank["steps"] for rank in restarted] == [[], []]
    for before, after in zip(ended, restarted, strict=True):
        assert all(torch.equal(before["params"][k], after["params"][k]) for k in before["params"])
