"""DynamixEnv: the gymnasium environment a policy trains in, and the rank-shared policy network."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from lightning_dynamix.control import PIDController
from lightning_dynamix.control.ppo.network import ADJUSTMENTS, KEEP, RankPolicyNetwork, apply_adjustments
from lightning_dynamix.metrics import GLOBAL_FEATURES, LOCAL_FEATURES
from lightning_dynamix.rl import ClusterSimulator, Scenario, ScenarioSpace
from lightning_dynamix.rl.env import DynamixEnv, RewardWeights
from tests.unit.test_rl_simulator import two_ranks

KEEP_ALL = np.full(1 + 8, KEEP)  # the job's action, then one per rank


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


def test_keeping_every_proposal_is_the_pid_controller():
    env = DynamixEnv(two_ranks(), max_world_size=8)
    env.reset(seed=0)
    pid = PIDController()
    for _ in range(6):
        expected = pid.decide(env.state).batch_sizes
        env.step(KEEP_ALL)
        assert env.sizes == expected
    # rank 1 is 3x slower: the balancer has moved samples to rank 0 at the same global batch
    assert env.sizes[0] > 2 * env.sizes[1]
    assert sum(env.sizes) == 128


def test_actions_adjust_the_balancers_proposal_and_padding_actions_are_ignored():
    env = DynamixEnv(two_ranks(), max_world_size=8)
    env.reset(seed=0)
    proposal = PIDController().decide(env.state).batch_sizes
    action = np.array([KEEP, 4, 0, 4, 4, 0, 0, 4, 4])  # +25% for rank 0, -25% for rank 1, the rest is padding
    env.step(action)
    assert env.sizes == (round(proposal[0] * 1.25), round(proposal[1] * 0.75))
    assert env.state.batch_sizes == env.sizes


def test_the_jobs_action_scales_the_global_batch_for_good():
    env = DynamixEnv(two_ranks(), max_world_size=8)
    env.reset(seed=0)
    proposal = PIDController().decide(env.state).batch_sizes
    env.step(np.array([3, *[KEEP] * 8]))  # the job's +10%
    assert env.sizes == tuple(round(b * 1.1) for b in proposal)
    # the balancer keeps the global batch the job ran at: it stays grown
    grown = sum(env.sizes)
    env.step(KEEP_ALL)
    assert sum(env.sizes) == grown > 128
    # the job's -10% and a rank's +10% compose
    proposal = PIDController().decide(env.state).batch_sizes
    env.step(np.array([1, 3, KEEP, *[KEEP] * 6]))
    assert env.sizes[0] == round(proposal[0] * 0.9 * 1.1)


def test_sizes_stay_within_the_scenarios_bounds():
    env = DynamixEnv(two_ranks(min_batch_size=60, max_batch_size=70), max_world_size=2)
    env.reset(seed=0)
    env.step(np.array([KEEP, 4, 0]))
    assert env.sizes == (70, 60)


def test_apply_adjustments_moves_every_rank_at_least_one_sample():
    assert apply_adjustments([3, 3, 3], [KEEP, 1, 2, 3], [1] * 3, [None] * 3) == (2, 3, 4)
    assert apply_adjustments([3, 3], [3, KEEP, 1], [1] * 2, [None] * 2) == (4, 3)  # +10% -10%: nearly no change
    assert apply_adjustments([100], [KEEP, 4], [1], [110]) == (110,)
    with pytest.raises(ValueError, match="an action must be an index in"):
        apply_adjustments([3], [KEEP, len(ADJUSTMENTS)], [1], [None])
    with pytest.raises(ValueError, match=r"got 1 actions \(1 for the job \+ 1 per rank\)"):
        apply_adjustments([3], [KEEP], [1], [None])


def test_balancing_the_slow_rank_earns_more_reward_than_undoing_the_balance():
    def total_reward(actions_for):
        env = DynamixEnv(two_ranks(), max_world_size=2, episode_intervals=8)
        env.reset(seed=0)
        rewards = [env.step(actions_for(env))[1] for _ in range(8)]
        return sum(rewards)

    balanced = total_reward(lambda env: np.array([KEEP, KEEP, KEEP]))
    # pushing the fast rank down and the slow one up every time, against the balancer
    unbalanced = total_reward(lambda env: np.array([KEEP, 0, 4]))
    assert balanced > 1.2 * unbalanced


def test_reversing_a_change_costs_the_oscillation_penalty():
    equal = two_ranks(compute_per_sample=(1e-3, 1e-3))  # the balancer keeps equal sizes
    env = DynamixEnv(equal, max_world_size=2, reward_weights=RewardWeights(oscillation=1.0))
    env.reset(seed=0)
    _, _, _, _, first = env.step(np.array([4, KEEP, KEEP]))  # the job's +25%
    _, _, _, _, back = env.step(np.array([KEEP, 0, 0]))  # each rank's -25%
    assert first["reward_terms"]["oscillation"] == 0.0
    # both ranks went 64 -> 80 -> 60: a reversal of log2(60/80) on each
    assert env.sizes == (60, 60)
    assert back["reward_terms"]["oscillation"] == pytest.approx(np.log2(60 / 80))


def test_breaking_a_memory_limit_is_penalised():
    # the balancer gives the fast rank 0 about 96 samples; the policy's +25% breaks its limit
    env = DynamixEnv(two_ranks(memory_limit=(100, 1024)), max_world_size=2, reward_weights=RewardWeights(memory=1.0))
    env.reset(seed=0)
    _, _, _, _, info = env.step(np.array([KEEP, 4, KEEP]))
    assert info["outcome"].out_of_memory == (0,)
    assert info["reward_terms"]["memory"] == pytest.approx(-0.5)


def test_episodes_are_truncated_after_the_configured_number_of_decisions():
    env = DynamixEnv(two_ranks(), max_world_size=2, episode_intervals=3)
    env.reset(seed=0)
    flags = [env.step(np.array([KEEP, KEEP, KEEP]))[2:4] for _ in range(3)]
    assert flags == [(False, False), (False, False), (False, True)]


def run_to_target(env, action, first=None, seed=0):
    """One episode, ``first`` actions then ``action`` every decision: (return of the time terms, seconds, reached)."""
    env.reset(seed=seed)
    started, total, decisions = env.simulator.time, 0.0, list(first or [])
    while True:
        _, _, terminated, truncated, info = env.step(np.array(decisions.pop(0) if decisions else action))
        total += info["reward_terms"]["progress"] + info["reward_terms"]["time"]
        if terminated or truncated:
            return total, info["outcome"].time - started, terminated


def test_an_episode_ends_at_the_target_and_its_return_is_minus_the_time_to_it():
    env = DynamixEnv(two_ranks(), max_world_size=2)
    env.reset(seed=0)
    remaining, scale = env._remaining, env.reward_scale
    total, seconds, reached = run_to_target(env, np.array([KEEP, KEEP, KEEP]))
    assert reached
    assert env.simulator.accuracy >= env.scenario.target_accuracy
    assert total == pytest.approx(remaining / scale.progress - seconds / scale.time, rel=1e-9)


def test_runs_that_reach_the_target_sooner_have_higher_returns():
    env = DynamixEnv(two_ranks(), max_world_size=2)
    keep = [KEEP, KEEP, KEEP]
    first_decisions = {  # then the balancer alone (pid)
        "pid": [],
        "global batch -25%": [[0, KEEP, KEEP]],
        "global batch +25%": [[4, KEEP, KEEP]],
        "global batch +95%": [[4, KEEP, KEEP]] * 3,
    }
    runs = {name: run_to_target(env, keep, first) for name, first in first_decisions.items()}
    assert all(reached for _, _, reached in runs.values())
    seconds = sorted(runs, key=lambda name: runs[name][1])
    assert sorted(runs, key=lambda name: -runs[name][0]) == seconds
    assert runs[seconds[-1]][1] > 1.05 * runs[seconds[0]][1]  # the runs differ


def test_a_batch_that_costs_accuracy_ceiling_is_charged_the_progress_it_will_need():
    # a noise scale far below the batch: growing the batch lowers the ceiling, so R grows
    env = DynamixEnv(two_ranks(noise_scale_start=16.0, noise_scale_end=16.0, generalization_gap=0.03), max_world_size=2)
    env.reset(seed=0)
    _, _, _, _, info = env.step(np.array([4, KEEP, KEEP]))  # the job's +25%, beyond the noise scale
    outcome = info["outcome"]
    progress_only = outcome.progress / env.reward_scale.progress
    assert outcome.accuracy_ceiling < env.scenario.best_accuracy
    assert info["reward_terms"]["progress"] < progress_only


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
        assert actions.shape == (1 + n,)
    # permuting the ranks permutes their logits and leaves the job's: the network has no notion of rank order
    ranks = torch.randn(1, 5, len(LOCAL_FEATURES))
    cluster = torch.randn(1, len(GLOBAL_FEATURES))
    mask = torch.ones(1, 5)
    order = torch.tensor([3, 0, 4, 1, 2])
    logits = network.logits(ranks, cluster, mask)
    permuted = network.logits(ranks[:, order], cluster, mask)
    torch.testing.assert_close(permuted[:, 1:], logits[:, 1:][:, order])
    torch.testing.assert_close(permuted[:, 0], logits[:, 0])


def test_padding_ranks_keep_their_size_and_change_nothing_for_the_real_ones():
    torch.manual_seed(0)
    network = RankPolicyNetwork(hidden=16)
    ranks = torch.randn(1, 3, len(LOCAL_FEATURES))
    cluster = torch.randn(1, len(GLOBAL_FEATURES))
    padded = torch.cat([ranks, torch.randn(1, 5, len(LOCAL_FEATURES))], dim=1)
    mask = torch.tensor([[1.0] * 3 + [0.0] * 5])
    logits = network.logits(padded, cluster, mask)
    torch.testing.assert_close(logits[:, :4], network.logits(ranks, cluster, torch.ones(1, 3)))  # job + 3 ranks
    probabilities = torch.softmax(logits[0, 4:], dim=-1)
    assert (probabilities[:, KEEP] > 1 - 1e-6).all()
    torch.testing.assert_close(network.value(padded, cluster, mask), network.value(ranks, cluster, torch.ones(1, 3)))
