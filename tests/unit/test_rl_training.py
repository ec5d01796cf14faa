"""Training a policy with stable-baselines3's PPO: it learns, and its file is what the controller runs."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch
from stable_baselines3 import PPO

from lightning_dynamix.control import PPOController
from lightning_dynamix.control.ppo.files import load_policy
from lightning_dynamix.control.ppo.network import KEEP
from lightning_dynamix.control.ppo.sb3 import SharedRankPolicy, silent_logger
from lightning_dynamix.rl import ClusterSimulator, Scenario, ScenarioSpace
from lightning_dynamix.rl.env import DynamixEnv
from lightning_dynamix.rl.train import preset, train_policy

# four ranks, two of them 3x slower, a large fixed cost per step and a noise scale far above the
# batch: beyond balancing (which the PID balancer does), growing the global batch pays
SCENARIO = Scenario(
    world_size=4,
    compute_per_sample=(1e-3, 1e-3, 3e-3, 3e-3),
    step_overhead=(0.1,) * 4,
    data_per_sample=(1e-4,) * 4,
    memory_limit=(1024,) * 4,
    gradient_bytes=4e6,
    bandwidth=1e9,
    initial_batch_size=64,
    noise_scale_start=1e5,
    noise_scale_end=1e6,
    drift=0.0,
)


def mean_reward(act, episodes: int = 2) -> float:
    env = DynamixEnv(SCENARIO, max_world_size=4, episode_intervals=16)
    rewards = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=100 + episode)
        for _ in range(16):
            obs, reward, _, _, _ = env.step(act(obs, env))
            rewards.append(reward)
    return float(np.mean(rewards))


@pytest.mark.e2e
def test_a_short_ppo_training_run_beats_random_and_the_pid_balancer_alone_on_a_fixed_scenario():
    torch.set_num_threads(1)
    env = DynamixEnv(SCENARIO, max_world_size=4, episode_intervals=16, seed=0)
    model = PPO(SharedRankPolicy, env, n_steps=256, batch_size=64, n_epochs=4, gamma=0.9, seed=0, device="cpu")
    model.set_logger(silent_logger())  # no SB3-<date> folder in the temporary directory
    model.learn(6_000)
    trained = mean_reward(lambda obs, env: model.predict(obs, deterministic=True)[0])
    rng = np.random.default_rng(0)
    random = mean_reward(lambda obs, env: rng.integers(0, 5, 1 + 4))  # the job and 4 ranks
    keep = mean_reward(lambda obs, env: np.full(1 + 4, KEEP))  # the balancer's proposals: pid
    print(f"mean reward: trained {trained:.3f}, random {random:.3f}, pid {keep:.3f}")
    assert trained > random + 0.1, (trained, random, keep)
    assert trained > keep + 0.1, (trained, random, keep)


def test_train_policy_writes_a_file_the_controller_and_the_simulator_both_run(tmp_path):
    path, _ = train_policy(preset("tiny"), tmp_path / "tiny.safetensors", log_dir=tmp_path / "logs", preset_name="tiny")
    assert (tmp_path / "logs" / "progress.csv").read_text().count("\n") >= 2
    assert list((tmp_path / "logs").glob("events.out.tfevents.*"))
    loaded = load_policy(path)
    assert loaded.training["preset"] == "tiny"
    assert loaded.training["timesteps"] >= 1024
    assert loaded.training["config"]["max_world_size"] == 64
    evaluation = loaded.training["evaluation"]
    assert set(evaluation["all"]) == {"static", "pid", "goodput", "ppo"}
    controller = PPOController(path)
    simulator = ClusterSimulator(SCENARIO, 0)
    state = simulator.reset()
    decision = controller.decide(state)
    assert len(decision.batch_sizes) == 4


def test_a_configuration_beyond_the_policys_size_is_refused():
    with pytest.raises(ValueError, match="exceed `max_world_size`=8"):
        preset("tiny", max_world_size=8, evaluation_world_sizes=(16,), scenario_space=ScenarioSpace(world_sizes=(2, 4)))
    with pytest.raises(ValueError, match=r"`scenario_space.world_sizes` reach 64 ranks, above `max_world_size`=8"):
        preset("tiny", max_world_size=8)
    with pytest.raises(ValueError, match="`preset` must be one of"):
        preset("huge")


def test_training_can_continue_from_a_policy_file_and_keeps_its_record(tmp_path, monkeypatch):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    first, _ = train_policy(preset("tiny"), tmp_path / "first.safetensors", evaluate=False, preset_name="tiny")
    assert not list(temporary.iterdir())  # no log folder asked for: none left behind
    config = preset("tiny", timesteps=128, n_steps=64, learning_rate=1e-12, seed=3)
    second, record = train_policy(config, tmp_path / "second.safetensors", evaluate=False, init=first)
    assert record["init"]["path"] == str(first)
    assert record["init"]["training"]["preset"] == "tiny"
    # at a vanishing learning rate the continued policy keeps the weights it started from
    before, after = load_policy(first).network.state_dict(), load_policy(second).network.state_dict()
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=1e-6)


def test_a_policy_file_of_another_shape_cannot_be_continued(tmp_path):
    first, _ = train_policy(preset("tiny"), tmp_path / "first.safetensors", evaluate=False)
    shapes = r"max_world_size, hidden, layers = \(64, 64, 2\), the configuration \(64, 32, 2\)"
    with pytest.raises(ValueError, match=shapes):
        train_policy(preset("tiny", hidden=32), tmp_path / "second.safetensors", evaluate=False, init=first)
    with pytest.raises(ValueError, match="`device` must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"):
        preset("tiny", device="gpu")


def test_the_command_line_fine_tunes_at_the_learning_rate_and_clip_range_it_is_given(tmp_path):
    from tests.cli.commands import dynamix_here

    first, _ = train_policy(preset("tiny"), tmp_path / "first.safetensors", evaluate=False)
    second = tmp_path / "second.safetensors"
    dynamix_here(
        "train-policy", "--preset", "tiny", "--init", str(first), "--timesteps", "128", "--learning-rate", "1e-12",
        "--clip-range", "0.05", "--no-evaluate", "--no-progress", "--output", str(second), cwd=tmp_path,
    )  # fmt: skip
    config = load_policy(second).training["config"]
    assert (config["learning_rate"], config["clip_range"]) == (1e-12, 0.05)
    before, after = load_policy(first).network.state_dict(), load_policy(second).network.state_dict()
    for name, tensor in before.items():  # at that rate the weights stay where they started
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=1e-6)
    for option, value, name in (("--learning-rate", "0", "learning_rate"), ("--clip-range", "-0.1", "clip_range")):
        refused = dynamix_here("train-policy", "--preset", "tiny", option, value, cwd=tmp_path, fails=True)
        assert f"`{name}`" in refused
        assert value in refused
