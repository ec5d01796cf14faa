"""Learned batch-size control (DYNAMIX): cluster simulator, gymnasium environment, PPO policy and its files.

Importing this package does not import stable-baselines3; only training a policy does.
"""

from lightning_dynamix.rl.simulator import ClusterSimulator, IntervalOutcome, Scenario, ScenarioSpace, with_world_size

__all__ = ["ClusterSimulator", "IntervalOutcome", "Scenario", "ScenarioSpace", "with_world_size"]
