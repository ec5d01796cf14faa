"""DynamixAccelerate in real 2-process jobs (gloo on CPU): started by `accelerate launch` and by `torchrun`, and, where
the launcher is not what a test is about, run on the session's pool of 2 ranks (tests/distributed/pool.py: torchrun's
variables set, the process group formed before the script, as a launcher leaves a rank)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_dynamix.cli.main import main
from lightning_dynamix.distributed import job_environment
from tests import forkserver
from tests.distributed.conftest import JOBS, PRELOAD
from tests.distributed.pool import RankPool

pytestmark = pytest.mark.distributed

NUM_SAMPLES = 150


def launch(launcher: str | Callable[[int], RankPool], out: Path, *args: str, script: str = "accelerate_job.py") -> None:
    """Run ``jobs/<script> OUT ARGS`` on 2 ranks: under ``launcher`` (``"accelerate"`` or ``"torchrun"``), or on the
    session's pools (the ``pools`` fixture)."""
    if not isinstance(launcher, str):
        launcher(2).run_script(script, out, *args, cwd=out)
        return
    env = job_environment(PYTHONPATH=str(JOBS))
    bin_dir = Path(sys.executable).parent
    if launcher == "accelerate":
        command = [str(bin_dir / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
        command += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]
    else:
        command = [str(bin_dir / "torchrun"), "--standalone", "--nproc_per_node", "2"]
    with forkserver.serving(PRELOAD):  # the launcher and its workers forked from a warm Python
        proc = subprocess.run(
            [*command, str(JOBS / script), str(out), *args],
            cwd=out, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"{launcher} exited with {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


def trained_like_one_process(out: Path, job_helpers, optimizer: str, accumulate: int) -> tuple[list, list]:
    """Every rank's saved run and batches, after checking its parameters are one process's on the union of
    the batches (1e-6) and every sample was seen once per epoch."""
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    steps = [r["steps"] for r in ranks]
    expected, _ = job_helpers.reference_training(steps, NUM_SAMPLES, optimizer, accumulate=accumulate)
    for rank in ranks:
        worst = max((rank["params"][k] - expected[k]).abs().max().item() for k in expected)
        assert worst <= 1e-6, f"max abs difference {worst}"
    for epoch in (0, 1):
        seen = [i for s in steps for e, _, indices in s if e == epoch for i in indices]
        assert sorted(seen) == list(range(NUM_SAMPLES))
    return ranks, steps


def batch_sizes(steps: list) -> list[tuple[int, ...]]:
    """Every step's size on each rank."""
    return [tuple(len(s[k][2]) for s in steps) for k in range(len(steps[0]))]


@pytest.mark.parametrize(
    ("launcher", "optimizer", "workers"),
    [("accelerate", "sgd", "0"), ("pool", "adam", "2"), ("torchrun", "sgd", "0")],
    ids=["accelerate-sgd", "pool-adam-workers", "torchrun-sgd"],
)
def test_uneven_changing_sizes_train_exactly_like_one_process(
    tmp_path, job_helpers, pools, launcher, optimizer, workers
):
    launch(pools if launcher == "pool" else launcher, tmp_path, optimizer, workers)
    _, steps = trained_like_one_process(tmp_path, job_helpers, optimizer, accumulate=1)
    # the same number of steps on both ranks, the sizes changed as planned
    assert len(steps[0]) == len(steps[1])
    sizes = batch_sizes(steps)
    assert sizes[0] == (3, 7)
    assert {(6, 2), (1, 9), (5, 5), (2, 3)} <= set(sizes)


def test_a_litdata_streaming_dataset_trains_exactly_like_one_process(tmp_path, job_helpers, pools, litdata_dir):
    # the same samples as a LitData dataset, a plain DataLoader over its StreamingDataset with two workers
    launch(pools, tmp_path, "sgd", "2", "1", f"litdata={litdata_dir}")
    _, steps = trained_like_one_process(tmp_path, job_helpers, "sgd", accumulate=1)
    assert {(6, 2), (1, 9), (5, 5), (2, 3)} <= set(batch_sizes(steps))


def test_a_rank_that_sits_steps_out_trains_exactly_like_one_process_on_the_other_ranks_batches(
    tmp_path, job_helpers, pools
):
    launch(pools, tmp_path, "adam", "0", "2", "sit-out")
    _, steps = trained_like_one_process(tmp_path, job_helpers, "adam", accumulate=2)
    assert {(0, 8), (5, 0), (5, 5), (0, 5)} <= set(batch_sizes(steps))


def test_gradient_accumulation_trains_exactly_like_one_process_on_each_window(tmp_path, job_helpers, pools):
    launch(pools, tmp_path, "sgd", "0", "3")
    # one optimizer step per window of 3 batches, each epoch's last window cut short at the epoch's end
    ranks, steps = trained_like_one_process(tmp_path, job_helpers, "sgd", accumulate=3)
    epoch_lengths = [sum(1 for e, _, _ in steps[0] if e == epoch) for epoch in (0, 1)]
    ends = [(b + 1) % 3 == 0 or b + 1 == epoch_lengths[e] for e, b, _ in steps[0]]
    for rank in ranks:
        assert rank["synced"] == ends  # accumulate() synchronised at the window ends and at each epoch's end
        assert rank["global_step"] == sum(ends)  # DynamixAccelerate counts optimizer steps, not batches
        assert rank["decision_steps"] == list(range(3, sum(ends) + 1, 2))  # warmup 1, then every 2 steps
    # the sizes changed inside some windows (the case the window's correction factor makes exact)
    sizes = batch_sizes(steps)
    windows, current = [], []
    for size, end in zip(sizes, ends):
        current.append(size)
        if end:
            windows.append(current)
            current = []
    assert any(len(set(window)) > 1 for window in windows)
    assert {(4, 4), (2, 8)} <= set(sizes)


def test_bad_input_is_refused_with_what_to_do_instead(tmp_path, pools):
    launch(pools, tmp_path, "errors")
    for rank in range(2):
        messages = torch.load(tmp_path / f"errors{rank}.pt")
        assert "Pass the plain model: dynamix.prepare(model, ...)" in messages["prepared"]
        assert "iterable-style (Stream)" in messages["iterable"]
        assert "fewer than one global batch" in messages["too-small"]
        assert "prepared-ok" not in messages
        assert "different arguments on different ranks" in messages["disagree"]


def launch_pid(pools: Callable[[int], RankPool], out: Path, mode: str) -> list[dict]:
    launch(pools, out, mode, script="accelerate_pid_job.py")
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(2)]


def test_pid_rebalances_an_emulated_slow_rank_and_logs_to_the_trackers(tmp_path, pools):
    ranks = launch_pid(pools, tmp_path, "balance")
    history = ranks[0]["history"]
    assert [r["decision"] for r in history] == [r["decision"] for r in ranks[1]["history"]]  # the same on both
    assert [r["step"] for r in history] == list(range(10, 61, 5))
    # rank 1 computes 3x slower (on the job's virtual clock): pid keeps the global batch and splits it 3:1 at its
    # first decision, then holds it
    assert history[0]["sizes"] == [64, 64]
    assert [r["decision"] for r in history] == [[96, 32]] * len(history)
    # both ranks trained the same sizes at every step
    assert [t["step"] for t in ranks[0]["trained"]] == [t["step"] for t in ranks[1]["trained"]]
    # the metrics reached Accelerate's TensorBoard tracker, and `dynamix report` reads them back
    (summary,) = json.loads(run_report(tmp_path))
    assert summary["intervals"] == len(history)
    assert summary["last_batch_sizes"] == history[-1]["sizes"]


def run_report(log_dir: Path) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        main(["report", str(log_dir), "--json"])
    return buffer.getvalue()


def test_save_state_and_load_state_resume_with_the_same_sizes_order_and_controller(tmp_path, pools):
    first = launch_pid(pools, tmp_path, "first")
    resumed = launch_pid(pools, tmp_path, "resume")
    # rank 0 decides: its controller state is the one saved (Accelerate saves registered objects from rank 0)
    assert resumed[0]["start"]["maker"] == first[0]["saved"]["maker"]
    for rank in range(2):
        saved, start = first[rank]["saved"], resumed[rank]["start"]
        assert (start["step"], start["sizes"]) == (saved["step"], saved["sizes"]) == (20, saved["sizes"])
        assert saved["sizes"] != [64, 64]  # the first run had rebalanced before it saved
        # until the next decision (step 25) the resumed run trains exactly the batches the first run trained
        expected = [t for t in first[rank]["trained"] if 20 < t["step"] <= 25]
        assert resumed[rank]["trained"][: len(expected)] == expected
