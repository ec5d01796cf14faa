"""DynamixEnv: the gymnasium environment a policy trains in, and the rank-shared policy network."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from lightning_dynamix.metrics import GLOBAL_FEATURES, LOCAL_FEATURES
from lightning_dynamix.rl import ClusterSimulator, Scenario, ScenarioSpace
from lightning_dynamix.rl.env import DynamixEnv, RewardWeights
from lightning_dynamix.rl.policy import ADJUSTMENTS, KEEP, RankPolicyNetwork, apply_adjustments
from tests.unit.test_rl_simulator import two_ranks

KEEP_ALL = np.full(8, KEEP)


def test_the_env_passes_gymnasiums_checks():
    env = DynamixEnv(ScenarioSpace(world_sizes=(1, 3, 8)), max_world_size=8, episode_intervals=4)
    check_env(env, skip_render_check=True)


def test_observations_are_the_cluster_states_encoding_padded_with_a_mask():
    env = DynamixEnv(two_ranks(), max_world_size=8)
    obs, info = env.reset(seed=0)
    assert obs["ranks"].shape == (8, len(LOCAL_FEATURES))
    assert obs["cluster"].shape == (len(GLOBAL_FEATURES),)
    np.testing.assert_array_equal(obs["mask"], [1, 1, 0, 0, 0, 0, 0, 0])
    encoded = env.state.observation()
    np.testing.assert_array_equal(obs["ranks"][:2], encoded["ranks"])
    np.testing.assert_array_equal(obs["ranks"][2:], 0.0)
    np.testing.assert_array_equal(obs["cluster"], encoded["cluster"])
    assert info["scenario"].world_size == 2


def test_actions_move_each_ranks_size_and_padding_actions_are_ignored():
    env = DynamixEnv(two_ranks(), max_world_size=8)
    env.reset(seed=0)
    action = np.array([4, 0, 4, 4, 0, 0, 4, 4])  # +25% for rank 0, -25% for rank 1, the rest is padding
    env.step(action)
    assert env.sizes == (80, 48)
    assert env.state.batch_sizes == (80, 48)


def test_sizes_stay_within_the_scenarios_bounds():
    env = DynamixEnv(two_ranks(min_batch_size=60, max_batch_size=70), max_world_size=2)
    env.reset(seed=0)
    env.step(np.array([4, 0]))
    assert env.sizes == (70, 60)


def test_apply_adjustments_moves_every_rank_at_least_one_sample():
    assert apply_adjustments([3, 3, 3], [1, 2, 3], [1] * 3, [None] * 3) == (2, 3, 4)
    assert apply_adjustments([100], [4], [1], [110]) == (110,)
    with pytest.raises(ValueError, match="an action must be an index in"):
        apply_adjustments([3], [len(ADJUSTMENTS)], [1], [None])


def test_balancing_the_slow_rank_earns_more_reward_than_keeping_equal_sizes():
    def total_reward(actions_for):
        env = DynamixEnv(two_ranks(), max_world_size=2, episode_intervals=8)
        env.reset(seed=0)
        rewards = [env.step(actions_for(env))[1] for _ in range(8)]
        return sum(rewards)

    keep = total_reward(lambda env: np.array([KEEP, KEEP]))
    # towards 3:1 (rank 1 is 3x slower), then keep
    balance = total_reward(lambda env: np.array([4, 0]) if env.sizes[0] < 3 * env.sizes[1] else np.array([KEEP, KEEP]))
    assert balance > 1.2 * keep


def test_reversing_a_change_costs_the_oscillation_penalty():
    env = DynamixEnv(two_ranks(), max_world_size=2, reward_weights=RewardWeights(oscillation=1.0))
    env.reset(seed=0)
    _, _, _, _, first = env.step(np.array([4, KEEP]))
    _, _, _, _, back = env.step(np.array([0, KEEP]))
    assert first["reward_terms"]["oscillation"] == 0.0
    # rank 0 went 64 -> 80 -> 60: a reversal of log2(60/80) on one rank of two
    assert back["reward_terms"]["oscillation"] == pytest.approx(np.log2(60 / 80) / 2)


def test_breaking_a_memory_limit_is_penalised():
    env = DynamixEnv(two_ranks(memory_limit=(1024, 70)), max_world_size=2, reward_weights=RewardWeights(memory=1.0))
    env.reset(seed=0)
    _, _, _, _, info = env.step(np.array([KEEP, 4]))
    assert info["outcome"].out_of_memory == (1,)
    assert info["reward_terms"]["memory"] == pytest.approx(-0.5)


def test_episodes_are_truncated_after_the_configured_number_of_decisions():
    env = DynamixEnv(two_ranks(), max_world_size=2, episode_intervals=3)
    env.reset(seed=0)
    flags = [env.step(np.array([KEEP, KEEP]))[2:4] for _ in range(3)]
    assert flags == [(False, False), (False, False), (False, True)]


def test_scenarios_larger_than_the_observation_are_refused():
    with pytest.raises(ValueError, match="raise max_world_size"):
        DynamixEnv(ScenarioSpace(world_sizes=(4, 16)), max_world_size=8)


def test_a_list_of_scenarios_is_cycled_through():
    scenarios = [two_ranks(), Scenario(**{**two_ranks().to_dict(), "initial_batch_size": 32})]
    env = DynamixEnv(scenarios, max_world_size=2)
    sizes = []
    for _ in range(3):
        env.reset()
        sizes.append(env.sizes)
    assert sizes == [(64, 64), (32, 32), (64, 64)]


def test_one_network_scores_any_number_of_ranks_and_treats_them_alike():
    torch.manual_seed(0)
    network = RankPolicyNetwork(hidden=16)
    for n in (1, 2, 8, 64):
        state = ClusterSimulator(Scenario(**{**two_ranks().to_dict()}), 0).reset()
        obs = {
            "ranks": np.tile(state.observation()["ranks"], (n // 2 + 1, 1))[:n],
            "cluster": state.observation()["cluster"],
        }
        actions = network.act(obs)
        assert actions.shape == (n,)
    # permuting the ranks permutes their logits: the network has no notion of rank order
    ranks = torch.randn(1, 5, len(LOCAL_FEATURES))
    cluster = torch.randn(1, len(GLOBAL_FEATURES))
    mask = torch.ones(1, 5)
    order = torch.tensor([3, 0, 4, 1, 2])
    logits = network.logits(ranks, cluster, mask)
    torch.testing.assert_close(network.logits(ranks[:, order], cluster, mask), logits[:, order])


def test_padding_ranks_keep_their_size_and_change_nothing_for_the_real_ones():
    torch.manual_seed(0)
    network = RankPolicyNetwork(hidden=16)
    ranks = torch.randn(1, 3, len(LOCAL_FEATURES))
    cluster = torch.randn(1, len(GLOBAL_FEATURES))
    padded = torch.cat([ranks, torch.randn(1, 5, len(LOCAL_FEATURES))], dim=1)
    mask = torch.tensor([[1.0] * 3 + [0.0] * 5])
    logits = network.logits(padded, cluster, mask)
    torch.testing.assert_close(logits[:, :3], network.logits(ranks, cluster, torch.ones(1, 3)))
    probabilities = torch.softmax(logits[0, 3:], dim=-1)
    assert (probabilities[:, KEEP] > 1 - 1e-6).all()
    torch.testing.assert_close(network.value(padded, cluster, mask), network.value(ranks, cluster, torch.ones(1, 3)))
