"""DynamixCallback in real 2-process jobs: an emulated 3x slower rank, and a resumed run."""

from __future__ import annotations

import csv
import json
import math
import statistics

import pytest

from tests.distributed.conftest import run_job

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def balance(tmp_path_factory):
    out = tmp_path_factory.mktemp("balance")
    run_job("dynamix_job.py", "balance", out, cwd=out)
    return json.loads((out / "balance.json").read_text())


def test_pid_moves_samples_from_the_slow_rank_to_the_fast_one_until_both_take_as_long(balance):
    history = balance["history"]
    assert history[0]["sizes"] == [128, 128]
    final = history[-1]["decision"]
    assert sum(final) == 256  # PID keeps the global batch
    first_gap = history[0]["compute"][1] / history[0]["compute"][0]
    assert first_gap > 2.0  # the emulator did slow rank 1 down
    # rank 1 is 3x slower: it ends with far fewer samples, the split that makes both ranks' own compute
    # equal, i.e. sizes in the ratio of the speeds measured at those sizes (not 3:1: the emulator also
    # triples rank 1's fixed cost per step)
    assert final[0] >= 3 * final[1]
    last_gaps = [r["compute"][1] / r["compute"][0] for r in history[-3:]]
    assert 0.7 < statistics.mean(last_gaps) < 1.4, last_gaps


def test_every_interval_gathers_all_ranks_with_network_and_noise_scale(balance):
    for record in balance["history"]:
        assert len(record["sizes"]) == 2
        assert all(c > 0 for c in record["compute"])
        assert record["bandwidth"] > 0
    noise = [r["noise_scale"] for r in balance["history"]]
    assert all(math.isfinite(n) and n > 0 for n in noise[1:])


def test_per_rank_sizes_and_times_reach_the_trainers_logger(balance):
    with open(f"{balance['log_dir']}/metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    logged = [r for r in rows if r.get("dynamix/rank_1/batch_size")]
    assert [int(float(r["step"])) for r in logged] == [h["step"] for h in balance["history"]]
    assert [int(float(r["dynamix/rank_1/batch_size"])) for r in logged] == [h["sizes"][1] for h in balance["history"]]
    assert all(float(r["dynamix/rank_0/compute_time"]) > 0 for r in logged)


def test_a_resumed_run_continues_with_the_same_sizes_and_controller_state(tmp_path):
    run_job("dynamix_job.py", "resume", tmp_path, cwd=tmp_path)
    result = json.loads((tmp_path / "resume.json").read_text())
    before, after = result["before"], result["after"]
    assert before["sizes"] != [64, 64]  # the first run did rebalance before its checkpoint
    assert after["sizes"] == before["sizes"]
    assert after["controller"] == before["controller"]
    assert sum(before["sizes"]) == 96
    # the learning rate followed the global batch once, and the resumed run does not scale it again
    assert before["lr_scale"] == after["lr_scale"] == pytest.approx(0.75)
    assert before["lr"] == after["lr"] == pytest.approx(0.05 * 0.75)
    assert result["history"][0]["step"] == 35  # decisions continue on the same step grid
