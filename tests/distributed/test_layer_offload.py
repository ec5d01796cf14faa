"""Real layer-offload jobs: trainer ranks under Lightning's launcher, embedding servers they start.

With ``staleness=0`` the DLRM example trained with its tables on servers ends exactly where one
process training it on the trainers' concatenated batches does, for SGD and Adagrad, 1 trainer with
2 servers and 2 trainers with 1 server; a checkpoint resumes on another number of servers and
continues identically; ``staleness=1`` is exactly "step k sees the tables after update k - 2"; a
killed server makes the job fail with an error naming it, and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.utils.data import DataLoader

from lightning_dynamix.distributed import free_port, job_environment
from tests import forkserver
from tests.distributed.conftest import PRELOAD, import_job, run_job
from tests.distributed.pool import run_scripts

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def job():
    return import_job("offload_job")


@pytest.fixture(scope="module")
def fits(tmp_path_factory, pools):
    """The 1-trainer and the 2-trainer job, run at once; each one's output folder, by trainers.

    The 2 trainers' first fit meets 2 servers started with ``python -m lightning_dynamix.serve`` at
    ``external.json``'s port, whose exit codes it keeps. The balance scenario's slow trainer is 4 times
    slower than the other on a virtual clock, so that the job beside it cannot change what pid decides."""
    one, two = tmp_path_factory.mktemp("offload-1-trainer"), tmp_path_factory.mktemp("offload-2-trainers")
    port = free_port()
    command = [sys.executable, "-m", "lightning_dynamix.serve", "--address", f"127.0.0.1:{port}"]
    command += ["--num-servers", "2", "--num-trainers", "2"]
    servers = [forkserver.popen([*command, "--server-rank", str(s)], PRELOAD, env=job_environment()) for s in (0, 1)]
    try:
        scenarios = [f"external-sgd-2-{port}", "sgd-1-0", "adagrad-1-0", "resume-sgd-1-2", "sizes-adagrad-2"]
        scenarios += ["balance-sgd-1", "sizes_resume-adagrad-1-2", "overflow-sgd-1"]
        alone = ["sgd-2-0", "adagrad-2-0", "adagrad-2-0-0", "adagrad-2-1", "resume-adagrad-2-3"]
        run_scripts(
            (pools(1), "offload_job.py", (1, one, *alone), one), (pools(2), "offload_job.py", (2, two, *scenarios), two)
        )
        codes = [server.wait(timeout=30) for server in servers]  # they stop with the fit that used them
    finally:
        for server in servers:
            server.kill()
    (two / "external.json").write_text(json.dumps({"port": port, "exit_codes": codes}))
    return {1: one, 2: two}


@pytest.fixture(scope="module")
def one_trainer(fits):
    return fits[1]


@pytest.fixture(scope="module")
def two_trainers(fits):
    return fits[2]


def reference(job, optimizer: str, trainers: int, staleness: int = 0) -> dict[str, torch.Tensor]:
    """One process on the concatenated batches; with staleness 1 the tables it reads lag one update."""
    torch.manual_seed(0)
    model = job.make_model(optimizer)
    opt = model.configure_optimizers()
    loader = DataLoader(job.make_dataset(trainers), batch_size=job.BATCH * trainers, shuffle=False)
    tables = [f"embeddings.{i}.weight" for i in range(len(job.TABLE_SIZES))]
    params = dict(model.named_parameters())
    stale = {name: params[name].detach().clone() for name in tables}
    for _ in range(job.EPOCHS):
        for dense, sparse, labels in loader:
            opt.zero_grad()
            if staleness == 0:
                logits = model(dense, sparse)
                F.binary_cross_entropy_with_logits(logits, labels).backward()
            else:
                read = {name: stale[name].clone().requires_grad_(True) for name in tables}
                logits = functional_call(model, read, (dense, sparse))
                F.binary_cross_entropy_with_logits(logits, labels).backward()
                for name in tables:
                    params[name].grad = read[name].grad
                stale = {name: params[name].detach().clone() for name in tables}
            opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def assert_same(result: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert result.keys() == expected.keys()
    worst = max((result[k] - expected[k]).abs().max().item() for k in expected if expected[k].is_floating_point())
    assert worst <= TOLERANCE, f"max abs difference {worst:.3g}"


def test_reference_moves_every_table(job):
    # the comparisons below mean something only if 20 steps change the tables well beyond the tolerance
    start = job.make_model("sgd").state_dict()
    trained = reference(job, "sgd", 1)
    for i in range(len(job.TABLE_SIZES)):
        assert (trained[f"embeddings.{i}.weight"] - start[f"embeddings.{i}.weight"]).abs().max() > 100 * TOLERANCE


def assert_pipelined(job, out: Path, scenario: str, ranks: int) -> None:
    """Every step's rows were asked for while the step before it ran, and none was looked up again."""
    for rank in range(ranks):
        counts = json.loads((out / f"{scenario}-rank{rank}.json").read_text())
        assert counts["ahead"] == (job.STEPS_PER_EPOCH - 1) * job.EPOCHS, counts  # all but each epoch's first
        assert counts["misses"] == 0, counts


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_one_trainer_two_servers_with_pipelined_lookups_equals_one_process(one_trainer, job, optimizer):
    assert_same(torch.load(one_trainer / f"{optimizer}-2-0.pt"), reference(job, optimizer, 1))
    assert_pipelined(job, one_trainer, f"{optimizer}-2-0", 1)


def test_lookups_when_each_step_starts_equal_one_process_too(one_trainer, job):
    assert_same(torch.load(one_trainer / "adagrad-2-0-0.pt"), reference(job, "adagrad", 1))
    counts = json.loads((one_trainer / "adagrad-2-0-0-rank0.json").read_text())
    assert counts["ahead"] == 0, counts  # prefetch_depth=0: nothing read ahead


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_two_trainers_one_server_with_pipelined_lookups_equals_one_process(two_trainers, job, optimizer):
    assert_same(torch.load(two_trainers / f"{optimizer}-1-0.pt"), reference(job, optimizer, 2))
    assert_pipelined(job, two_trainers, f"{optimizer}-1-0", 2)


def test_staleness_one_reads_tables_one_update_behind(one_trainer, job):
    # pipelined: each step's rows are asked for while the step before runs, and answered from the tables
    # with the update since rolled back
    assert_pipelined(job, one_trainer, "adagrad-2-1", 1)
    result = torch.load(one_trainer / "adagrad-2-1.pt")
    assert_same(result, reference(job, "adagrad", 1, staleness=1))
    with pytest.raises(AssertionError):  # and that differs from synchronous training
        assert_same(result, reference(job, "adagrad", 1))


def test_resume_from_two_servers_onto_three_continues_identically(one_trainer, job):
    assert_same(torch.load(one_trainer / "resume-adagrad-2-3.pt"), reference(job, "adagrad", 1))
    (directory,) = (one_trainer / "resume-adagrad-2-3").glob("*.ckpt.embeddings")
    assert sorted(p.name for p in directory.iterdir()) == ["server-0-of-2.pt", "server-1-of-2.pt"]


def test_resume_two_trainers_from_one_server_onto_two(two_trainers, job):
    assert_same(torch.load(two_trainers / "resume-sgd-1-2.pt"), reference(job, "sgd", 2))


def test_trainers_of_changing_sizes_sitting_steps_out_in_turn_train_exactly_like_one_process(two_trainers, job):
    # the global batch stays 2 x 16: one process on it is the same reference as for equal trainers
    assert_same(torch.load(two_trainers / "sizes-adagrad-2.pt"), reference(job, "adagrad", 2))
    ranks = [json.loads((two_trainers / f"sizes-adagrad-2-rank{rank}.json").read_text()) for rank in range(2)]
    sizes = ranks[0]["sizes"]
    assert sizes == ranks[1]["sizes"]  # the trainers agree on every step's sizes
    assert len(sizes) == job.STEPS_PER_EPOCH * job.EPOCHS
    assert all(sum(step) == 2 * job.BATCH for step in sizes)
    assert {(24, 8), (8, 24), (32, 0), (0, 32), (20, 12)} <= {tuple(step) for step in sizes}
    epochs = [sizes[start : start + job.STEPS_PER_EPOCH] for start in range(0, len(sizes), job.STEPS_PER_EPOCH)]
    for rank, counts in enumerate(ranks):
        assert counts["misses"] == 0, counts
        # a step's rows are asked for while the step before runs, but at an epoch's start and where it sits out
        assert counts["ahead"] == sum(1 for epoch in epochs for step in epoch[1:] if step[rank]), (rank, counts)


def test_a_checkpoint_of_trainers_of_their_own_sizes_resumes_onto_more_servers_and_continues_identically(
    two_trainers, job
):
    assert_same(torch.load(two_trainers / "sizes_resume-adagrad-1-2.pt"), reference(job, "adagrad", 2))
    sizes = json.loads((two_trainers / "sizes_resume-adagrad-1-2-rank0.json").read_text())["sizes"]
    assert sizes == [job.SIZES[0]] * job.STEPS_PER_EPOCH  # the second epoch, at the checkpoint's sizes


def test_dynamix_balances_the_trainers_of_an_offloaded_model_and_training_stays_exact(two_trainers, job):
    assert_same(torch.load(two_trainers / "balance-sgd-1.pt"), reference(job, "sgd", 2))
    sizes = json.loads((two_trainers / "balance-sgd-1-rank0.json").read_text())["sizes"]
    assert sizes[0] == [job.BATCH, job.BATCH]
    assert sizes[-1][0] > sizes[-1][1]  # trainer 1, 4 times slower, was given fewer samples
    assert all(sum(step) == 2 * job.BATCH for step in sizes)  # pid keeps the global batch


def test_servers_started_with_the_serve_command_train_the_same(two_trainers, job):
    external = json.loads((two_trainers / "external.json").read_text())
    assert external["exit_codes"] == [0, 0]  # they stopped with the fit
    assert_same(torch.load(two_trainers / f"external-sgd-2-{external['port']}.pt"), reference(job, "sgd", 2))


def test_an_overflow_in_one_trainer_s_rows_alone_skips_the_step_on_every_trainer(two_trainers):
    # fp16 with a GradScaler: at step 3 trainer 0's rows' gradients are inf, every dense gradient finite
    ranks = [torch.load(two_trainers / f"overflow-sgd-1-rank{rank}.pt") for rank in range(2)]
    assert [rank["scale"] for rank in ranks] == [1024.0 / 2] * 2  # both skipped it and backed off, once
    for name, tensor in ranks[0]["dense"].items():
        torch.testing.assert_close(ranks[1]["dense"][name], tensor, rtol=0, atol=0)  # still one model
    trained = torch.load(two_trainers / "overflow-sgd-1.pt")
    assert all(bool(torch.isfinite(tensor).all()) for tensor in trained.values())  # no inf reached a table


def test_a_server_that_refuses_a_push_ends_the_job_with_its_error_on_every_trainer(tmp_path: Path):
    # the RPC timeout is 10 minutes: a trainer left waiting for an update would hold the job past the 120 s here
    proc = run_job("offload_job.py", 2, tmp_path, "bad_push", cwd=tmp_path, check=False, timeout=120)
    assert proc.returncode != 0
    for rank in (0, 1):  # each trainer ends with the server's error, named, and what the server refused
        (line,) = [line for line in proc.stderr.splitlines() if line.startswith(f"[rank{rank}]: ") and "Error: " in line
                   and "EmbeddingServerError" in line]  # fmt: skip
        assert "embedding server 0 (embedding-server-0) failed" in line
        assert "stopped serving the step protocol after ValueError: trainer 0 pushed float16 gradients" in line


def test_a_killed_server_fails_the_job_with_its_name_and_leaves_no_process(tmp_path: Path):
    proc = run_job("offload_job.py", 1, tmp_path, "kill", cwd=tmp_path, check=False, timeout=120)
    assert proc.returncode != 0
    assert "embedding server 1 (embedding-server-1) failed or did not answer" in proc.stderr
    assert "embedding server 0" not in proc.stderr  # the live one is not blamed
    for pid in map(int, (tmp_path / "kill-pids.txt").read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
