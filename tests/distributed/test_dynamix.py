"""DynamixCallback in real 2-process jobs: an emulated 3x slower rank, and a resumed run.

The tests assert what the callback does with what it measures (gathers, decides on rank 0, applies on
every rank, logs, resumes), never how fast this machine was.
"""

from __future__ import annotations

import csv
import itertools
import json
import math

import numpy as np
import pytest

from tests.distributed.conftest import run_job

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def balance(tmp_path_factory, pools):
    out = tmp_path_factory.mktemp("balance")
    pools(2).run_script("dynamix_job.py", "balance", out, cwd=out)
    return json.loads((out / "balance.json").read_text())


def test_pid_decides_every_interval_from_the_gathered_state_and_keeps_the_global_batch(balance):
    # how far pid moves samples to the fast rank, and how equal the ranks' compute ends, is measured by
    # `dynamix bench balance` and `make demo`, not asserted here: it depends on this machine's timing
    history = balance["history"]
    assert history[0]["sizes"] == [128, 128]
    for before, after in itertools.pairwise(history):
        assert after["sizes"] == before["decision"]  # every decision applied on both ranks by the next interval
        assert sum(before["decision"]) == 256  # PID keeps the global batch
    assert len({tuple(r["decision"]) for r in history}) > 1  # it did move samples


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


def test_a_resumed_run_continues_with_the_same_sizes_and_controller_state(tmp_path, pools):
    pools(2).run_script("dynamix_job.py", "resume", tmp_path, cwd=tmp_path)
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


def test_one_policy_file_drives_the_simulator_and_a_real_two_process_run(tmp_path, pools):
    from lightning_dynamix.control import PPOController
    from lightning_dynamix.control.ppo.files import default_policy_path
    from lightning_dynamix.rl import ClusterSimulator, ScenarioSpace

    policy = default_policy_path()
    pools(2).run_script("dynamix_job.py", "ppo", tmp_path, policy, cwd=tmp_path)
    history = json.loads((tmp_path / "ppo.json").read_text())["history"]
    assert len(history) >= 8
    for record in history:
        # the balancer keeps the global batch; the job's and a rank's adjustments (-25%..+25% each) move it
        before, after = sum(record["sizes"]), sum(record["decision"])
        assert 0.75 * 0.75 * before - 2 <= after <= 1.25 * 1.25 * before + 2, record
    # rank 1 computes 3x slower (virtual clock): the balancer and the policy moved samples from it to rank 0
    final = history[-1]["decision"]
    assert final[0] > 1.5 * final[1], [r["decision"] for r in history]
    # the very same file decides for a simulated cluster
    scenario = ScenarioSpace().sample(np.random.default_rng(0), world_size=2)
    state = ClusterSimulator(scenario, 0).reset()
    assert len(PPOController(policy).decide(state).batch_sizes) == 2


def test_a_policy_trained_for_fewer_ranks_than_the_job_fails_before_training(tmp_path):
    from lightning_dynamix.control.ppo.files import PolicyFile, save_policy
    from lightning_dynamix.control.ppo.network import RankPolicyNetwork

    path = save_policy(
        PolicyFile(RankPolicyNetwork(hidden=8, layers=1), max_world_size=1), tmp_path / "one.safetensors"
    )
    proc = run_job("dynamix_job.py", "ppo", tmp_path, path, cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "the job has 2 ranks but the policy" in proc.stderr
    assert "was trained for at most 1" in proc.stderr
    assert not (tmp_path / "ppo.json").exists()


def test_finetuning_in_a_real_run_updates_the_policy_and_checkpoints_it(tmp_path, pools):
    import torch

    from lightning_dynamix.control import PPOController
    from lightning_dynamix.control.ppo.files import default_policy_path, load_policy

    policy = default_policy_path()
    pools(2).run_script("dynamix_job.py", "finetune", tmp_path, policy, cwd=tmp_path)
    # decisions at steps 4, 6, ..., 40: 18 rewarded transitions, 4 PPO updates of 4
    assert json.loads((tmp_path / "finetune.json").read_text())["updates"] == 4
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    (callback_state,) = [v for k, v in checkpoint["callbacks"].items() if "DynamixCallback" in k]
    saved = callback_state["controller"]["finetune"]
    original = load_policy(policy).network.state_dict()
    assert any(not torch.equal(saved["network"][k], original[k]) for k in original)
    # a new job resumes from the fine-tuned weights
    resumed = PPOController(policy, finetune=True)
    resumed.load_state_dict(callback_state["controller"])
    for name, tensor in resumed.policy.network.state_dict().items():
        torch.testing.assert_close(tensor, saved["network"][name])
